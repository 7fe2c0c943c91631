"""The keep-alive waker: peers answered while the engine does not step.

vLLM steps an engine only while it has work, and its 3-process engine spins
its worker for a second after every step, so an idle engine must not step
for its peers' sake. :class:`Waker` is a daemon thread that does the tier's
share of a step in the engine's place -- frames read, heartbeats sent,
deadlines fired, transfers progressed -- and calls the engine in only when
something needs it (a lookup to serve against its primary tier, a result
for it). The engine's other half of that deal is :meth:`Waker.park`: it may
sleep at its step for as long as the waker will call it for anything of
ours.

It is a class the runtime owns, not part of the runtime, because its state
is its own -- the thread, the stop flag, the call still unanswered -- and
the runtime's poll reads only whether it calls the engine in
(:attr:`Waker.calls_engine`).
It holds the runtime itself rather than its parts: each pass is the
runtime's own sweep under the runtime's lock, and a caller that swaps the
runtime's transports (fault injectors) must not leave the waker on the old
ones.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from queue import Queue
from typing import Any, Protocol

from p2p_kv.control.transport import ControlTransport, wait_readable
from p2p_kv.data import NixlDataTransport
from p2p_kv.node.manager import LoadManager
from p2p_kv.runtime.frames import Frames
from p2p_kv.runtime.transfers import Transfers

log = logging.getLogger("vllm.p2p_kv")

#: Longest sleep of an idle engine's step while it only holds work for
#: peers (:meth:`Waker.hold_s`). Each step ends in vLLM's worker spinning
#: for a second, so this is that second's share of a core while a peer's
#: work is held (5 s cost a prefiller holding parked stores 26-28% of a
#: core); vLLM's own leftover work (a finished request's stores) waits at
#: most this long a step, and only while no request runs.
PARK_MAX_S = 30.0

#: How long the waker waits for the engine to answer its call before
#: calling again (a call costs the engine one no-op input).
REWAKE_S = 0.05

#: The waker's longest sleep while the data plane has no work that no
#: descriptor announces. Frames wake it on their descriptors and deadlines
#: are timed, so this bounds only a descriptor edge some other call took
#: (none known: sends and unread input say so on the wake pipe). Its 10 ms
#: tick cost an idle process 1.8% of a core, this one 0.1-0.2%.
WAKER_IDLE_S = 0.2


class Owner(Protocol):
    """What the waker reads of the runtime that owns it
    (:class:`~p2p_kv.runtime.tier_runtime.TierRuntime`): its parts, its
    lock and clock, and the one pass that takes what arrived."""

    @property
    def lock(self) -> threading.RLock: ...

    @property
    def manager(self) -> LoadManager: ...

    @property
    def control(self) -> ControlTransport: ...

    @property
    def data(self) -> NixlDataTransport: ...

    @property
    def frames(self) -> Frames: ...

    @property
    def transfers(self) -> Transfers: ...

    @property
    def live_requests(self) -> int: ...

    def clock(self) -> float: ...

    def sweep(self) -> None: ...


class Waker:
    """The thread that keeps one runtime's tier alive between engine steps,
    and the engine's sleep that relies on it."""

    def __init__(self, rt: Owner) -> None:
        self._rt = rt
        #: The running thread, once started.
        self.thread: threading.Thread | None = None
        #: True while a started thread can call the engine in; cleared when
        #: it ends for any reason, so the engine steps by itself again.
        self.calls_engine = False
        self._stop = threading.Event()
        #: When the waker last called the engine in, while that call is
        #: unanswered (None: no call pending).
        self._called_at: float | None = None

    def start(
        self,
        wake_engine: Callable[[], None] | None,
        interval_s: float,
        idle_s: float = WAKER_IDLE_S,
    ) -> None:
        """Start the thread (:meth:`TierRuntime.start_waker` says what it
        does); a second call does nothing."""
        if self.thread is not None:
            return
        self.calls_engine = wake_engine is not None
        idle_s = max(interval_s, idle_s)
        self.thread = threading.Thread(
            target=self._run,
            args=(wake_engine, interval_s, idle_s),
            name="p2p_kv-waker",
            daemon=True,
        )
        self.thread.start()

    def _run(
        self, wake_engine: Callable[[], None] | None, interval_s: float, idle_s: float
    ) -> None:
        rt = self._rt
        sweeps, calls = _FailureLog("waker poll"), _FailureLog("waking the engine")
        try:
            while not self._stop.is_set():
                if not rt.lock.acquire(timeout=interval_s):
                    continue  # the engine stayed in the tier: it sees everything
                try:
                    if self._stop.is_set():
                        break  # close() took over; the transports may be gone
                    wanted, fds, sleep_s = self.sweep(interval_s, idle_s)
                    sweeps.ok()
                except Exception:
                    # When in doubt, hand it to the engine: its own step may
                    # get past what failed here.
                    sweeps.failed()
                    wanted, fds, sleep_s = True, [], interval_s
                finally:
                    rt.lock.release()
                now = rt.clock()
                # Read once: the engine's thread clears it unlocked.
                called_at = self._called_at
                if wake_engine is None:
                    wanted = False  # the engine steps itself
                elif not wanted:
                    self._called_at = None  # whatever was wanted is done
                elif called_at is None or now - called_at >= REWAKE_S:
                    # Again if the engine has not come: a call it took
                    # without stepping (it was just finishing a step of its
                    # own) must not leave the lookup unserved.
                    self._called_at = now
                    try:
                        wake_engine()
                        calls.ok()
                    except Exception:
                        calls.failed()
                if wanted:
                    sleep_s = min(sleep_s, REWAKE_S)
                if not self._stop.is_set():
                    wait_readable(fds, sleep_s)
        finally:
            # Whatever ended the thread, the engine must keep the tier alive
            # by stepping again (may_wait, has_pending_work).
            self.calls_engine = False

    def sweep(
        self, interval_s: float, idle_s: float
    ) -> tuple[bool, list[tuple[int, int]], float]:
        """One pass under the runtime's lock: whether the engine is wanted,
        the descriptors to sleep on, and for how long at most."""
        rt = self._rt
        if not rt.frames.identity_ready():
            # Frames wait in the sockets, unread, so their descriptors stay
            # readable: slept on, they ended every wait at once, and the
            # waker spun (30-60% of a core) from the tier's start in vLLM's
            # Scheduler() to the engine's hash seed, or for good.
            return False, [], interval_s
        rt.sweep()
        m, data = rt.manager, rt.data
        wanted = m.has_lookups_to_serve or m.results_ready()
        fds = rt.control.readiness_fds()
        due_s = m.timers.next_deadline() - rt.clock()
        busy = (
            bool(rt.transfers)
            or data.in_flight()
            or data.settling()
            or m.peer_transfers()
        )
        # At least 1 ms: a deadline the poll did not clear must not turn
        # this into a spin.
        return wanted, fds, max(0.001, min(interval_s if busy else idle_s, due_s))

    def engine_stepped(self) -> None:
        """The engine called in: a wake-up has been taken."""
        self._called_at = None

    def stop(self, timeout_s: float = 2.0) -> None:
        """End the thread (at once if it sleeps; a pass in progress ends
        first). It never starts after this."""
        self._stop.set()
        self._rt.control.wake()  # ends the waker's sleep
        if self.thread is None:
            return
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            # It stops at its next pass (it checks the flag under the lock).
            log.warning("p2p_kv: the waker did not stop within %g s", timeout_s)

    # -- the engine's sleep, which relies on the waker's calls ----------------

    def hold_s(self) -> float:
        """How long an idle engine's thread may sleep at its step; 0: not
        at all. Only with a waker that calls the engine, which wakes it for
        anything of ours.

        vLLM keeps stepping an engine while its tiering manager has jobs in
        flight, and a pin we hold for a peer is one (a store job of the
        parent's), as is a parked store. A producer with no request of its
        own then stepped ~750 times a second until the peer's Release or
        the pin's deadline (15 s when the peer was slow), and each step of
        the 3-process engine wakes its worker, which then spins for a
        second: on a small host that spin stalled the very peer that was to
        read (its OpenMP threads share the cores). Work of ours ends by a
        peer's message or a deadline, which the waker sees, and it wakes
        the engine, as does any client request: so the sleep is long
        (:data:`PARK_MAX_S`). A peer's Fetch waiting for stores does not
        keep it stepping: with no live request none can come (vLLM ends a
        request at the tier only after its last store), and a new request
        wakes the engine anyway."""
        rt = self._rt
        if not self.calls_engine or rt.live_requests:
            return 0.0
        m = rt.manager
        if (
            not m.jobs_in_flight()
            or m.has_lookups_to_serve
            or m.results_ready()
            or rt.transfers.writes_awaited()
        ):
            # Nothing of ours keeps it stepping (whatever does is vLLM's
            # own), or it has something to do for us or a waiting peer (a
            # WRITE of ours: its TransferDone leaves on the step that sees
            # it end, not at the waker's next tick).
            return 0.0
        # A READ still in flight is a finished request's (none is live), and
        # a WRITE given up on is waited for by nobody: the waker takes their
        # completions (every runtime.DATA_TICK_S) and calls the engine in for
        # what results they make. Stepping for them spun the engine until
        # they ended (a given-up one up to the drain bound).
        return PARK_MAX_S

    def park(self, queue: Queue[Any]) -> None:
        """Called by the engine's thread at its step, not holding the
        runtime's lock: sleep as vLLM's idle engine does, on its input
        ``queue``, for :meth:`hold_s`. A client request or the waker's call
        (both put on that queue) end the sleep at once."""
        with self._rt.lock:
            hold_s = self.hold_s()
        if hold_s <= 0:
            return
        with queue.not_empty:
            if not queue.queue:
                queue.not_empty.wait(hold_s)


class _FailureLog:
    """A failure that repeats every tick is logged once with its traceback,
    then at debug level until it stops: one line, not a hundred a second."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._failing = False

    def ok(self) -> None:
        self._failing = False

    def failed(self) -> None:
        level = logging.DEBUG if self._failing else logging.ERROR
        log.log(level, "p2p_kv: %s failed", self._what, exc_info=True)
        self._failing = True
