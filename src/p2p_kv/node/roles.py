"""A request's p2p legs, parsed from vLLM's ``kv_transfer_params``.

Parsing is separate from the manager because every entry point (the vLLM
adapter, the standalone peer, the doctor) checks a client's legs before a
request reaches a manager: a malformed leg is refused with the field named,
on the caller's side, and nothing malformed gets into the manager.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2p_kv.protocol import MAX_REQ_ID_CHARS


@dataclass(frozen=True, slots=True)
class Source:
    """Consumer leg of a request: where its KV may be loaded from."""

    kv_id: str
    peer: str
    #: ``remote_kv_source``: ask first. ``remote_prefiller``: the prefiller
    #: computed every block for us, so skip the probe.
    probe: bool


#: The ``kv_transfer_params`` keys p2p_kv reads.
LEGS = ("remote_prefiller", "remote_kv_source", "remote_decoder")
#: NixlConnector's keys, which routers that do P/D (vllm-router
#: ``--vllm-pd-disaggregation``, vLLM's toy proxy) send and copy: read as
#: legs (:func:`nixl_kv_id`), never reported as a misspelt one.
FOREIGN_KEYS = frozenset(
    {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
        "tp_size",
    }
)


def nixl_kv_id(req_id: str) -> str:
    """The ``kv_request_id`` a ``do_remote_decode`` prefill parks its
    blocks under: derived from the engine's request id (unique while the
    request lives), so the tier that parks and the connector that answers
    the router name the same id without sharing state, and bounded in
    length whatever id a client chose (vLLM builds its request id from the
    client's ``X-Request-Id``)."""
    return "pd-" + hashlib.blake2b(req_id.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class Roles:
    """A request's p2p legs, parsed once from ``kv_transfer_params``."""

    source: Source | None = None
    #: ``remote_decoder`` present: our stores are parked for a decoder.
    #: An empty id marks a malformed block: its stores fail, not park.
    dest_kv_id: str | None = None
    #: keys that look like a misspelt leg, each with the leg it resembles
    #: (``remote_kv_sorce``: sharing was silently off for the request)
    misspelt: tuple[tuple[str, str], ...] = ()

    @property
    def bad_decoder(self) -> bool:
        """A ``remote_decoder`` leg that names no decoder's request (no
        ``kv_request_id``, or not a mapping): no decoder can fetch what the
        request stores, so each of its store jobs fails
        (:meth:`LoadManager.refuse_store`), as vLLM's own tier fails them,
        instead of succeeding as if the leg were not there."""
        return self.dest_kv_id == ""

    @staticmethod
    def parse(params: Mapping[str, Any] | None, req_id: str = "") -> Roles:
        """Parse vLLM's per-request ``kv_transfer_params``. Malformed legs
        raise ValueError naming the field, so the adapter can refuse them.

        NixlConnector's contract is read too, as routers send it: a
        ``do_remote_decode: true`` prefill (engine request ``req_id``;
        ignored without one) parks for
        the decoder under :func:`nixl_kv_id`; a ``do_remote_prefill: true``
        decode loads ``remote_request_id`` from ``remote_host:remote_port``
        (what :mod:`p2p_kv.adapter.connector` answered the prefill with).
        Our own legs win where a request carries both."""
        if not params:
            return Roles()
        if not isinstance(params, Mapping):
            raise ValueError("kv_transfer_params must be a mapping")
        source = None
        for name, probe in (("remote_prefiller", False), ("remote_kv_source", True)):
            leg = params.get(name)
            if leg is None:
                continue
            if not isinstance(leg, Mapping):
                raise ValueError(f"kv_transfer_params.{name} must be a mapping")
            kv_id, host, port = (
                leg.get("kv_request_id"),
                leg.get("remote_host"),
                leg.get("remote_port"),
            )
            if not kv_id or not host or not port:
                raise ValueError(
                    f"kv_transfer_params.{name} needs kv_request_id, remote_host "
                    f"and remote_port (got {sorted(map(repr, leg))})"
                )
            source = Source(
                _check_kv_id(name, kv_id),
                format_peer(_check_host(name, host), _check_port(name, port)),
                probe,
            )
            break
        if source is None:
            source = _nixl_source(params)
        dest = params.get("remote_decoder")
        dest_kv_id = None
        if isinstance(dest, Mapping):
            raw = dest.get("kv_request_id")
            dest_kv_id = _check_kv_id("remote_decoder", raw) if raw else ""
        elif dest is not None:
            dest_kv_id = ""
        elif params.get("do_remote_decode") is True and req_id:
            # Without req_id (a caller outside an engine's request) there
            # is no id to park under: the key is ignored.
            dest_kv_id = nixl_kv_id(req_id)
        misspelt = tuple(
            (str(key)[:64], leg)
            for key in itertools.islice(params, 64)
            if (leg := _resembled_leg(str(key)[:64]))
        )
        return Roles(source, dest_kv_id, misspelt)


def _nixl_source(params: Mapping[str, Any]) -> Source | None:
    """The source of a ``do_remote_prefill: true`` decode (NixlConnector's
    decode parameters, as a router copies them from the prefill's
    response); None for any other request. Each field the pull needs is
    checked as our own legs' are."""
    if params.get("do_remote_prefill") is not True:
        return None
    name = "do_remote_prefill"
    kv_id, host, port = (
        params.get("remote_request_id"),
        params.get("remote_host"),
        params.get("remote_port"),
    )
    if not kv_id or not host or not port:
        raise ValueError(
            "kv_transfer_params with do_remote_prefill needs remote_request_id, "
            f"remote_host and remote_port (got {sorted(map(repr, params))[:16]})"
        )
    try:
        return Source(
            _check_kv_id(name, kv_id),
            format_peer(_check_host(name, host), _check_port(name, port)),
            False,
        )
    except ValueError as exc:
        # The checks name a leg's fields; these are top-level keys.
        text = str(exc).replace(f"{name}.kv_request_id", "remote_request_id")
        raise ValueError(text.replace(f"{name}.", "")) from None


@functools.lru_cache(maxsize=256)
def _resembled_leg(key: str) -> str:
    """The leg ``key`` looks like a misspelling of, or "". Cached: a client
    sends the same keys with every request, and the comparison runs on the
    engine's scheduling thread."""
    if key in LEGS or key in FOREIGN_KEYS:
        return ""
    close = difflib.get_close_matches(key, LEGS, n=1, cutoff=0.8)
    return close[0] if close else ""


def _check_kv_id(leg: str, kv_id: object) -> str:
    """A client's ``kv_request_id``: what our Lookup and Fetch carry. One
    the protocol cannot carry was taken, and then the peer dropped every
    message naming it (over 256 characters) or it failed to encode (a
    lone surrogate): the request waited out the lookup timeout, and a
    decoder's parked stores waited for a Fetch that could not come."""
    value = str(kv_id) if isinstance(kv_id, str | int) else ""
    if (
        isinstance(kv_id, bool)
        or not 0 < len(value) <= MAX_REQ_ID_CHARS
        or not _utf8(value)
    ):
        shown = repr(kv_id)
        raise ValueError(
            f"kv_transfer_params.{leg}.kv_request_id must be a string or "
            f"integer of 1-{MAX_REQ_ID_CHARS} characters (got "
            f"{shown[:40]}{'...' if len(shown) > 40 else ''})"
        )
    return value


def _utf8(text: str) -> bool:
    """JSON admits lone surrogates ("\\ud800"); no message can carry one."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _check_host(leg: str, host: object) -> str:
    """A client's ``remote_host``: a name or an address, nothing the
    socket layer would choke on later, inside the engine's step."""
    if (
        not isinstance(host, str)
        or not host.strip("[]")
        or any(c.isspace() or c in "/\\@?#;*" for c in host)
        or not _utf8(host)
        # "in:<port>" would read as one of our inbound connections' names
        # (the brackets go: "[in]" is "in" too)
        or host.strip("[]") == "in"
    ):
        raise ValueError(
            f"kv_transfer_params.{leg}.remote_host must be a host name or an "
            f"IP address (got {host!r})"
        )
    return host.strip("[]")


def _check_port(leg: str, port: object) -> int:
    """A client's ``remote_port``: an int (or its decimal string) in
    1..65535."""
    value = -1
    if isinstance(port, int) and not isinstance(port, bool):
        value = port
    elif isinstance(port, str) and port.isdecimal():
        value = int(port)
    if not 0 < value < 65536:
        raise ValueError(
            f"kv_transfer_params.{leg}.remote_port must be a port number "
            f"1-65535 (got {port!r})"
        )
    return value


def format_peer(host: str, port: int) -> str:
    """``host:port``; IPv6 literals get brackets so the port stays parseable."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
