"""The tier's configuration: the keys of its ``secondary_tiers`` entry.

Validated once, at engine start, so that a typo or a bad value stops the
engine with one sentence naming the key and the fix, instead of a tier that
silently never hits. Every key has an environment variable (read when the
key is absent), named like vLLM's own: ``VLLM_P2P_KV_<KEY>``.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from p2p_kv.session import Timeouts

ENV_PREFIX = "VLLM_P2P_KV_"
_CORE = Timeouts()
#: Most peers one engine may dial: each dial holds one descriptor, and the
#: engine needs the rest of its limit for its own files.
MAX_PEERS = 4096
#: heartbeat_ms: a heartbeat leaves every quarter interval, so below 20 ms
#: an idle session is mostly heartbeats; above ten minutes a dead peer
#: holds its requests' slots that long.
HEARTBEAT_MS = (20, 600_000)
#: What the deadlines may be (s) and the idle wait (ms): every wait ends,
#: and a shorter one than a millisecond is no network round trip.
TIMEOUT_S = (0.001, 3600.0)
IDLE_WAIT_MS = (1.0, 60_000.0)
#: Addresses that bind every interface and reach none.
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "0:0:0:0:0:0:0:0"})
#: Each deadline's range (s). A lookup or handshake waiting minutes
#: blocks its request that long; the upper bounds catch milliseconds
#: written where seconds are meant (``lookup_timeout_s: 2000``).
_TIMEOUT_RANGES: dict[str, tuple[float, float]] = {
    "handshake_timeout_s": (TIMEOUT_S[0], 60.0),
    "lookup_timeout_s": (TIMEOUT_S[0], 60.0),
    "fetch_timeout_floor_s": (TIMEOUT_S[0], 600.0),
    "abort_ack_timeout_s": (TIMEOUT_S[0], 60.0),
    "pin_ttl_s": (TIMEOUT_S[0], 600.0),
    "parked_ttl_s": (TIMEOUT_S[0], TIMEOUT_S[1]),
}
_TIMEOUT_KEYS = tuple(_TIMEOUT_RANGES)


class ConfigError(ValueError):
    """A bad tier configuration; the message names the key and the fix.
    ``env``: the environment variable the bad value came from, if one did
    (the fix is there, not in the config)."""

    def __init__(self, message: str, env: str = "") -> None:
        super().__init__(message)
        self.env = env


def secret_problem(secret: str) -> str:
    """What is wrong with a secret as set, or "" (the tier's config and the
    doctor's ``--secret`` alike). Never its value: the text reaches logs."""
    if not secret:
        return (
            "is empty, which authenticates nothing: set the fleet's shared "
            f"secret, or leave the key (and {ENV_PREFIX}SECRET) unset for none"
        )
    try:
        secret.encode()
    except UnicodeEncodeError:
        # It failed later, as the tier built its identity in the engine's step.
        return (
            "is not valid UTF-8 text (an environment variable in another "
            "encoding?): peers hash its UTF-8 bytes; set it as UTF-8"
        )
    return ""


@dataclass(frozen=True)
class TierConfig:
    #: Address this engine's control socket binds to and that peers dial.
    host: str = "127.0.0.1"
    #: Control port (0: pick a free one; peers must then learn it).
    port: int = 5800
    #: Shared secret; when set, peers must prove they know it (HMAC), and
    #: every frame after the handshake is encrypted and authenticated.
    secret: str | None = None
    #: Serve peers without a secret on an address other hosts can reach.
    #: Off (the default), a tier bound to a non-loopback host without a
    #: secret refuses to start: anyone who reaches the port could then read
    #: the KV cache and feed it wrong blocks.
    allow_unauthenticated: bool = False
    #: Longest wait on the control sockets inside an idle engine step: the
    #: idle engine's CPU (lower with longer waits) against the time it may
    #: take a fully idle vLLM 0.32 engine to start a new request.
    idle_wait_ms: float = 200.0
    # The protocol's deadlines default to the core's own (one source).
    heartbeat_ms: float = _CORE.heartbeat_interval_s * 1000
    handshake_timeout_s: float = _CORE.handshake_s
    lookup_timeout_s: float = _CORE.lookup_s
    fetch_timeout_floor_s: float = _CORE.fetch_floor_s
    abort_ack_timeout_s: float = _CORE.abort_ack_s
    pin_ttl_s: float = _CORE.pin_ttl_s
    #: How long a remote_decoder request's blocks wait for their decoder.
    parked_ttl_s: float = 60.0
    #: Require PYTHONHASHSEED (peers must derive the same block hashes).
    require_hash_seed: bool = True
    #: Load remote hits with one-sided READs of the blocks the peer pinned
    #: (no producer step, no round trip after the lookup) and offer ours for
    #: READ. Off: every load is a Fetch that the producer WRITEs (needed
    #: where peers may not read each other's memory, e.g. one-way firewalls).
    read_path: bool = True
    #: READs from a peer on the same host copy straight out of its shared
    #: primary region (opened read-only) instead of going through NIXL:
    #: parallel reads into host memory, DMA speed into GPU memory. Off:
    #: every READ goes through NIXL.
    same_host_copy: bool = True
    #: READs through NIXL land in this much staging memory (host or GPU,
    #: like the region) and are copied into the engine's slots once done,
    #: so a READ given up on can never write slots the engine reused (over
    #: TCP a stalled peer that resumes still serves it). Larger loads move
    #: in pieces. 0: READs land in place, one copy fewer, with that risk.
    read_staging_mib: float = 64.0
    #: Most peers this engine dials at once. Clients name the peers (the
    #: request's ``kv_transfer_params``), and each dial holds a descriptor:
    #: without a bound a burst of requests naming distinct addresses could
    #: leave the engine unable to open a file. A request naming a peer past
    #: the bound recomputes (``refusals{reason="too_many_peers"}``).
    max_peers: int = 256
    #: Most peers connected to this engine at once. Each bound on what one
    #: peer can make us hold (``docs/architecture.md``, Per-peer bounds)
    #: holds per connection, so without this one a party opening many
    #: connections multiplied them. Past it a newly proven connection is
    #: refused (``refusals{reason="too_many_inbound"}``) and, of those still
    #: handshaking, the oldest dropped (``too_many_handshaking``).
    max_inbound_peers: int = 512

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], env: Mapping[str, str] | None = None
    ) -> TierConfig:
        env = os.environ if env is None else env
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            guesses = [
                f"{k!r} -> {close[0]!r}"
                for k in unknown
                if (close := difflib.get_close_matches(str(k), known, n=1))
            ]
            meant = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
            raise ConfigError(
                f"p2p_kv: unknown tier config key(s) {unknown}{meant}; known "
                f"keys: {sorted(known)}"
            )
        if raw.get("secret", "") is None and ENV_PREFIX + "SECRET" in env:
            # The key wins over the variable: the fleet's secret, set for
            # this engine, was silently dropped and the tier ran open.
            raise ConfigError(
                f"p2p_kv: secret is null in the tier's entry but {ENV_PREFIX}SECRET "
                "is set: remove the key to use the variable, or unset the "
                "variable for no secret"
            )
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, f in known.items():
            source = f"secondary_tiers[].{name}"
            if name in raw:
                value: Any = raw[name]
            elif ENV_PREFIX + name.upper() in env:
                source = ENV_PREFIX + name.upper()
                value = env[source]
            else:
                continue
            sources[name] = source
            values[name] = _coerce(
                name, f.type, value, source, from_env=source.startswith(ENV_PREFIX)
            )
        cfg = cls(**values)
        cfg._check(sources)
        return cfg

    def _check(self, sources: Mapping[str, str] | None = None) -> None:
        """Refuse values no deployment means. ``sources`` names where a key
        came from when it was an environment variable, so the message says
        which of the two to fix."""

        def bad(name: str, text: str) -> ConfigError:
            env = (sources or {}).get(name, "")
            if not env.startswith(ENV_PREFIX):
                return ConfigError(f"p2p_kv: {name} {text}")
            return ConfigError(f"p2p_kv: {name} (from {env}) {text}", env=env)

        if not 0 <= self.port <= 65535:
            raise bad("port", f"{self.port} is not in 0..65535")
        if not HEARTBEAT_MS[0] <= self.heartbeat_ms <= HEARTBEAT_MS[1]:
            raise bad(
                "heartbeat_ms",
                f"{self.heartbeat_ms} is not in {HEARTBEAT_MS[0]}..{HEARTBEAT_MS[1]} "
                "ms (a heartbeat leaves every quarter interval; a peer silent "
                "for 1.5 intervals is dropped)",
            )
        for name, low, high, unit in (
            ("idle_wait_ms", *IDLE_WAIT_MS, "ms"),
            *((n, *r, "s") for n, r in _TIMEOUT_RANGES.items()),
        ):
            value = getattr(self, name)
            if not low <= value <= high:  # NaN too
                # Every wait must end, and none is shorter than a round trip:
                # outside these, a unit was mistaken (ms for s) or a typo.
                hint = ""
                if unit == "s" and value > high and low <= value / 1000 <= high:
                    hint = (
                        f": it looks like milliseconds; for {value / 1000:g} s "
                        f"write {value / 1000:g}"
                    )
                raise bad(name, f"{value} is not in {low:g}..{high:g} {unit}{hint}")
        if not (self.read_staging_mib >= 0 and math.isfinite(self.read_staging_mib)):
            raise bad(
                "read_staging_mib",
                f"{self.read_staging_mib} must be >= 0 and finite (0 turns "
                "staging off)",
            )
        if self.secret is not None and (problem := secret_problem(self.secret)):
            raise bad("secret", problem)
        if not 1 <= self.max_peers <= MAX_PEERS:
            raise bad(
                "max_peers",
                f"{self.max_peers} is not in 1..{MAX_PEERS} (a descriptor a peer)",
            )
        if self.max_inbound_peers < 1:
            raise bad("max_inbound_peers", f"{self.max_inbound_peers} must be >= 1")
        if not self.host:
            raise bad("host", "is empty; set the address peers dial")
        if self.host.strip("[]") in WILDCARD_HOSTS:
            # It is bound and also handed to peers (config_info's
            # p2p_kv_address, which routers pass on): no peer can dial it.
            raise bad(
                "host",
                f"{self.host!r} binds every interface but is also the address "
                "peers dial, which none can; set this host's address or name "
                "on the network the engines share",
            )
        if (
            self.secret is None
            and not self.allow_unauthenticated
            and not is_loopback(self.host)
        ):
            raise bad(
                "host",
                f"{self.host!r} is reachable from other hosts and no secret is "
                "set: anyone who reaches the port could read this engine's KV "
                f"cache and feed it wrong blocks. Set the fleet's shared "
                f"'secret' (or {ENV_PREFIX}SECRET), or, on a network you trust "
                "entirely, set allow_unauthenticated: true",
            )

        if not self.read_path and self.secret is None:
            raise bad(
                "read_path",
                "is false (every load is WRITTEN by the producer) but no secret "
                "is set: a producer writes only to peers whose NIXL metadata it "
                "loaded, and it loads that only from peers that proved the "
                "secret (malformed metadata can abort the process inside UCX). "
                "Set the fleet's shared 'secret', or read_path: true",
            )

    def timeouts(self) -> Timeouts:
        return Timeouts(
            handshake_s=self.handshake_timeout_s,
            heartbeat_interval_s=self.heartbeat_ms / 1000,
            lookup_s=self.lookup_timeout_s,
            fetch_floor_s=self.fetch_timeout_floor_s,
            abort_ack_s=self.abort_ack_timeout_s,
            pin_ttl_s=self.pin_ttl_s,
            parked_wait_s=self.parked_ttl_s,
        )


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (a name
    that does not resolve counts as reachable: the bind reports it)."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback
        for info in infos
    )


def check_hash_seed(env: Mapping[str, str] | None = None) -> str:
    """PYTHONHASHSEED, or a ConfigError saying why it must be set."""
    env = os.environ if env is None else env
    seed = env.get("PYTHONHASHSEED")
    if seed is None:
        raise ConfigError(
            "p2p_kv: PYTHONHASHSEED is not set. Peers must derive identical "
            "block hashes: export the same PYTHONHASHSEED (e.g. 0) for every "
            "engine, or set require_hash_seed: false if all engines use "
            "vLLM's fixed default seed with a cryptographic hash."
        )
    return seed


def check_nixl() -> None:
    """NIXL importable, or a ConfigError saying how to install it."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"p2p_kv: NIXL is not importable ({exc}); install the lean pair "
            "'pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1' (make install "
            "does), not the 'nixl' meta package, which pulls CUDA torch"
        ) from None


def _coerce(name: str, kind: Any, value: Any, source: str, *, from_env: bool) -> Any:
    """The key's value as its type. A config file's JSON carries types, and
    a value of the wrong one is refused, not cast: ``"5800"`` for a port,
    ``2.9`` peers, ``true`` milliseconds, or ``false`` as the secret (cast,
    it became the secret "False"). An environment variable is a string and
    is parsed."""
    kind = str(kind)
    what = kind if kind in ("int", "float", "bool") else "string"
    try:
        if from_env:
            if kind.startswith("str"):
                return str(value)  # as set: a secret's spaces are the secret's
            text = str(value).strip()
            if kind == "int":
                return int(text)
            if kind == "float":
                return float(text)
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        if isinstance(value, bool):
            if kind == "bool":
                return value
        elif kind == "int":
            if isinstance(value, int):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
        elif kind == "float":
            if isinstance(value, int | float):
                return float(value)
        elif kind.startswith("str") and (isinstance(value, str) or value is None):
            return value
        raise ValueError
    except (TypeError, ValueError, OverflowError):
        # Never the secret's value: the message reaches logs and the doctor.
        shown = (
            f"{source} (a {type(value).__name__})"
            if name == "secret"
            else (f"{source}={value!r}")
        )
        raise ConfigError(
            f"p2p_kv: {shown} is not a valid {what} for {name!r}",
            env=source if from_env else "",
        ) from None
