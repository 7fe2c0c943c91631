"""P2PKVConnector's answer to a finished prefill: the decode request's
kv_transfer_params, naming the decoder's kv_request_id and where the
blocks wait (tests/e2e/test_examples.py runs it in real engines)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from p2p_kv.adapter import tier
from p2p_kv.adapter.connector import decoder_leg


@pytest.fixture
def live_tier() -> Iterator[str]:
    tier._ADDRESSES.append("10.0.0.5:5801")
    try:
        yield "10.0.0.5:5801"
    finally:
        tier._ADDRESSES.remove("10.0.0.5:5801")


def test_a_prefill_for_a_decoder_answers_with_the_decoders_leg(live_tier: str) -> None:
    leg = decoder_leg({"remote_decoder": {"kv_request_id": "kv-7"}})
    assert leg == {
        "remote_prefiller": {
            "kv_request_id": "kv-7",
            "remote_host": "10.0.0.5",
            "remote_port": 5801,
        }
    }


@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {
            "remote_kv_source": {
                "kv_request_id": "k",
                "remote_host": "h",
                "remote_port": 1,
            }
        },
        {"remote_decoder": {}},  # names no decoder: the tier fails its stores
        {"remote_decoder": "kv-7"},
        {"remote_prefiller": {"kv_request_id": 1}},  # malformed: the tier says why
    ],
)
def test_any_other_request_answers_nothing(live_tier: str, params: object) -> None:
    assert decoder_leg(params) is None


def test_without_a_live_tier_nothing_is_promised() -> None:
    assert tier.local_address() is None
    assert decoder_leg({"remote_decoder": {"kv_request_id": "kv-7"}}) is None
