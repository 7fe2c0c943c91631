"""Parsing a request's ``kv_transfer_params`` legs: what a client may send,
and a refusal naming the field for the rest."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_kv.node.roles import Roles
from p2p_kv.peer import is_inbound


def test_roles_parse_rejects_incomplete_legs() -> None:
    with pytest.raises(ValueError, match="remote_kv_source needs"):
        Roles.parse({"remote_kv_source": {"kv_request_id": "x"}})
    roles = Roles.parse(
        {
            "remote_prefiller": {
                "kv_request_id": "x",
                "remote_host": "::1",
                "remote_port": 7,
            }
        }
    )
    assert roles.source is not None and roles.source.peer == "[::1]:7"
    assert not roles.source.probe
    assert Roles.parse({"remote_decoder": {}}).dest_kv_id == ""


@pytest.mark.parametrize(
    ("host", "port", "field"),
    [
        ("h", [1], "remote_port"),
        ("h", {"a": 1}, "remote_port"),
        ("h", True, "remote_port"),
        ("h", -1, "remote_port"),
        ("h", 65536, "remote_port"),
        ("h", "80x", "remote_port"),
        ("bad host", 80, "remote_host"),
        ("h/x", 80, "remote_host"),
        ("h;eth0", 80, "remote_host"),
        (5, 80, "remote_host"),
        ("[]", 80, "remote_host"),
        ("h\ud800", 80, "remote_host"),
        ("in", 80, "remote_host"),  # would read as an inbound connection
        ("[in]", 80, "remote_host"),  # so would this, once unbracketed
        ("[[in]", 80, "remote_host"),
    ],
)
def test_roles_parse_refuses_a_clients_bad_address(
    host: object, port: object, field: str
) -> None:
    """An API client's ``kv_transfer_params`` reach the tier as they came:
    a bad port raised TypeError past the adapter (which refuses only
    ValueError) out of vLLM's add_request, and a bad host was accepted and
    raised from the socket layer inside the engine's step."""
    with pytest.raises(ValueError, match=f"remote_kv_source.{field} must be"):
        Roles.parse(
            {
                "remote_kv_source": {
                    "kv_request_id": "x",
                    "remote_host": host,
                    "remote_port": port,
                }
            }
        )


@pytest.mark.parametrize("leg", ["remote_kv_source", "remote_decoder"])
@pytest.mark.parametrize("kv_id", ["x" * 257, ["a"], {"a": 1}, True, 2.5, "x\ud800"])
def test_roles_parse_refuses_a_kv_id_the_protocol_cannot_carry(
    leg: str, kv_id: object
) -> None:
    """Taken as it came, such an id made every Lookup and Fetch one the
    peer drops (or one that does not encode): the request waited out its
    lookup timeout, a decoder's parked stores their TTL."""
    params = {"kv_request_id": kv_id, "remote_host": "h", "remote_port": 1}
    with pytest.raises(ValueError, match=f"{leg}.kv_request_id must be"):
        Roles.parse({leg: params})
    params["kv_request_id"] = 7
    assert Roles.parse({leg: params}) != Roles()


_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["kv_request_id", "remote_host", "remote_port", "remote_kv_source"]
            )
            | st.integers()
            | st.text(max_size=4),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


_LEG = st.dictionaries(
    st.sampled_from(["kv_request_id", "remote_host", "remote_port"])
    | st.integers()
    | st.none(),
    _JUNK,
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["remote_kv_source", "remote_prefiller", "remote_decoder"]),
        _LEG | _JUNK,
    )
    | _JUNK
)
def test_roles_parse_raises_nothing_but_value_error(params: Any) -> None:
    """vLLM hands the tier whatever its caller put in
    ``kv_transfer_params`` (the offline API takes any Python object), and
    the adapter refuses only ValueError: anything else escaped into
    vLLM's add_request and took the engine down. A leg with an int key
    did (TypeError from sorting its keys for the message). What it takes
    never names one of our inbound connections: ``"[in]"`` did, and its
    sends and close raised inside the engine's step."""
    with contextlib.suppress(ValueError):
        roles = Roles.parse(params)
        assert roles.source is None or not is_inbound(roles.source.peer)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="[]in:", max_size=8), st.integers(1, 65535))
def test_no_client_host_names_an_inbound_connection(host: str, port: int) -> None:
    leg = {"kv_request_id": "x", "remote_host": host, "remote_port": port}
    with contextlib.suppress(ValueError):
        roles = Roles.parse({"remote_kv_source": leg})
        assert roles.source is not None and not is_inbound(roles.source.peer), host


def test_roles_parse_takes_a_port_as_a_decimal_string_and_brackets() -> None:
    leg = {"kv_request_id": "x", "remote_host": "[::1]", "remote_port": "5800"}
    roles = Roles.parse({"remote_kv_source": leg})
    assert roles.source is not None and roles.source.peer == "[::1]:5800"
