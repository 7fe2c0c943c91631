"""``p2p-kv doctor``: check a machine (and optionally a peer) before serving.

Every check is a function returning a :class:`CheckResult` (so tests and
other tools can call them); :func:`run_checks` runs the set the command line
asks for and :func:`main` prints one line per check, OK or FAIL with what is
wrong and how to fix it, and exits 0 when every check passed, 1 otherwise.

The checks, in order:

``nixl``
    NIXL imports, which plugins it finds, and that a throwaway agent can
    create the UCX backend the way the tier does (no progress thread,
    error-handling mode ``none``).
``loopback``
    Two NIXL agents in this process register a small buffer each and one
    WRITEs into the other over UCX; the bytes and the notification are
    verified. Reports ``UCX_TLS`` (and the other ``UCX_*`` settings).
``port``
    The control socket binds ``host:port`` (the tier's ``host``/``port``
    keys, their ``VLLM_P2P_KV_*`` variables, or ``--host``/``--port``).
``hash-seed``
    ``PYTHONHASHSEED`` is set (unless ``--no-require-hash-seed`` or the
    config says ``require_hash_seed: false``).
``config``
    ``--config`` (the tier's ``secondary_tiers`` entry, as JSON) validates
    exactly as the tier validates it at engine start.
``peer``
    With ``--peer HOST:PORT``: a real handshake (TCP control, NIXL
    metadata) with that peer under an identity built from ``--layout``,
    ``--block-bytes``, ``--hash-seed``, ``--hash-algo``, ``--block-tokens``
    and ``--secret``, then one lookup round trip. Reports READY, or the
    refusal's reason and detail (hash seed, layout, auth, ...). An engine's
    layout string holds its block size in tokens and, on one worker, in
    bytes: those two options default to what it says, and one that
    contradicts it is an error.

``--from-log LINE`` runs no check: it reads the ``p2p_kv identity`` line an
engine logs (address, hash algorithm, seed digest, layout, block bytes,
whether a secret is set) and prints the ``p2p-kv doctor --peer`` command
that checks that engine, every field filled.

The peer identity mirrors what the tier states at first contact
(:func:`p2p_kv.adapter.tier._identity`): vLLM's canonical block hashes of
three fixed blocks, computed here without importing vLLM (its import takes
seconds) with the same recipe: ``NONE_HASH = hash_fn(seed)``, then
``hash_fn((parent, tokens, None))`` per block.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import errno
import hashlib
import importlib
import importlib.metadata
import json
import mmap
import os
import pickle
import re
import shlex
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from p2p_kv.config import (
    TIMEOUT_S,
    ConfigError,
    TierConfig,
    check_hash_seed,
    secret_problem,
)
from p2p_kv.config import check_nixl as _config_check_nixl

if TYPE_CHECKING:
    from p2p_kv.session import Session

#: The seed vLLM derives block hashes from when PYTHONHASHSEED is unset and
#: the hash is cryptographic (``vllm.v1.core.kv_cache_utils``).
VLLM_DEFAULT_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
PEER_KINDS = ("engine", "standalone")
#: Keys of a secondary_tiers entry that vLLM's tier factory consumes itself
#: ("backpressure", its own or the top level's it copied, reaches the tier
#: as an argument the tier ignores with a warning).
_FACTORY_KEYS = ("type", "module_path", "backpressure")

#: Larger is no KV block (vLLM's are KiB to a few MiB): a typo, which
#: crashed the check allocating it.
MAX_BLOCK_BYTES = 1 << 30

_NIXL_FIX = (
    "install the lean pair 'pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1' "
    "(make install does), not the 'nixl' meta package, which pulls CUDA torch"
)

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
        "pass the tier's 'secret' as --secret (or VLLM_P2P_KV_SECRET); both "
        "sides must set the same secret, or neither"
    ),
    "replay": "retry: the peer echoed our nonce",
    "max_inbound_peers": (
        "the peer is at its max_inbound_peers (that many engines connected, "
        "or connections still handshaking): raise max_inbound_peers there, "
        "or find who connects (its refusals metric, too_many_inbound / "
        "too_many_handshaking)"
    ),
}


def _shown(text: str, limit: int = 300) -> str:
    """Peer-chosen text (a Goodbye's reason, a layout string) as one line:
    control characters escaped, so that a party at ``--peer`` cannot write
    lines of its own ("OK ... READY") into the report, and cut to a
    reasonable length."""
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


@dataclass
class CheckResult:
    """One check's verdict: ``summary`` says what was found, ``fix`` (on a
    failure) what to do about it; ``details`` holds the structured facts."""

    name: str
    ok: bool
    summary: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _guard(name: str, fn: Callable[[], CheckResult]) -> CheckResult:
    """Run a check; an unexpected exception is that check's FAIL."""
    try:
        return fn()
    except Exception as exc:
        return CheckResult(
            name,
            False,
            f"check crashed: {type(exc).__name__}: {exc}",
            "report this as a p2p_kv bug, with the output of --json",
        )


# ---------------------------------------------------------------------------
# 1. NIXL and UCX
# ---------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ucx_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith("UCX_")}


def check_nixl() -> CheckResult:
    """NIXL imports; its plugins; a throwaway agent creates the UCX backend."""
    try:
        _config_check_nixl()
    except ConfigError as exc:
        return CheckResult("nixl", False, str(exc), _NIXL_FIX)
    from p2p_kv.data import (
        DEFAULT_UCX_ERROR_HANDLING_MODE,
        _load_nixl,
        check_ucx_error_handling_mode,
    )

    nixl_agent, nixl_agent_config, _ = _load_nixl()
    details: dict[str, Any] = {
        "nixl_version": _version("nixl"),
        "backend_package": next(
            (
                f"{p}=={v}"
                for p in ("nixl-cu13", "nixl-cu12", "nixl-rocm")
                if (v := _version(p)) is not None
            ),
            None,
        ),
    }
    try:
        mode = check_ucx_error_handling_mode(
            DEFAULT_UCX_ERROR_HANDLING_MODE, os.environ.get("UCX_TLS")
        )
    except ValueError as exc:
        return CheckResult("nixl", False, str(exc), "unset UCX_TLS", details)
    config = nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=[]
    )
    agent = nixl_agent(f"p2p_kv-doctor-{uuid.uuid4().hex}", config)
    try:
        plugins = sorted(str(p) for p in agent.get_plugin_list())
        details["plugins"] = plugins
        if "UCX" not in plugins:
            return CheckResult(
                "nixl",
                False,
                f"NIXL finds no UCX plugin (plugins: {', '.join(plugins) or 'none'})",
                "reinstall nixl-cu13 (it ships the UCX plugin); check "
                "NIXL_PLUGIN_DIR if you set it",
                details,
            )
        try:
            agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
        except Exception as exc:
            return CheckResult(
                "nixl",
                False,
                f"NIXL cannot create its UCX backend: {exc}",
                "check the UCX_* variables (UCX_TLS, UCX_NET_DEVICES) name "
                "transports and devices this machine has",
                details,
            )
        details["ucx_params"] = dict(agent.get_backend_params("UCX"))
    finally:
        del agent
    others = [p for p in plugins if p != "UCX"]
    return CheckResult(
        "nixl",
        True,
        f"NIXL {details['nixl_version']} ({details['backend_package']}): UCX "
        f"backend created (error handling {mode!r}); other plugins: "
        f"{', '.join(others) or 'none'}",
        details=details,
    )


def check_loopback(block_bytes: int = 4096) -> CheckResult:
    """Two agents in this process: one WRITEs a block into the other over
    UCX, with a notification; both are verified."""
    name = "loopback"
    env = _ucx_env(os.environ)
    tls = env.get("UCX_TLS")
    where = f"UCX_TLS={tls}" if tls else "UCX_TLS unset (UCX picks: CMA on one host)"
    details: dict[str, Any] = {"ucx_env": env}
    with (
        contextlib.suppress(OSError, ValueError),
        open("/proc/sys/kernel/yama/ptrace_scope") as f,
    ):
        details["ptrace_scope"] = int(f.read().strip())
    try:
        _config_check_nixl()
    except ConfigError as exc:
        return CheckResult(name, False, str(exc), _NIXL_FIX, details)
    import numpy as np

    from p2p_kv.data import NixlDataTransport

    src = np.zeros(2 * block_bytes, dtype=np.uint8)
    dst = np.zeros(2 * block_bytes, dtype=np.uint8)
    src[block_bytes:] = np.random.default_rng().integers(
        1, 256, block_bytes, dtype=np.uint8
    )
    a = NixlDataTransport(src, block_bytes, name="doctor-a")
    b = NixlDataTransport(dst, block_bytes, name="doctor-b")
    try:
        t0 = time.perf_counter()
        a.add_peer(b.local_region())
        a.post_write(b.agent_name, [1], [0], b"doctor")
        done: list[tuple[int, bool]] = []
        notifs: list[tuple[str, bytes]] = []
        end = time.monotonic() + 5.0
        while time.monotonic() < end and not (done and notifs):
            done += a.poll_completions()
            notifs += b.poll_notifs()
            if not (done and notifs):
                time.sleep(0.0005)
        elapsed = time.perf_counter() - t0
        details["elapsed_ms"] = round(elapsed * 1000, 3)
        fix = (
            "UCX could not move bytes between two local agents: unset UCX_TLS "
            "(or include 'tcp' and a shared-memory transport), check "
            "UCX_NET_DEVICES, and run 'ucx_info -d' to list transports"
        )
        if not done:
            return CheckResult(
                name, False, f"loopback WRITE did not complete in 5 s ({where})", fix
            )
        if not done[0][1]:
            return CheckResult(name, False, f"loopback WRITE failed ({where})", fix)
        if not np.array_equal(dst[:block_bytes], src[block_bytes:]):
            return CheckResult(
                name,
                False,
                f"loopback WRITE completed but the bytes differ ({where})",
                fix,
                details,
            )
        if (a.agent_name, b"doctor") not in notifs:
            return CheckResult(
                name,
                False,
                f"loopback WRITE landed but its notification did not arrive ({where})",
                fix,
                details,
            )
    finally:
        a.close()
        b.close()
    scope = details.get("ptrace_scope")
    note = (
        f"; kernel.yama.ptrace_scope={scope}: UCX cannot use CMA between "
        "unrelated processes and falls back to slower transports"
        if isinstance(scope, int) and scope >= 1
        else ""
    )
    return CheckResult(
        name,
        True,
        f"{block_bytes}-byte WRITE + notification between two agents verified "
        f"in {elapsed * 1000:.2f} ms; {where}{note}",
        details=details,
    )


# ---------------------------------------------------------------------------
# 2. the control port
# ---------------------------------------------------------------------------


def check_port(host: str, port: int) -> CheckResult:
    """The control socket binds ``host:port``, as the tier would bind it."""
    details: dict[str, Any] = {"host": host, "port": port}
    try:
        from p2p_kv.control import ControlTransport
    except ImportError as exc:
        return CheckResult(
            "port", False, f"cannot test: {exc}", "reinstall p2p_kv", details
        )
    try:
        control = ControlTransport(host, port)
    except (OSError, ValueError) as exc:
        taken = isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE
        what = (
            f"port {port} on {host} is taken"
            if taken
            else f"cannot bind {host}:{port}: {exc}"
        )
        if taken:
            fix = (
                f"stop whatever holds port {port} (is an engine already running "
                "there?), or pick a free port with the tier's 'port' key "
                "(VLLM_P2P_KV_PORT; --port here)"
            )
        elif isinstance(exc, ValueError) and "control port" in str(exc):
            # A port out of range was told to fix the host.
            fix = (
                "set the tier's 'port' key (VLLM_P2P_KV_PORT; --port here) in 0..65535"
            )
        else:
            fix = (
                "set the tier's 'host' key (VLLM_P2P_KV_HOST; --host here) to "
                "an address of this machine"
            )
        details["error"] = str(exc)
        return CheckResult("port", False, what, fix, details)
    bound = control.port
    control.close()
    note = " (port 0: picked a free one; peers must learn it)" if port == 0 else ""
    details["bound_port"] = bound
    return CheckResult(
        "port", True, f"control socket binds {host}:{bound}{note}", details=details
    )


# ---------------------------------------------------------------------------
# 4. hash seed, 5. tier config
# ---------------------------------------------------------------------------


def check_seed(
    require: bool = True, env: Mapping[str, str] | None = None
) -> CheckResult:
    env = os.environ if env is None else env
    try:
        seed = check_hash_seed(env)
    except ConfigError as exc:
        if not require:
            return CheckResult(
                "hash-seed",
                True,
                "PYTHONHASHSEED not set; not required (every engine must then "
                f"use vLLM's fixed seed {VLLM_DEFAULT_SEED!r} with a "
                "cryptographic hash)",
            )
        return CheckResult(
            "hash-seed",
            False,
            "PYTHONHASHSEED is not set",
            str(exc).removeprefix("p2p_kv: "),
        )
    # Its digest, as the handshake carries it: the seed itself is what
    # keeps block hashes unguessable, and this report is pasted into bug
    # reports; engines that share KV show the same digest.
    from p2p_kv.handshake import seed_digest

    digest = seed_digest(seed).hex()[:16]
    return CheckResult(
        "hash-seed",
        True,
        f"PYTHONHASHSEED set (digest {digest}; engines that share KV show the same)",
        details={"seed_digest": digest},
    )


def parse_config(text: str | None) -> dict[str, Any]:
    """``--config``: JSON text, or ``@path`` to a JSON file; must be an object."""
    if not text:
        return {}
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"--config must be a JSON object, got {type(raw).__name__}")
    return raw


def check_config(
    raw: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> tuple[CheckResult, TierConfig | None]:
    """Validate a secondary_tiers entry as the tier does at engine start."""
    body = {k: v for k, v in raw.items() if k not in _FACTORY_KEYS}
    fix = "fix the key named above in the tier's secondary_tiers entry"
    try:
        cfg = TierConfig.from_dict(body, env)
    except ConfigError as exc:
        if exc.env:
            fix = f"fix {exc.env} (or set the key, which takes precedence)"
        return CheckResult("config", False, str(exc), fix), None
    defaults = TierConfig()
    changed = {
        k: ("***" if k == "secret" else v)
        for k, v in asdict(cfg).items()
        if v != getattr(defaults, k)
    }
    what = (
        ", ".join(f"{k}={v}" for k, v in changed.items()) if changed else "all defaults"
    )
    source = "--config entry" if raw else "no --config; env and defaults"
    return (
        CheckResult(
            "config", True, f"tier config valid ({source}): {what}", details=changed
        ),
        cfg,
    )


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


@dataclass(frozen=True)
class Layout:
    """The fields of an engine's layout string, as the tier joins them:
    model, dtype, KV groups as ``[(tokens per block, layers), ...]``, KV
    bytes per block of one worker, blocks per chunk, TP, PP."""

    model: str
    dtype: str
    groups: tuple[tuple[int, int], ...]
    worker_bytes_per_block: int
    blocks_per_chunk: int
    tp: int
    pp: int

    @property
    def block_tokens(self) -> int:
        """Tokens per block of the first KV group: the engine hashes its
        canonical blocks with this size."""
        return self.groups[0][0]

    def block_bytes(self, page: int = mmap.PAGESIZE) -> int | None:
        """The tier's block (one primary-tier chunk) in bytes, or None where
        the string does not settle it: with several workers the chunk holds
        one copy per worker or one in all, which the string does not say."""
        if self.tp * self.pp != 1 or self.worker_bytes_per_block <= 0:
            return None
        raw = self.worker_bytes_per_block * self.blocks_per_chunk
        return -(-raw // page) * page


def parse_layout(text: str) -> Layout | None:
    """An engine's layout string's fields, or None for a string not in the
    tier's form (a StandalonePeer's ``standalone``, a test's own)."""
    parts = text.rsplit("|", 6)
    if len(parts) != 7:
        return None
    model, dtype, groups_text, *numbers = parts
    try:
        groups = ast.literal_eval(groups_text)
        wkb, bpc, tp, pp = (int(x) for x in numbers)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not (
        isinstance(groups, list)
        and groups
        and all(
            isinstance(g, tuple)
            and len(g) == 2
            and all(type(x) is int and x > 0 for x in g)
            for g in groups
        )
        and min(bpc, tp, pp) > 0
    ):
        return None
    return Layout(model, dtype, tuple(groups), wkb, bpc, tp, pp)


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
                    f"{parsed.blocks_per_chunk} per chunk, one worker)"
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
    from p2p_kv.handshake import seed_digest

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
        line += ' --secret "$VLLM_P2P_KV_SECRET"'
        notes.append(
            "the engine has a secret: export it as VLLM_P2P_KV_SECRET first "
            "(it is never logged)"
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
        from p2p_kv.control import parse_peer

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
        from p2p_kv.standalone import canonical_hashes

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
            f"--secret (or VLLM_P2P_KV_SECRET) {why}",
            "pass the tier's 'secret' as it is set there, or none if it has none",
            details,
        )
    if spec.seed_digest is not None:
        failed = _seed_digest_problem(spec.hash_seed, spec.seed_digest, details)
        if failed is not None:
            return failed
    return _handshake(peer, host, port, spec, canon, timeout_s, details)


def _seed_digest_problem(
    seed: str, want: str, details: dict[str, Any]
) -> CheckResult | None:
    """``--seed-digest``: the seed here must be the engine's; told before
    dialing, as the peer's refusal cannot say whose seed is wrong."""
    from p2p_kv.handshake import seed_digest

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
    import msgspec
    import numpy as np

    from p2p_kv.data import NixlDataTransport
    from p2p_kv.handshake import Identity
    from p2p_kv.manager import Answer, LoadManager, Roles, Source, format_peer
    from p2p_kv.runtime import TierRuntime, fresh_nonce, open_transports
    from p2p_kv.session import Timeouts

    name = "peer"
    target = format_peer(host, port)
    region = np.zeros(spec.block_bytes, dtype=np.uint8)
    data, control = open_transports(
        lambda: NixlDataTransport(region, spec.block_bytes, name="p2p_kv-doctor"),
        "127.0.0.1",
        0,
    )
    me = Identity(
        engine_id=f"p2p_kv-doctor@{socket.gethostname()}/{data.agent_name}",
        hash_algo=spec.hash_algo,
        hash_seed=spec.hash_seed,
        canonical_hashes=canon,
        layout=spec.layout,
        block_bytes=spec.block_bytes,
        num_blocks=data.num_blocks,
        region=msgspec.msgpack.encode(data.local_region()),
        secret=spec.secret.encode() if spec.secret else None,
    )
    timeouts = Timeouts(handshake_s=timeout_s, lookup_s=timeout_s)
    rt = TierRuntime(
        LoadManager(me, nonces=fresh_nonce, timeouts=timeouts),
        control,
        data,
        idle_wait_s=0.02,
    )
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
        while not (session.ready or session.closed) and time.monotonic() < end:
            rt.poll(wait=True)
            connected = connected or control.connected(target)
        details["handshake_ms"] = round((time.monotonic() - t0) * 1000, 2)
        if not session.ready:
            return _not_ready(session, target, timeout_s, details, connected)
        hello = session.peer_hello
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
        if session.closed:
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
    refusal = session.refusal
    if refusal is not None:
        details.update(state="refused", by="us", reason=refusal.reason)
        details["detail"] = refusal.detail
        return CheckResult(
            "peer",
            False,
            f"{target} refused by us: {refusal.reason}: {_shown(refusal.detail)}",
            _REFUSAL_FIXES.get(refusal.reason, ""),
            details,
        )
    why = str(session.close_reason)
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
            _REFUSAL_FIXES.get(reason, ""),
            details,
        )
    from p2p_kv.control import REFUSED

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
    if session.closed and not why.startswith("handshake_timeout"):
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


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------

DESCRIPTION = """\
Check this machine (and optionally a peer) before serving with p2p_kv.
Prints one line per check (OK, or FAIL with the fix); exits 0 when all pass.

--peer HOST:PORT runs a real handshake with that peer under the identity
your engine would state. Pass your engine's own values: --layout must be the
engine's layout string, exactly (model name, dtype, KV groups, bytes per
block, blocks per chunk, TP, PP, joined by '|', as the tier states it in
its handshake), --hash-seed its PYTHONHASHSEED, --hash-algo its
prefix_caching_hash_algo, --secret the tier's 'secret' key. The layout
string gives the block size in tokens and, with one worker (TP and PP 1),
in bytes; --block-tokens and --block-bytes are needed only where it does
not. A refusal names the field that differs.

The engine logs a "p2p_kv identity" line (logger vllm.p2p_kv, at its first
handshake with any peer): --from-log takes that line ('-' reads it from
standard input, '@FILE' finds the last one in a log) and prints the
--peer command for it with every field filled.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The doctor's options, on its own parser or a ``p2p-kv`` subparser."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--config",
        metavar="JSON",
        help="the tier's secondary_tiers entry as a JSON object (or @file)",
    )
    parser.add_argument(
        "--host", help="control host to test (default: config, VLLM_P2P_KV_HOST)"
    )
    parser.add_argument(
        "--port",
        type=int,
        help="control port to test (default: config, VLLM_P2P_KV_PORT, 5800)",
    )
    parser.add_argument(
        "--no-require-hash-seed",
        dest="require_hash_seed",
        action="store_false",
        help="accept an unset PYTHONHASHSEED (as require_hash_seed: false)",
    )
    peer = parser.add_argument_group("peer handshake (with --peer)")
    peer.add_argument("--peer", metavar="HOST:PORT", help="a peer tier to handshake")
    peer.add_argument(
        "--layout",
        help="the engine's layout string, exactly (default: 'standalone' for "
        "--peer-kind standalone; unset otherwise, so a layout refusal shows "
        "the peer's string)",
    )
    peer.add_argument(
        "--block-bytes",
        type=int,
        help="the tier's block size in bytes (default: from --layout with "
        "one worker, else 4096)",
    )
    peer.add_argument(
        "--hash-seed",
        help="the engine's PYTHONHASHSEED (default: this shell's, else vLLM's "
        f"fixed {VLLM_DEFAULT_SEED!r})",
    )
    peer.add_argument(
        "--hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="the engine's prefix_caching_hash_algo (default sha256)",
    )
    peer.add_argument(
        "--block-tokens",
        type=int,
        help="tokens per KV block of the engine's first KV group (default: "
        "from --layout, else 16)",
    )
    peer.add_argument(
        "--seed-digest",
        metavar="HEX",
        help="the engine's seed digest (its identity line's): check the hash "
        "seed here against it before dialing",
    )
    peer.add_argument(
        "--secret", help="the tier's 'secret' (default: config, VLLM_P2P_KV_SECRET)"
    )
    peer.add_argument(
        "--peer-kind",
        choices=PEER_KINDS,
        default="engine",
        help="'standalone' when the peer is a p2p_kv StandalonePeer (its "
        "canonical hashes differ from vLLM's)",
    )
    peer.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds to wait for the handshake (default 5)",
    )
    parser.add_argument(
        "--from-log",
        metavar="LINE",
        help="print the --peer command for the engine whose 'p2p_kv identity' "
        "log line this is ('-': read it from stdin; '@FILE': the last one in "
        "a log), and run no check",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead")


def run_checks(args: argparse.Namespace) -> list[CheckResult]:
    """Every check the parsed options ask for, in order."""
    env = os.environ
    results = [
        _guard("nixl", check_nixl),
        _guard("loopback", check_loopback),
    ]
    try:
        raw = parse_config(args.config)
    except (OSError, ValueError) as exc:
        config_result = CheckResult(
            "config",
            False,
            f"--config is not a JSON object: {exc}",
            "pass the secondary_tiers entry as JSON, e.g. "
            '\'{"host": "10.0.0.5", "port": 5800}\'',
        )
        cfg = None
    else:
        config_result, cfg = check_config(raw, env)
    if cfg is None:  # fall back to env and defaults for the other checks
        try:
            base = TierConfig.from_dict({}, env)
        except ConfigError:
            base = TierConfig()
    else:
        base = cfg
    host = args.host if args.host is not None else base.host
    port = args.port if args.port is not None else base.port
    results.append(_guard("port", lambda: check_port(host, port)))
    require = args.require_hash_seed and base.require_hash_seed
    results.append(_guard("hash-seed", lambda: check_seed(require, env)))
    results.append(config_result)
    if args.peer:
        seed = args.hash_seed
        if seed is None:
            seed = env.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)
        layout = args.layout
        if layout is None:
            layout = "standalone" if args.peer_kind == "standalone" else "(unset)"
        try:
            block_bytes, block_tokens, derived = sizes_from_layout(
                args.layout, args.block_bytes, args.block_tokens
            )
        except ValueError as exc:
            results.append(
                CheckResult(
                    "peer",
                    False,
                    str(exc),
                    "leave the option out (the layout string says it), or "
                    "pass the engine's own layout string",
                    {"peer": args.peer, "state": "error"},
                )
            )
            return results
        spec = PeerSpec(
            layout=layout,
            block_bytes=block_bytes,
            hash_seed=seed,
            secret=args.secret if args.secret is not None else base.secret,
            hash_algo=args.hash_algo,
            block_tokens=block_tokens,
            peer_kind=args.peer_kind,
            seed_digest=args.seed_digest,
        )

        def peer_check() -> CheckResult:
            result = check_peer(args.peer, spec, args.timeout)
            if derived:
                result.details["from_layout"] = derived
            return result

        results.append(_guard("peer", peer_check))
    return results


def render(results: Sequence[CheckResult], as_json: bool = False) -> None:
    """Print the results: one line each (rich when available), or JSON."""
    ok = all(r.ok for r in results)
    if as_json:
        doc = {"ok": ok, "checks": [r.to_dict() for r in results]}
        print(json.dumps(doc, indent=2, default=str))
        return
    try:
        from rich.console import Console
        from rich.text import Text
    except ImportError:
        for r in results:
            print(f"{'OK  ' if r.ok else 'FAIL'} {r.name:<10} {r.summary}")
            if not r.ok and r.fix:
                print(f"     {'':<10} fix: {r.fix}")
        print("all checks passed" if ok else "some checks failed")
        return
    console = Console(highlight=False, soft_wrap=True)
    for r in results:
        console.print(
            Text.assemble(
                ("OK  " if r.ok else "FAIL", "bold green" if r.ok else "bold red"),
                f" {r.name:<10} ",
                r.summary,
            )
        )
        if not r.ok and r.fix:
            console.print(Text.assemble(f"     {'':<10} ", ("fix: ", "yellow"), r.fix))
    console.print(
        Text("all checks passed", "green")
        if ok
        else Text(f"{sum(not r.ok for r in results)} check(s) failed", "red")
    )


def from_log(text: str) -> int:
    """``--from-log``: print the command (stdout) and its notes (stderr)."""
    try:
        ident = parse_identity_line(_read_log_arg(text))
    except (OSError, ValueError) as exc:
        print(f"p2p-kv doctor --from-log: {exc}", file=sys.stderr)
        return 2
    line, notes = peer_command(ident)
    print(line)
    for note in notes:
        print(f"# {note}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.from_log is not None:
        return from_log(args.from_log)
    results = run_checks(args)
    render(results, args.json)
    return 0 if all(r.ok for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2p-kv doctor")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
