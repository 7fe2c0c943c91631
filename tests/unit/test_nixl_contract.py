"""NixlConnector's P/D contract, as routers speak it (vllm-router
``--vllm-pd-disaggregation``, src/routers/http/vllm_pd_router.rs in
vllm-project/router): the prefill carries ``do_remote_decode``, its
response's ``kv_transfer_params`` go whole into the decode request
(tests/e2e/test_examples.py runs it with the router's binary)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from p2p_kv.adapter import tier
from p2p_kv.adapter.connector import decoder_leg
from p2p_kv.node.roles import Roles, nixl_kv_id

#: What vllm-router 0.1.17 (--kv-connector nixl, its default) sets as the
#: prefill request's kv_transfer_params (build_prefill_kv_transfer_params).
ROUTER_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture
def live_tier() -> Iterator[str]:
    tier._ADDRESSES.append("10.0.0.5:5801")
    try:
        yield "10.0.0.5:5801"
    finally:
        tier._ADDRESSES.remove("10.0.0.5:5801")


def test_the_routers_prefill_parks_under_an_id_derived_from_the_request() -> None:
    roles = Roles.parse(ROUTER_PREFILL, "cmpl-abc-0")
    assert roles.source is None and roles.misspelt == ()
    assert roles.dest_kv_id == nixl_kv_id("cmpl-abc-0")
    assert roles.dest_kv_id != nixl_kv_id("cmpl-abd-0")
    assert len(nixl_kv_id("x" * 10_000)) < 64  # whatever X-Request-Id said


def test_the_prefills_answer_is_a_decode_that_pulls_from_its_tier(
    live_tier: str,
) -> None:
    answer = decoder_leg(ROUTER_PREFILL, "cmpl-abc-0")
    assert answer == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_request_id": nixl_kv_id("cmpl-abc-0"),
        "remote_host": "10.0.0.5",
        "remote_port": 5801,
    }
    # The router copies it whole; the decoder's tier reads the pull.
    decode = Roles.parse(answer, "cmpl-other-0")
    assert decode.dest_kv_id is None and decode.source is not None
    assert decode.source.kv_id == nixl_kv_id("cmpl-abc-0")
    assert decode.source.peer == "10.0.0.5:5801"
    assert decode.source.probe is False  # every block was computed for us


def test_our_own_legs_answer_as_before(live_tier: str) -> None:
    answer = decoder_leg({"remote_decoder": {"kv_request_id": "kv-7"}}, "r1")
    assert answer is not None and set(answer) == {"remote_prefiller"}
    roles = Roles.parse({**ROUTER_PREFILL, "remote_decoder": {"kv_request_id": "k"}})
    assert roles.dest_kv_id == "k"


@pytest.mark.parametrize(
    ("params", "named"),
    [
        (
            {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1},
            "remote_request_id",
        ),
        (
            {
                "do_remote_prefill": True,
                "remote_request_id": "k",
                "remote_host": "h",
                "remote_port": 70000,
            },
            "kv_transfer_params.remote_port",
        ),
        (
            {
                "do_remote_prefill": True,
                "remote_request_id": "k" * 300,
                "remote_host": "h",
                "remote_port": 1,
            },
            "kv_transfer_params.remote_request_id",
        ),
    ],
)
def test_a_malformed_decode_is_refused_naming_the_key(
    params: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        Roles.parse(params, "r")


def test_without_a_request_id_or_a_true_flag_nothing_parks() -> None:
    assert Roles.parse(ROUTER_PREFILL).dest_kv_id is None
    assert (
        Roles.parse({**ROUTER_PREFILL, "do_remote_decode": "yes"}, "r").dest_kv_id
        is None
    )
    assert (
        Roles.parse({"do_remote_prefill": False, "remote_host": None}, "r") == Roles()
    )
