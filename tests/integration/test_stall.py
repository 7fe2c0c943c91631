"""A live peer that stalls (a VM pause, a starved process) keeps its
session as long as its silence stays under the liveness bound: a session
that sent nothing for a quarter heartbeat interval sends a Heartbeat, and
a peer silent for 1.5 intervals is dropped, so a stall of up to 1.25
intervals is survived. A dead peer is still found within two intervals:
``test_netns`` and ``test_nixl_transfer``."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from tests.support.procs import PeerProc

from p2p_kv.peer import Timeouts
from p2p_kv.runtime.standalone import StandalonePeer, make_key

HB = 0.5  # the default heartbeat interval
STALL_S = 0.58  # 1.16 intervals, inside the 1.25 survived
STALLS = 6
BLOCK = 4096


@pytest.fixture
def pair() -> Iterator[tuple[PeerProc, StandalonePeer]]:
    timeouts = {"heartbeat_interval_s": HB}
    prod = PeerProc(
        {
            "engine_id": "stall-prod",
            "num_blocks": 16,
            "block_bytes": BLOCK,
            "fill": 8,
            "timeouts": timeouts,
        }
    )
    cons = StandalonePeer(
        16, BLOCK, engine_id=f"stall-cons-{os.getpid()}", timeouts=Timeouts(**timeouts)
    )
    try:
        yield prod, cons
    finally:
        cons.close()
        prod.stop()


def step_for(peer: StandalonePeer, seconds: float) -> None:
    """Step like an engine with nothing to do (waiting on its sockets)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        peer.step()


def test_a_stalled_peer_keeps_its_session_and_serves_after(
    pair: tuple[PeerProc, StandalonePeer],
) -> None:
    prod, cons = pair
    keys = [make_key(k) for k in range(4)]
    first = cons.fetch(prod.address, "kv-first", keys, [0, 1, 2, 3])
    assert first.ok, first
    session = cons.manager.session(prod.address)
    assert session is not None and session.link.ready
    for i in range(STALLS):
        os.kill(prod.proc.pid, signal.SIGSTOP)
        try:
            step_for(cons, STALL_S)
        finally:
            os.kill(prod.proc.pid, signal.SIGCONT)
        step_for(cons, 0.3)
        now = cons.manager.session(prod.address)
        assert now is session and session.link.ready, (
            f"stall {i + 1} of {STALL_S} s dropped the session: "
            f"{session.link.close_reason or 'replaced'}"
        )
    after = cons.fetch(prod.address, "kv-after", keys, [4, 5, 6, 7])
    assert after.ok, after
    assert cons.manager.session(prod.address) is session
