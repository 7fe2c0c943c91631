"""The doctor's checks of this machine (NIXL, loopback, port, hash seed,
config) and the :class:`CheckResult` every check returns."""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.metadata
import json
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from p2p_kv.runtime.config import (
    ConfigError,
    TierConfig,
    check_hash_seed,
)
from p2p_kv.runtime.config import check_nixl as _config_check_nixl

if TYPE_CHECKING:
    pass

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
    from p2p_kv.data.agent import (
        DEFAULT_UCX_ERROR_HANDLING_MODE,
        check_ucx_error_handling_mode,
        load_nixl,
    )

    nixl_agent, nixl_agent_config, _ = load_nixl()
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
        from p2p_kv.control.transport import ControlTransport
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
                "(P2P_KV_PORT; --port here)"
            )
        elif isinstance(exc, ValueError) and "control port" in str(exc):
            # A port out of range was told to fix the host.
            fix = "set the tier's 'port' key (P2P_KV_PORT; --port here) in 0..65535"
        else:
            fix = (
                "set the tier's 'host' key (P2P_KV_HOST; --host here) to "
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
    from p2p_kv.peer.handshake import seed_digest

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
    """Validate a secondary_tiers entry as the tier does at engine start;
    given a whole ``--kv-transfer-config``, first the parts vLLM needs for
    the tier to load (:mod:`p2p_kv.doctor.kv_transfer`), then its entry."""
    from p2p_kv.doctor.kv_transfer import (
        KVTransferConfigError,
        is_kv_transfer_config,
        tier_entry,
    )

    whole = is_kv_transfer_config(raw)
    if whole:
        try:
            raw = tier_entry(raw)
        except KVTransferConfigError as exc:
            return CheckResult("config", False, str(exc), exc.fix), None
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
    if whole:
        source = "--config's kv-transfer-config and its P2PKVTier entry"
    return (
        CheckResult(
            "config", True, f"tier config valid ({source}): {what}", details=changed
        ),
        cfg,
    )
