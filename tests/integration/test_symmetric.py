"""Two engines that load from each other: each holds an outbound session to
the other and an inbound one from it, and both sessions share the other's
NIXL agent. Closing one of them must not take the agent from the other."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
from tests.support.procs import PeerProc

BLOCK = 64 * 1024
BLOCKS = 32
KEYS = list(range(8))
# The agents place their own blocks as the agent does (seed 0); loads land
# in slots outside them, so serving and loading never overwrite each other.
_OWN = set(np.random.default_rng(0).permutation(BLOCKS)[: len(KEYS)].tolist())
DST = [s for s in range(BLOCKS) if s not in _OWN][: len(KEYS)]


@pytest.fixture
def pair() -> Iterator[tuple[PeerProc, PeerProc]]:
    made: list[PeerProc] = []
    try:
        for name in ("sym-p", "sym-q"):
            made.append(
                PeerProc(
                    {
                        "engine_id": f"{name}-{os.getpid()}",
                        "num_blocks": BLOCKS,
                        "block_bytes": BLOCK,
                        "fill": len(KEYS),
                    }
                )
            )
        yield made[0], made[1]
    finally:
        for p in made:
            p.stop()


def fetch_ok(src: PeerProc, dst: PeerProc, kv: str) -> None:
    out = src.call("fetch", peer=dst.address, kv_id=kv, keys=KEYS, slots=DST)
    assert (out["hits"], out["ok"], out["bad_slots"]) == (len(KEYS), True, []), out


def test_closing_one_direction_keeps_the_other(pair: tuple[PeerProc, PeerProc]) -> None:
    p, q = pair
    fetch_ok(p, q, "p-from-q-1")
    fetch_ok(q, p, "q-from-p-1")
    # q drops its session to p: p's inbound session from q closes (Goodbye);
    # p's own session to q, on the same NIXL agent of q, must live on.
    assert q.call("close_session", peer=p.address) == {"closed": True}
    for i in range(3):
        fetch_ok(p, q, f"p-from-q-{2 + i}")
    time.sleep(1.2)  # q redials p only after its reconnect backoff (1 s)
    fetch_ok(q, p, "q-from-p-2")
    for peer in (p, q):
        report = peer.call("report")
        assert report["double_results"] == 0
