"""The doctor's check of a peer: the identity it states (vLLM's canonical
block hashes, the layout string), a real handshake and one lookup, each
refusal with its fix; and an engine's ``p2p_kv identity`` log line read
back into the command that checks that engine."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import pickle
import re
import shlex
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from p2p_kv.runtime.config import (
    TIMEOUT_S,
    ConfigError,
    secret_problem,
)
from p2p_kv.runtime.config import check_nixl as _config_check_nixl

if TYPE_CHECKING:
    from p2p_kv.peer import Session
from p2p_kv.doctor.checks import (
    _NIXL_FIX,
    HASH_ALGOS,
    MAX_BLOCK_BYTES,
    VLLM_DEFAULT_SEED,
    CheckResult,
    _shown,
)
from p2p_kv.peer.handshake import FIXES, parse_layout

_REFUSAL_FIXES = {
    "version": "run the same p2p_kv version on both sides",
    "self": "the peer has our engine id: point --peer at another engine",
    "hash_algo": (
        "pass the engine's prefix_caching_hash_algo as --hash-algo; every "
        "engine must use the same one"
    ),
    "hash_seed": (
        "pass the engine's PYTHONHASHSEED as --hash-seed (default: this "
        "shell's PYTHONHASHSEED); every engine must export the same value"
    ),
    "canonical_hashes": (
        "the block size in tokens (--layout gives it, else --block-tokens) or "
        "the hash function differs; for a StandalonePeer pass --peer-kind "
        "standalone"
    ),
    "layout": (
        "pass the engine's layout string (the peer's, quoted above, if this "
        "engine should match it) as --layout, and --block-bytes if it runs "
        "several workers; or let --from-log write the command from the "
        "engine's 'p2p_kv identity' line; engines that share KV must serve "
        "the same model, dtype, block size and parallelism"
    ),
    "auth": (
        "set P2P_KV_SECRET here to the engine's secret (the doctor reads "
        "it; --secret would show it in ps); both sides must set the same "
        "secret, or neither"
    ),
    "replay": "retry: the peer echoed our nonce",
    "max_inbound_peers": (
        "the peer is at its max_inbound_peers (that many engines connected, "
        "or connections still handshaking): raise max_inbound_peers there, "
        "or find who connects (its refusals metric, too_many_inbound / "
        "too_many_handshaking)"
    ),
}


def refusal_fix(reason: str) -> str:
    """The fix the doctor prints for a refusal: the engines' own (the log
    line's) for a layout field, with the doctor's option to check if the
    stated layout was not the engine's; the doctor's options for the rest."""
    engines = FIXES.get(reason)
    if reason.startswith("layout_") and engines:
        return f"{engines}; or, if --layout was not this engine's, {_REFUSAL_FIXES['layout']}"
    return _REFUSAL_FIXES.get(reason) or engines or ""


# ---------------------------------------------------------------------------
# 6. a peer's handshake
# ---------------------------------------------------------------------------


def _vllm_hash_fn(algo: str) -> Callable[[Any], bytes]:
    """vLLM 0.32's ``get_hash_fn_by_name``, without importing vLLM."""
    if algo == "sha256":
        return lambda x: hashlib.sha256(
            pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
    if algo == "sha256_cbor":
        import cbor2

        return lambda x: hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
    if algo in ("xxhash", "xxhash_cbor"):
        xxhash: Any = importlib.import_module("xxhash")

        if algo == "xxhash":
            return lambda x: bytes(
                xxhash.xxh3_128_digest(
                    pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
                )
            )
        import cbor2

        return lambda x: bytes(xxhash.xxh3_128_digest(cbor2.dumps(x, canonical=True)))
    raise ValueError(f"unsupported hash algorithm {algo!r} (one of {HASH_ALGOS})")


def engine_canonical_hashes(
    seed: str, algo: str = "sha256", block_tokens: int = 16
) -> tuple[bytes, ...]:
    """The canonical hashes a vLLM engine's tier states in its Hello."""
    fn = _vllm_hash_fn(algo)
    prev = fn(seed)  # vLLM's NONE_HASH
    out = []
    for i in range(3):
        tokens = tuple(range(i * block_tokens, (i + 1) * block_tokens))
        prev = fn((prev, tokens, None))
        out.append(prev)
    return tuple(out)


@dataclass(frozen=True)
class PeerSpec:
    """What our engine would state: pass the engine's own values."""

    layout: str
    block_bytes: int
    hash_seed: str
    secret: str | None = None
    hash_algo: str = "sha256"
    block_tokens: int = 16
    #: ``engine``: vLLM's canonical hashes; ``standalone``: a StandalonePeer's.
    peer_kind: str = "engine"
    #: the engine's seed digest (hex, as its identity line shows it): the
    #: seed here must have it, checked before dialing
    seed_digest: str | None = None


def sizes_from_layout(
    layout: str | None, block_bytes: int | None, block_tokens: int | None
) -> tuple[int, int, dict[str, int]]:
    """``--block-bytes`` and ``--block-tokens`` after what ``layout`` says:
    an option left out takes the layout's value (else 4096 bytes, 16
    tokens); one that contradicts it raises ValueError naming both. Also
    returns what came from the layout."""
    parsed = parse_layout(layout) if layout else None
    derived: dict[str, int] = {}
    if parsed is not None:
        tokens = parsed.block_tokens
        if block_tokens is not None and block_tokens != tokens:
            raise ValueError(
                f"--block-tokens {block_tokens} contradicts the layout string, "
                f"whose first KV group has {tokens}-token blocks"
            )
        derived["block_tokens"] = tokens
        size = parsed.block_bytes()
        if size is not None:
            if block_bytes is not None and block_bytes != size:
                raise ValueError(
                    f"--block-bytes {block_bytes} contradicts the layout string, "
                    f"whose blocks are {size} bytes "
                    f"({parsed.worker_bytes_per_block} bytes per KV block x "
                    f"{parsed.blocks_per_chunk} per chunk: one worker's, or "
                    "every worker's in the canonical layout)"
                )
            derived["block_bytes"] = size
    return (
        derived.get("block_bytes", 4096 if block_bytes is None else block_bytes),
        derived.get("block_tokens", 16 if block_tokens is None else block_tokens),
        derived,
    )


# ---------------------------------------------------------------------------
# an engine's identity line -> the doctor's command
# ---------------------------------------------------------------------------

_IDENTITY_MARK = "p2p_kv identity:"
_STRING = r"""(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
_IDENTITY_FIELDS = {
    "address": r"address (?P<v>\S+?),",
    "hash_algo": r"hash (?P<v>[\w-]+),",
    "seed_digest": r"seed digest (?P<v>[0-9a-f]+),",
    "layout": rf"layout (?P<v>{_STRING})",
    "block_bytes": r"block (?P<v>\d+) bytes",
    "secret": r"secret (?P<v>set|none)\b",
}


@dataclass(frozen=True)
class LoggedIdentity:
    """What an engine's ``p2p_kv identity`` line says about it."""

    address: str
    hash_algo: str
    seed_digest: str
    layout: str
    block_bytes: int
    secret: bool


def parse_identity_line(text: str) -> LoggedIdentity:
    """The last ``p2p_kv identity`` line in ``text`` (one line, or a whole
    log), with or without vLLM's prefix. ValueError says what is missing."""
    lines = [line for line in text.splitlines() if _IDENTITY_MARK in line]
    if not lines:
        raise ValueError(
            f"no '{_IDENTITY_MARK}' line in the text given: the engine logs it "
            "(logger vllm.p2p_kv, INFO) at its first handshake with any peer, "
            "such as 'p2p-kv doctor --peer HOST:PORT' with nothing else"
        )
    body = lines[-1].split(_IDENTITY_MARK, 1)[1]
    found: dict[str, str] = {}
    for key, pattern in _IDENTITY_FIELDS.items():
        m = re.search(pattern, body)
        if m is not None:
            found[key] = m.group("v")
    missing = [k.replace("_", " ") for k in _IDENTITY_FIELDS if k not in found]
    if missing:
        raise ValueError(
            f"the identity line has no {', '.join(missing)}: an older p2p_kv "
            "on the engine logs fewer fields; pass --peer, --layout and the "
            "rest by hand"
        )
    try:
        layout = str(ast.literal_eval(found["layout"]))
    except (ValueError, SyntaxError):
        raise ValueError(
            f"the identity line's layout {found['layout']} is cut"
        ) from None
    return LoggedIdentity(
        address=found["address"],
        hash_algo=found["hash_algo"],
        seed_digest=found["seed_digest"],
        layout=layout,
        block_bytes=int(found["block_bytes"]),
        secret=found["secret"] == "set",
    )


def peer_command(ident: LoggedIdentity) -> tuple[str, list[str]]:
    """The ``p2p-kv doctor --peer`` command that checks the engine
    ``ident`` describes, and notes on what the shell that runs it needs."""
    from p2p_kv.peer.handshake import seed_digest

    words = ["p2p-kv", "doctor", "--peer", ident.address]
    words += ["--layout", ident.layout, "--block-bytes", str(ident.block_bytes)]
    parsed = parse_layout(ident.layout)
    if parsed is not None:
        words += ["--block-tokens", str(parsed.block_tokens)]
    words += ["--hash-algo", ident.hash_algo]
    notes = []
    if seed_digest(VLLM_DEFAULT_SEED).hex().startswith(ident.seed_digest):
        # The engine runs without PYTHONHASHSEED, on vLLM's public seed.
        words += ["--hash-seed", VLLM_DEFAULT_SEED, "--no-require-hash-seed"]
    else:
        notes.append(
            "the engine's hash seed is not in its log: run this where "
            "PYTHONHASHSEED is the engine's (or add --hash-seed); "
            "--seed-digest checks it first"
        )
    words += ["--seed-digest", ident.seed_digest]
    line = shlex.join(words)
    if ident.secret:
        # Not ``--secret "$P2P_KV_SECRET"``: an argument is in every
        # process listing (``ps``) while the check runs; the doctor reads
        # the variable itself.
        notes.append(
            "the engine has a secret: run this where P2P_KV_SECRET holds it "
            "(the doctor reads the variable; never pass it as --secret, "
            "which any user sees in ps)"
        )
    return line, notes


def _read_log_arg(text: str) -> str:
    """``--from-log``: the line itself, ``-`` for standard input, or
    ``@path`` for a log file."""
    if text == "-":
        return sys.stdin.read()
    if text.startswith("@"):
        with open(text[1:], errors="replace") as f:
            return f.read()
    return text


def check_peer(peer: str, spec: PeerSpec, timeout_s: float = 5.0) -> CheckResult:
    """Handshake with ``peer`` for up to ``timeout_s`` under ``spec``'s
    identity, then send it one lookup. OK when the session is READY and the
    lookup is answered."""
    name = "peer"
    details: dict[str, Any] = {"peer": peer, "state": "error"}
    try:
        from p2p_kv.control.transport import parse_peer

        host, port = parse_peer(peer)
    except ValueError as exc:
        return CheckResult(name, False, str(exc), "pass --peer HOST:PORT", details)
    except ImportError as exc:
        return CheckResult(
            name, False, f"cannot test: {exc}", "reinstall p2p_kv", details
        )
    try:
        _config_check_nixl()
    except ConfigError as exc:
        return CheckResult(name, False, str(exc), _NIXL_FIX, details)
    if spec.peer_kind == "standalone":
        from p2p_kv.runtime.standalone import canonical_hashes

        canon = canonical_hashes(spec.hash_seed)
    else:
        try:
            canon = engine_canonical_hashes(
                spec.hash_seed, spec.hash_algo, spec.block_tokens
            )
        except (ValueError, ImportError) as exc:
            return CheckResult(
                name, False, f"cannot hash like the engine: {exc}", "", details
            )
    if not 0 < spec.block_bytes <= MAX_BLOCK_BYTES:
        return CheckResult(
            name,
            False,
            f"--block-bytes must be in 1..{MAX_BLOCK_BYTES}, got {spec.block_bytes}",
            "pass the engine's block size in bytes",
            details,
        )
    low, high = TIMEOUT_S  # the tier's own deadlines' bounds
    if not low <= timeout_s <= high:  # NaN too: it said "no handshake within nan s"
        return CheckResult(
            name,
            False,
            f"--timeout must be in {low:g}..{high:g} s, got {timeout_s:g}",
            "pass how long to wait for the peer, in seconds",
            details,
        )
    # As the tier checks it: an empty one meant none here, silently, and one
    # not UTF-8 crashed the check after its sockets were made.
    if spec.secret is not None and (why := secret_problem(spec.secret)):
        return CheckResult(
            name,
            False,
            f"--secret (or P2P_KV_SECRET) {why}",
            "pass the tier's 'secret' as it is set there, or none if it has none",
            details,
        )
    if spec.seed_digest is not None:
        failed = _seed_digest_problem(spec.hash_seed, spec.seed_digest, details)
        if failed is not None:
            return failed
    result = _handshake(peer, host, port, spec, canon, timeout_s, details)
    if str(details.get("reason")).startswith("layout") and spec.secret is not None:
        result = _secret_too(result, peer, host, port, spec, canon, timeout_s)
    return result


#: A layout refusal's detail, as handshake.check_hello words it: the
#: refusing side's peer's value first, its own second.
_LAYOUT_DETAIL = re.compile(r"peer's KV layout (.+) differs from ours (.+?)\)?$")
_BLOCK_DETAIL = re.compile(r"peer's block is (\d+) bytes, ours (\d+)$")


def _secret_too(
    result: CheckResult,
    peer: str,
    host: str,
    port: int,
    spec: PeerSpec,
    canon: tuple[bytes, ...],
    timeout_s: float,
) -> CheckResult:
    """A layout refusal hides whether the secrets match: the handshake
    compares layouts before the secret's proof. Shake hands again stating
    the peer's own layout, so the proof is checked, and report a wrong
    secret beside the layout (the first thing to fix: nothing passes
    without it)."""
    details = result.details
    detail, by = str(details.get("detail", "")), details.get("by")
    theirs_first = by == "us"  # we refused: "peer's" is the peer's value
    probe = None
    if m := _LAYOUT_DETAIL.search(detail):
        try:
            layout = ast.literal_eval(m.group(1 if theirs_first else 2))
        except (ValueError, SyntaxError):
            return result
        probe = replace(spec, layout=str(layout))
    elif m := _BLOCK_DETAIL.search(detail):
        probe = replace(spec, block_bytes=int(m.group(1 if theirs_first else 2)))
    if probe is None:
        return result
    again: dict[str, Any] = {"peer": peer, "state": "error"}
    _handshake(peer, host, port, probe, canon, timeout_s, again)
    if again.get("reason") != "auth":
        details["secret"] = "matches" if again.get("state") == "READY" else "unknown"
        return result
    details["secret"] = "differs"
    details["also"] = {"reason": "auth", "detail": again.get("detail")}
    return CheckResult(
        "peer",
        False,
        f"{result.summary}; and the secret differs: {_shown(str(again.get('detail')))}",
        f"first the secret: {_REFUSAL_FIXES['auth']}; then the layout: {result.fix}",
        details,
    )


def _seed_digest_problem(
    seed: str, want: str, details: dict[str, Any]
) -> CheckResult | None:
    """``--seed-digest``: the seed here must be the engine's; told before
    dialing, as the peer's refusal cannot say whose seed is wrong."""
    from p2p_kv.peer.handshake import seed_digest

    want = want.lower()
    if not (8 <= len(want) <= 64 and all(c in "0123456789abcdef" for c in want)):
        return CheckResult(
            "peer",
            False,
            f"--seed-digest must be 8 to 64 hex digits, got {_shown(want, 80)!r}",
            "pass the seed digest of the engine's identity line",
            details,
        )
    ours = seed_digest(seed).hex()
    if ours.startswith(want):
        return None
    details.update(state="seed_differs", reason="hash_seed")
    return CheckResult(
        "peer",
        False,
        f"the hash seed here (digest {ours[: len(want)]}) is not the engine's "
        f"(digest {want})",
        "run where PYTHONHASHSEED is the engine's, or pass it as --hash-seed",
        details,
    )


def _handshake(
    peer: str,
    host: str,
    port: int,
    spec: PeerSpec,
    canon: tuple[bytes, ...],
    timeout_s: float,
    details: dict[str, Any],
) -> CheckResult:
    import numpy as np

    from p2p_kv.node.manager import Answer
    from p2p_kv.node.roles import Roles, Source, format_peer
    from p2p_kv.peer import Timeouts
    from p2p_kv.runtime.stack import build_runtime, stated_identity

    name = "peer"
    target = format_peer(host, port)
    rt = build_runtime(
        np.zeros(spec.block_bytes, dtype=np.uint8),
        spec.block_bytes,
        lambda data, _address: stated_identity(
            data,
            engine_id=f"p2p_kv-doctor@{socket.gethostname()}/{data.agent_name}",
            hash_algo=spec.hash_algo,
            hash_seed=spec.hash_seed,
            canonical_hashes=canon,
            layout=spec.layout,
            secret=spec.secret.encode() if spec.secret else None,
        ),
        name="p2p_kv-doctor",
        timeouts=Timeouts(handshake_s=timeout_s, lookup_s=timeout_s),
        idle_wait_s=0.02,
    )
    control = rt.control
    m = rt.manager
    req = "p2p_kv-doctor"
    kv_id = f"p2p_kv-doctor-{uuid.uuid4().hex}"
    finished = False
    try:
        t0 = time.monotonic()
        end = t0 + timeout_s
        rt.start_request(req, Roles(Source(kv_id, target, probe=True)))
        session = m.session(target)
        if session is None:  # pragma: no cover - a fresh manager always dials
            return CheckResult(name, False, "could not start a session", "", details)
        rt.pump()
        connected = False  # the dial ever connected (the session closes it)
        while (
            not (session.link.ready or session.link.closed) and time.monotonic() < end
        ):
            rt.poll(wait=True)
            connected = connected or control.connected(target)
        details["handshake_ms"] = round((time.monotonic() - t0) * 1000, 2)
        if not session.link.ready:
            return _not_ready(session, target, timeout_s, details, connected)
        hello = session.link.peer_hello
        details["peer_engine_id"] = hello.engine_id if hello else None
        # One lookup proves the peer's session is READY too and that its
        # engine answers: a real engine's steps (or tier thread) serve it.
        t1 = time.monotonic()
        end = t1 + timeout_s
        key = hashlib.sha256(kv_id.encode()).digest()[:16]
        answer = m.lookup(req, key)
        rt.flush()
        while answer is Answer.RETRY and time.monotonic() < end:
            rt.poll(wait=True)
            answer = m.lookup(req, key)
        if session.link.closed:
            return _not_ready(session, target, timeout_s, details, connected)
        if answer is Answer.RETRY:
            details["state"] = "no_answer"
            return CheckResult(
                name,
                False,
                f"{target}: handshake READY but our lookup got no answer: its "
                "engine is not stepping",
                "check the peer engine is running and not stuck",
                details,
            )
        details["state"] = "READY"
        details["lookup_ms"] = round((time.monotonic() - t1) * 1000, 2)
        rt.end_request(req)
        finished = True
        return CheckResult(
            name,
            True,
            f"{target} READY (handshake {details['handshake_ms']:.1f} ms, lookup "
            f"round trip {details['lookup_ms']:.1f} ms; peer "
            f"{details['peer_engine_id']})",
            details=details,
        )
    finally:
        if not finished:
            m.on_request_finished(req, rt.clock())
        # Send our Goodbye before the sockets close (LINGER is 0).
        m.close_all("p2p_kv doctor done")
        rt.pump()
        time.sleep(0.02)
        rt.close()


def _not_ready(
    session: Session,
    target: str,
    timeout_s: float,
    details: dict[str, Any],
    connected: bool,
) -> CheckResult:
    refusal = session.link.refusal
    if refusal is not None:
        details.update(state="refused", by="us", reason=refusal.reason)
        details["detail"] = refusal.detail
        return CheckResult(
            "peer",
            False,
            f"{target} refused by us: {refusal.reason}: {_shown(refusal.detail)}",
            refusal_fix(refusal.reason),
            details,
        )
    why = str(session.link.close_reason)
    marker = "said goodbye: refused: "
    if marker in why:
        said = why.split(marker, 1)[1]
        reason, _, detail = said.partition(": ")
        if said.endswith(", max_inbound_peers"):  # the manager's own words
            reason, detail = "max_inbound_peers", said
        details.update(state="refused", by="peer", reason=reason, detail=detail)
        return CheckResult(
            "peer",
            False,
            f"{target} refused us: {_shown(said)}",
            refusal_fix(reason),
            details,
        )
    from p2p_kv.control.transport import REFUSED

    for marker, state, fix in (
        (
            "cannot resolve the host",
            "unresolved",
            "check the host name in --peer (this machine's resolver cannot "
            "find it), or pass its address",
        ),
        (
            REFUSED,
            "refused",
            "check the peer engine runs with the p2p_kv tier and that "
            "HOST:PORT is its tier's host/port",
        ),
        (
            "cannot reach",
            "unreachable",
            "check the route to the peer's host and that no firewall drops the port",
        ),
    ):
        if marker in why:
            details.update(state=state, detail=why)
            return CheckResult("peer", False, f"{target}: {_shown(why)}", fix, details)
    if session.link.closed and not why.startswith("handshake_timeout"):
        details.update(state="closed", detail=why)
        return CheckResult(
            "peer",
            False,
            f"{target} closed the session: {_shown(why)}",
            "check the peer's log (logger vllm.p2p_kv)",
            details,
        )
    if not connected:
        details["state"] = "never_connected"
        return CheckResult(
            "peer",
            False,
            f"no connection to {target} within {timeout_s:g} s: nothing answered "
            "our dial",
            "check the peer's host is up and that no firewall drops the port",
            details,
        )
    details["state"] = "timeout"
    return CheckResult(
        "peer",
        False,
        f"no handshake from {target} within {timeout_s:g} s",
        "check the peer engine runs with the p2p_kv tier, that HOST:PORT is "
        "its tier's host/port, and that no firewall blocks the port",
        details,
    )
