"""Transfers in flight, of every kind, and how they are given up on.

Three kinds of transfer run at once: a NIXL request (:class:`NixlTransfer`),
a copy into GPU memory (``p2p_kv.data.cuda_ipc.CopyInFlight``) and a READ
staged in pieces (``p2p_kv.data.staged.StagedRead``). Each is a
:class:`Transfer`, and :class:`Ledger` tracks them by transfer id without
knowing which kind it holds: every id is reported exactly once, whatever
happens to it.

Giving up on a transfer cannot stop it: releasing a NIXL request makes UCX
cancel it, but bytes already on their way still land (over TCP, when a
stalled peer resumes). So one given up on is reported when it ends, or, at
its drain bound, reported failed and *unstopped*: the caller must not reuse
what it names on our word alone. A staged READ is the exception
(:attr:`Transfer.detaches`): what may still land goes to staging, never the
caller's slots, so it is reported at once.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from p2p_kv.ratelog import PeerLog

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "Ledger",
    "NixlTransfer",
    "Releasable",
    "Transfer",
    "drain_timeout_for",
    "release_quietly",
]

logger = logging.getLogger("vllm.p2p_kv.data")

# How long, by default, a transfer given up on may take to reach a terminal
# state before it is released outright (cancel polls for it; remove_peer and
# close block on it). Loopback CMA writes finish inside the post call, so
# this only matters for a peer that stopped answering on a network
# transport.
DEFAULT_DRAIN_TIMEOUT_S: Final = 1.0


def drain_timeout_for(abort_ack_s: float) -> float:
    """The drain bound for a session whose abort-ack deadline is
    ``abort_ack_s``: a transfer given up on must be reported before the
    session's own timer for it runs out, or that timer takes the peer for
    unhealthy and ends the session (every load on it failed, with an
    ``abort_ack_timeout_s`` of 1 s or less)."""
    return min(DEFAULT_DRAIN_TIMEOUT_S, abort_ack_s / 2)


class Releasable(Protocol):
    """A NIXL handle, or anything else freed by ``release``."""

    def release(self) -> None: ...


class Transfer(Releasable, Protocol):
    """One transfer in flight."""

    @property
    def detaches(self) -> bool:
        """Whether, given up on while it runs, it may be reported at once:
        whatever of it still runs lands in memory of its own (staging),
        never in the caller's slots."""
        ...

    def state(self, post: bool = True) -> str:
        """ "PROC" while it runs, then "DONE" or "ERR"; may raise (its fate
        is then unknown). ``post`` False: it is being given up on, and
        must start no more work (a staged READ's next pieces)."""
        ...

    def release(self) -> None:
        """Once it ended or is given up on: free what it holds. What a
        transfer still running does then is its kind's: NIXL cancels (not
        stops) it, a copy into GPU memory is waited for, a staged READ's
        pieces keep their staging until UCX ends them."""
        ...


class NixlTransfer:
    """A NIXL transfer request as a :class:`Transfer`."""

    __slots__ = ("_agent", "handle", "release")

    detaches: Final = False

    def __init__(self, agent: Any, handle: Any) -> None:
        self._agent = agent
        self.handle = handle
        #: NIXL's own: releasing the handle cancels a transfer still running
        self.release: Callable[[], None] = handle.release

    def state(self, post: bool = True) -> str:
        return str(self._agent.check_xfer_state(self.handle))


def release_quietly(handle: Releasable, peer: str | None, plog: PeerLog) -> None:
    """Release a handle (``peer``: whose; None: our own); a failure is
    logged, never raised: the caller is in the middle of reporting."""
    try:
        handle.release()
    except Exception as exc:
        # NIXL's wrapper keeps a handle it could not release and retries at
        # agent teardown; nothing more can be done here.
        if peer is None:
            logger.warning("releasing a NIXL handle failed", exc_info=True)
        elif plog.warning(
            "release", peer, "releasing a NIXL transfer handle failed: %s", exc
        ):
            logger.debug("release failure detail", exc_info=True)


@dataclass
class Tracked:
    """A transfer in flight, with whom, and whether it was given up on."""

    transfer: Transfer
    peer: str
    #: Given up on (cancelled): released once it ends or at this time,
    #: whichever comes first (see :meth:`Ledger.give_up`).
    give_up_at: float | None = None


class Ledger:
    """Transfer ids, the transfers they name while those run, and the
    reports owed: every id handed out is reported once by :meth:`poll`.

    Not thread-safe: the transport's lock covers it."""

    def __init__(self, plog: PeerLog) -> None:
        self._plog = plog
        self._ids = itertools.count(1)
        self.running: dict[int, Tracked] = {}
        self.done: list[tuple[int, bool]] = []
        #: transfers reported failed that were still running when given up
        #: on: their bytes may yet land (see take_unstopped)
        self.unstopped: set[int] = set()

    def new_id(self) -> int:
        return next(self._ids)

    def report(self, tid: int, ok: bool) -> int:
        """``tid`` ended (``ok``): reported at the next :meth:`poll`."""
        self.done.append((tid, ok))
        return tid

    def track(self, tid: int, transfer: Transfer, peer: str) -> int:
        """``tid`` runs: reported once ``transfer`` ends."""
        self.running[tid] = Tracked(transfer, peer)
        return tid

    def owed(self) -> int:
        """Transfers whose report has not been taken yet."""
        return len(self.running) + len(self.done)

    def given_up(self, tid: int) -> bool:
        tracked = self.running.get(tid)
        return tracked is not None and tracked.give_up_at is not None

    def of_peer(self, peer: str) -> list[int]:
        return [tid for tid, t in self.running.items() if t.peer == peer]

    def take_unstopped(self) -> set[int]:
        out, self.unstopped = self.unstopped, set()
        return out

    def poll(self, drain_s: float) -> list[tuple[int, bool]]:
        """Every report owed now: those taken already, and the transfers
        that ended (one status check each)."""
        out, self.done = self.done, []
        if self.running:
            now = time.monotonic()
            finished: list[int] = []
            for tid, tracked in self.running.items():
                ok = self._ended(tid, tracked, now, drain_s)
                if ok is not None:
                    out.append((tid, ok))
                    finished.append(tid)
            for tid in finished:
                del self.running[tid]
        return out

    def give_up(self, tids: list[int], wait: bool, drain_s: float) -> None:
        """Give tracked transfers up: each is reported once it has ended or
        met its drain bound ``drain_s`` (:meth:`_ended`). ``wait``: a
        fence, until then, with progress (which turns most cancellations
        on loopback into plain completions)."""
        now = time.monotonic()
        for tid in tids:
            tracked = self.running.get(tid)
            if tracked is not None and tracked.give_up_at is None:
                tracked.give_up_at = now + drain_s
        while True:
            now = time.monotonic()
            for tid in tids:
                tracked = self.running.get(tid)
                if tracked is None:
                    continue
                ok = self._ended(tid, tracked, now, drain_s)
                if ok is not None:
                    del self.running[tid]
                    self.done.append((tid, ok))
            if not wait or not any(t in self.running for t in tids):
                return
            time.sleep(0.0002)

    def _ended(
        self, tid: int, tracked: Tracked, now: float, drain_s: float
    ) -> bool | None:
        """Whether a tracked transfer succeeded, once it has ended (then
        released); None while it runs.

        One given up on ends when it ends by itself, since a completed or
        failed request can no longer write, or at its drain bound: it is
        then released, which does not stop bytes already on their way
        (reported unstopped), unless it :attr:`~Transfer.detaches`.
        """
        given_up = tracked.give_up_at is not None
        transfer = tracked.transfer
        state = self.state(transfer, tracked.peer, post=not given_up)
        if state != "PROC" or (given_up and transfer.detaches):
            release_quietly(transfer, tracked.peer, self._plog)
            return state == "DONE"
        if tracked.give_up_at is None or now < tracked.give_up_at:
            return None
        self._plog.warning(
            "drain",
            tracked.peer,
            "transfer %d still running after %.1fs: cancelling",
            tid,
            drain_s,
        )
        release_quietly(transfer, tracked.peer, self._plog)
        self.unstopped.add(tid)
        return False

    def state(self, transfer: Transfer, peer: str, post: bool = True) -> str:
        """Its state; never raises: a caller holding reports it already took would
        lose them (a CUDA error is sticky; the copy is then reported
        failed, and its release waits on it as far as CUDA still can)."""
        try:
            return transfer.state(post)
        except Exception as exc:
            if self._plog.warning("check", peer, "checking a transfer failed: %s", exc):
                logger.debug("check failure detail", exc_info=True)
            return "ERR"
