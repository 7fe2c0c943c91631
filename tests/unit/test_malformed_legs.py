"""A request's malformed ``remote_decoder`` leg (pure core, in memory).

A ``remote_decoder`` that names no decoder's ``kv_request_id`` (or is not
a mapping) can be fetched by no decoder: each of the request's store jobs
fails, counted in ``protocol_errors`` (``bad_remote_decoder``), as vLLM's
own tier fails them. Dropping the leg reported the stores done, so a
client's malformed prefill request looked like a working one. Through the
adapter and vLLM's manager: tests/integration/test_vllm_tiering.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from p2p_kv.node.roles import Roles
from p2p_kv.runtime.metrics import PROTOCOL_ERRORS, UNKNOWN, MetricsExporter

from .memnet import Net, key


class _Counters:
    """The counters a stats poll sends (gauges and histograms ignored)."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, tuple[str, ...]], float] = {}

    def increase_counter(
        self,
        counter_name: str,
        counter_increase_value: int | float = 1,
        labelvalues: tuple[str, ...] = (),
    ) -> None:
        k = (counter_name, labelvalues)
        self.counters[k] = self.counters.get(k, 0) + counter_increase_value

    def set_gauge(self, *args: Any, **kwargs: Any) -> None:
        pass

    def observe_histogram(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("params", "bad"),
    [
        ({"remote_decoder": {}}, True),
        ({"remote_decoder": {"kv_request_id": ""}}, True),
        ({"remote_decoder": {"remote_host": "h"}}, True),
        ({"remote_decoder": "d1"}, True),
        ({"remote_decoder": {"kv_request_id": "d1"}}, False),
        ({}, False),
        (None, False),
    ],
)
def test_a_decoder_leg_without_its_id_is_bad(params: Any, bad: bool) -> None:
    assert Roles.parse(params).bad_decoder is bad


def test_a_store_of_a_bad_decoder_leg_fails_and_is_counted() -> None:
    net = Net()
    m = net.engines["a"].manager
    m.on_new_request("r", Roles.parse({"remote_decoder": {}}), net.now)
    m.refuse_store(7, "r", "bad_remote_decoder")
    m.refuse_store(8, "r", "bad_remote_decoder")
    results = m.get_finished_jobs(net.now)
    assert [(r.job_id, r.success) for r in results] == [(7, False), (8, False)]
    assert m.protocol_errors == {"bad_remote_decoder": 2}
    assert m.parked_store_count() == 0
    m.on_request_finished("r", net.now)
    assert not any(m.state_report().values())
    sink = _Counters()
    MetricsExporter().collect(m, sink, request_state=0)
    assert sink.counters == {(PROTOCOL_ERRORS, (UNKNOWN, "bad_remote_decoder")): 2}


def test_a_good_decoder_legs_store_still_parks() -> None:
    net = Net()
    m = net.engines["a"].manager
    m.on_new_request(
        "r", Roles.parse({"remote_decoder": {"kv_request_id": "d"}}), net.now
    )
    assert m.submit_store(7, "r", [key(1)], [3], net.now)
    assert m.parked_store_count() == 1
    assert m.get_finished_jobs(net.now) == []
    assert m.protocol_errors == {}


@pytest.mark.parametrize(
    ("key", "leg"),
    [
        ("remote_kv_sorce", "remote_kv_source"),
        ("remote_prefiler", "remote_prefiller"),
        ("remote_decoders", "remote_decoder"),
    ],
)
def test_a_misspelt_leg_is_named_with_the_leg_it_resembles(key: str, leg: str) -> None:
    """``remote_kv_sorce`` turned sharing off for its request with no log
    line and no metric; the adapter now warns with the leg it resembles
    (once per key) and counts it (``protocol_errors`` reason
    ``misspelt_leg``)."""
    roles = Roles.parse({key: {"kv_request_id": "kv", "remote_host": "h"}})
    assert roles.misspelt == ((key, leg),)
    assert roles.source is None and roles.dest_kv_id is None


def test_other_connectors_keys_are_not_taken_for_misspelt_legs() -> None:
    """vLLM's NixlConnector's keys ride in the same params."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e",
        "remote_block_ids": [1],
        "remote_host": "h",
        "remote_port": 1,
        "remote_kv_source": {
            "kv_request_id": "kv",
            "remote_host": "h",
            "remote_port": 5,
        },
    }
    roles = Roles.parse(params)
    assert roles.misspelt == ()
    assert roles.source is not None and roles.source.kv_id == "kv"
