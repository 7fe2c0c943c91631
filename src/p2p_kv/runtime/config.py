"""The tier's configuration: the keys of its ``secondary_tiers`` entry.

Validated once, at engine start, so that a typo or a bad value stops the
engine with one sentence naming the key and the fix, instead of a tier that
silently never hits. Every key has an environment variable (read when the
key is absent): ``P2P_KV_<KEY>``. Not ``VLLM_*``: vLLM warns at start on
every ``VLLM_*`` variable its own table does not list
(``Platform.validate_environ``), so a fleet configured as documented would
warn on every start. The earlier names, ``VLLM_P2P_KV_<KEY>``, are still
read, with one deprecation line each. A variable in either namespace that
names no key is refused at start, as an unknown key is: a misspelt
``P2P_KV_LOOKUP_TIMOUT_S`` would otherwise leave the default in force
without a word.

Where vLLM's in-tree ``p2p`` tier names a setting that means the same as
one of ours, its name is accepted too (:data:`KEY_ALIASES`,
:data:`ENV_ALIASES`), so a deployment swaps that tier's entry for ours and
changes nothing else. Both names given with different values are refused:
either would silently lose.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from p2p_kv.node.membership import Entry, parse_peers
from p2p_kv.peer import Timeouts

ENV_PREFIX = "P2P_KV_"
#: The variables' earlier prefix, read after :data:`ENV_PREFIX` with a
#: deprecation line (vLLM warns on every ``VLLM_*`` name it does not know).
LEGACY_ENV_PREFIX = "VLLM_P2P_KV_"
#: Keys of vLLM's tiering spec (``kv_connector_extra_config``), which a
#: tier's entry is sometimes given by mistake: its refusal says where they go.
SPEC_KEYS = frozenset(
    {
        "block_size",
        "cpu_bytes_to_use",
        "spec_name",
        "spec_module_path",
        "eviction_policy",
    }
)
#: Variables in our namespace that are not tier keys, so not refused: the
#: generated model's cache, and knobs of the test suite and benchmarks.
OTHER_VARIABLES = frozenset(
    {
        "P2P_KV_CACHE_DIR",
        "P2P_KV_BENCH_PRODUCER_HOST",
        "P2P_KV_BENCH_PRODUCER_NETNS",
        "P2P_KV_FUZZ_EXAMPLES",
        "P2P_KV_SOAK_REQUESTS",
    }
)
_CORE = Timeouts()
log = logging.getLogger("vllm.p2p_kv")
#: Deprecated variables already named in a log line (one line each).
_WARNED: set[str] = set()
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
#: How often ``peers``' names are resolved again (s): a pod's address in a
#: headless Service is followed within this; more often than every 50 ms
#: is a resolver storm, less often than hourly follows nothing.
PEERS_REFRESH_S = (0.05, 3600.0)
#: Keys of vLLM's in-tree ``p2p`` tier (its ``secondary_tiers`` entry, vLLM
#: 0.32's ``P2PSecondaryTierManager``) that mean one of ours: our key ->
#: theirs. ``host`` and ``port`` are spelled alike already.
KEY_ALIASES = {"parked_ttl_s": "unbound_store_timeout_s"}
#: Environment variables of vLLM's in-tree tier (``vllm.envs``) that mean
#: one of our keys: our key -> theirs. Read after ours, before defaults.
ENV_ALIASES = {
    "host": "VLLM_P2P_SIDE_CHANNEL_HOST",
    "port": "VLLM_P2P_SIDE_CHANNEL_PORT",
}


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


@dataclass(frozen=True, slots=True)
class Key:
    """What the schema says of one key: the one line of the docs' table,
    its range (validated at start) and unit. ``docs/configuration.md``'s
    table is generated from these (``p2p-kv config --markdown``); a test
    fails when the two differ."""

    doc: str
    low: float | None = None
    high: float | None = None
    unit: str = ""
    #: the type as the docs' table shows it ("" : the field's own)
    shown: str = ""


def _key(
    default: Any,
    doc: str,
    low: float | None = None,
    high: float | None = None,
    unit: str = "",
    shown: str = "",
) -> Any:
    return field(default=default, metadata={"key": Key(doc, low, high, unit, shown)})


@dataclass(frozen=True)
class TierConfig:
    """The keys of the tier's ``secondary_tiers`` entry: the one schema of
    names, types, defaults, ranges and meanings. Why each is what it is:
    ``docs/architecture.md`` ("Configuration, in depth")."""

    host: str = _key(
        "127.0.0.1",
        "address the control socket binds and peers dial; not a wildcard; "
        "off loopback it needs a `secret`",
    )
    port: int = _key(
        5800,
        "control port; data-parallel rank *i* uses `port + i`; `0` picks a free one",
        0,
        65535,
    )
    secret: str | None = _key(
        None,
        "the fleet's shared secret: peers prove it, control frames are "
        "sealed under keys derived from it; KV blocks cross NIXL/UCX "
        "unencrypted (set it as the variable: vLLM logs its config)",
    )
    allow_unauthenticated: bool = _key(
        False,
        "serve without a `secret` on a non-loopback `host` (a network you "
        "trust entirely)",
    )
    idle_wait_ms: float = _key(
        200.0, "longest wait on the sockets in an idle engine step", *IDLE_WAIT_MS, "ms"
    )
    # The protocol's deadlines default to the core's own (one source).
    heartbeat_ms: float = _key(
        _CORE.heartbeat_interval_s * 1000,
        "heartbeat interval: a peer silent for 1.5 intervals is dropped",
        *HEARTBEAT_MS,
        "ms",
    )
    handshake_timeout_s: float = _key(
        _CORE.handshake_s,
        "a peer that does not finish the handshake in time is dropped",
        *_TIMEOUT_RANGES["handshake_timeout_s"],
        "s",
    )
    lookup_timeout_s: float = _key(
        _CORE.lookup_s,
        "an unanswered lookup reads as all-miss",
        *_TIMEOUT_RANGES["lookup_timeout_s"],
        "s",
    )
    fetch_timeout_floor_s: float = _key(
        _CORE.fetch_floor_s,
        "a load's deadline: this plus its bytes at 500 MB/s",
        *_TIMEOUT_RANGES["fetch_timeout_floor_s"],
        "s",
    )
    abort_ack_timeout_s: float = _key(
        _CORE.abort_ack_s,
        "a peer that neither finishes nor acknowledges an abort is dropped; "
        "the same on every engine",
        *_TIMEOUT_RANGES["abort_ack_timeout_s"],
        "s",
    )
    pin_ttl_s: float = _key(
        _CORE.pin_ttl_s,
        "how long blocks stay pinned for a consumer's load",
        *_TIMEOUT_RANGES["pin_ttl_s"],
        "s",
    )
    parked_ttl_s: float = _key(
        60.0,
        "how long a `remote_decoder` request's blocks wait for their decoder",
        *_TIMEOUT_RANGES["parked_ttl_s"],
        "s",
    )
    require_hash_seed: bool = _key(True, "refuse to start without `PYTHONHASHSEED`")
    read_path: bool = _key(
        True,
        "load by one-sided READ of the blocks the peer holds for us; `false`: "
        "the producer WRITEs them (needs a `secret`)",
    )
    same_host_copy: bool = _key(
        True,
        "a READ from a peer on this host copies out of its shared region, "
        "once the peer proves it holds our connection",
    )
    read_staging_mib: float = _key(
        64.0,
        "memory a NIXL READ lands in before its copy into the engine's "
        "slots; `0`: in place, unsafe if a peer stalls and resumes",
        0,
        math.inf,
        "MiB",
    )
    max_peers: int = _key(
        256, "most engines this one dials at once (a descriptor each)", 1, MAX_PEERS
    )
    max_inbound_peers: int = _key(
        512, "most peers connected to this engine at once", 1, MAX_PEERS * 16
    )
    peers: tuple[Entry, ...] | None = _key(
        None,
        "the fleet, as `host:port` entries (the variable: separated by "
        "commas); a name stands for every address it resolves to; set, only "
        "members are dialled and a request naming another source recomputes; "
        "unset, any source a request names is dialled",
        shown="list of str",
    )
    peers_refresh_s: float = _key(
        10.0,
        "how often the names in `peers` are resolved again, off the engine's "
        "thread (pods that come and go are followed)",
        *PEERS_REFRESH_S,
        "s",
    )

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], env: Mapping[str, str] | None = None
    ) -> TierConfig:
        env = os.environ if env is None else env
        known = {f.name: f for f in fields(cls)}
        accepted = set(known) | set(KEY_ALIASES.values())
        unknown = sorted(set(raw) - accepted)
        if unknown:
            guesses = [
                f"{k!r} -> {close[0]!r}"
                for k in unknown
                if (close := difflib.get_close_matches(str(k), known, n=1))
            ]
            meant = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
            if misplaced := sorted(set(unknown) & SPEC_KEYS):
                # vLLM's own keys, one level too deep: the spec never sees them.
                meant += (
                    f"; {', '.join(misplaced)} belong(s) in kv_connector_extra_config, "
                    "beside secondary_tiers, not in the tier's entry"
                )
            raise ConfigError(
                f"p2p_kv: unknown tier config key(s) {unknown}{meant}; known "
                f"keys: {sorted(known)}"
            )
        _check_variables(env, known)
        secret_vars = [v for v in _variables("secret") if v in env]
        if raw.get("secret", "") is None and secret_vars:
            # The key wins over the variable: the fleet's secret, set for
            # this engine, was silently dropped and the tier ran open.
            raise ConfigError(
                f"p2p_kv: secret is null in the tier's entry but {secret_vars[0]} "
                "is set: remove the key to use the variable, or unset the "
                "variable for no secret"
            )
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, f in known.items():
            # Each level in turn: the entry's keys, then the variables. A
            # key wins over any variable (vLLM's in-tree tier does the same);
            # two names of one level must agree.
            keys = [k for k in (name, KEY_ALIASES.get(name)) if k and k in raw]
            found = [
                (at, _coerce(name, f.type, raw[k], at, False))
                for k in keys
                if (at := f"secondary_tiers[].{k}")
            ]
            if not found:
                found = [
                    (var, _coerce(name, f.type, env[var], var, True))
                    for var in _variables(name)
                    if var in env
                ]
            if not found:
                continue
            (source, value), *others = found
            for other, theirs in others:
                if theirs != value:
                    raise ConfigError(
                        f"p2p_kv: {_named(source)} and {_named(other)} "
                        f"({_what_name(other, name)}) disagree: "
                        f"{_shown(name, value)} against {_shown(name, theirs)}; "
                        "set one of them",
                        env=other if not other.startswith("secondary_tiers") else "",
                    )
            for var, _ in found:
                if var.startswith(LEGACY_ENV_PREFIX) and var not in _WARNED:
                    _WARNED.add(var)
                    log.warning(
                        "p2p_kv: %s is deprecated (vLLM warns on every VLLM_* "
                        "variable it does not know): rename it %s",
                        var,
                        ENV_PREFIX + name.upper(),
                    )
            sources[name], values[name] = source, value
        cfg = cls(**values)
        cfg._check(sources)
        return cfg

    def _check(self, sources: Mapping[str, str] | None = None) -> None:
        """Refuse values no deployment means. ``sources`` names where a key
        came from when it was an environment variable, so the message says
        which of the two to fix."""

        def bad(name: str, text: str) -> ConfigError:
            source = (sources or {}).get(name, "")
            if not source or source.startswith("secondary_tiers"):
                return ConfigError(f"p2p_kv: {name} {text}")
            return ConfigError(f"p2p_kv: {name} (from {source}) {text}", env=source)

        for f in fields(self):
            key: Key | None = f.metadata.get("key")
            if key is None or key.low is None or key.high is None:
                continue
            value, low, high, unit = getattr(self, f.name), key.low, key.high, key.unit
            if not low <= value <= high or not math.isfinite(value):  # NaN too
                # Every wait must end, and none is shorter than a round trip:
                # outside these, a unit was mistaken (ms for s) or a typo.
                hint = ""
                if unit == "s" and value > high and low <= value / 1000 <= high:
                    hint = (
                        f": it looks like milliseconds; for {value / 1000:g} s "
                        f"write {value / 1000:g}"
                    )
                if not math.isfinite(high):
                    raise bad(f.name, f"{value} must be >= {low:g} {unit} and finite")
                raise bad(
                    f.name,
                    f"{value} is not in {low:g}..{high:g} {unit}".rstrip() + hint,
                )
        if self.secret is not None and (problem := secret_problem(self.secret)):
            raise bad("secret", problem)
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


def markdown_table() -> str:
    """docs/configuration.md's table of keys, from the schema."""

    def shown(value: Any) -> str:
        if value is None:
            return "none"
        if isinstance(value, bool):
            return f"`{str(value).lower()}`"
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return f"`{value}`"

    def span(key: Key) -> str:
        if key.low is None or key.high is None:
            return ""
        unit = f" {key.unit}" if key.unit else ""
        if not math.isfinite(key.high):
            return f">= {key.low:g}{unit}"
        return f"{key.low:g}-{key.high:,g}{unit}"

    lines = [
        "| key | variable | type | default | range | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for f in fields(TierConfig):
        key: Key = f.metadata["key"]
        kind = key.shown or str(f.type).replace(" | None", "")
        name = f"`{f.name}`"
        if f.name in KEY_ALIASES:
            name += f", `{KEY_ALIASES[f.name]}`"
        variable = f"`{ENV_PREFIX}{f.name.upper()}`"
        if f.name in ENV_ALIASES:
            variable += f", `{ENV_ALIASES[f.name]}`"
        lines.append(
            f"| {name} | {variable} | {kind} | "
            f"{shown(f.default)} | {span(key)} | {key.doc} |"
        )
    return "\n".join(lines) + "\n"


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


def _named(source: str) -> str:
    """A value's source as a message names it: the key, or the variable."""
    return source.removeprefix("secondary_tiers[].")


def _shown(name: str, value: Any) -> str:
    """A value as a message may show it (never the secret's)."""
    if name == "secret":
        return "another secret"
    if name == "peers" and value is not None:
        return repr([str(e) for e in value])
    return repr(value)


def _coerce(name: str, kind: Any, value: Any, source: str, from_env: bool) -> Any:
    """The key's value as its type. A config file's JSON carries types, and
    a value of the wrong one is refused, not cast: ``"5800"`` for a port,
    ``2.9`` peers, ``true`` milliseconds, or ``false`` as the secret (cast,
    it became the secret "False"). An environment variable is a string and
    is parsed."""
    kind = str(kind)
    what = kind if kind in ("int", "float", "bool") else "string"
    if name == "peers":
        return _coerce_peers(value, source, from_env)
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


def _coerce_peers(value: Any, source: str, from_env: bool) -> tuple[Entry, ...]:
    """``peers``: a JSON list of ``host:port`` strings, or its variable's
    entries separated by commas. A single string in the entry is refused:
    JSON's types are kept, and a list says where each entry ends."""
    if not from_env and (isinstance(value, str) or not isinstance(value, list)):
        raise ConfigError(
            f"p2p_kv: {source}={value!r} is not a list of 'host:port' strings "
            'for \'peers\' (write ["10.0.0.5:5800", "p2p.fleet.svc:5800"])'
        )
    try:
        return parse_peers(value)
    except ValueError as exc:
        if not from_env:
            raise ConfigError(f"p2p_kv: {exc}") from None
        raise ConfigError(f"p2p_kv: {exc} (from {source})", env=source) from None


def _variables(name: str) -> list[str]:
    """The variables that set key ``name``, in the order they are read:
    ours, its deprecated name, then vLLM's in-tree tier's."""
    found = [ENV_PREFIX + name.upper(), LEGACY_ENV_PREFIX + name.upper()]
    if name in ENV_ALIASES:
        found.append(ENV_ALIASES[name])
    return found


def _what_name(variable: str, name: str) -> str:
    """What a second name of key ``name`` is, for a message."""
    if variable.startswith("secondary_tiers") or variable in ENV_ALIASES.values():
        return f"vLLM's in-tree p2p tier's name for {name!r}"
    return f"the deprecated name of {ENV_PREFIX + name.upper()}"


def _check_variables(env: Mapping[str, str], known: Mapping[str, Any]) -> None:
    """Refuse a variable of our namespaces that names no key: misspelt, it
    would leave the key's default in force without a word."""
    names = {ENV_PREFIX + k.upper(): k for k in known}
    for var in sorted(env):
        if var.startswith(LEGACY_ENV_PREFIX):
            meant = ENV_PREFIX + var.removeprefix(LEGACY_ENV_PREFIX)
        elif var.startswith(ENV_PREFIX):
            meant = var
        else:
            continue
        if meant in names or var in OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(meant, list(names), n=1)
        guess = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"p2p_kv: unknown environment variable {var}{guess}: it sets no "
            f"tier key. Unset it, or use one of {sorted(names)}",
            env=var,
        )
