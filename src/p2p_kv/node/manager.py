"""The P2P load manager: one per engine, no I/O.

It is what vLLM's tier calls reach (through the adapter) and what the
transports feed (through :mod:`p2p_kv.runtime.tier_runtime`). It composes one
:class:`~p2p_kv.peer.Session` per peer connection (kept by
:class:`~p2p_kv.node.sessions.Peers`) with the engine-level state no single peer
owns:

* one :class:`Request` record per live engine request with a p2p leg: its
  consumer leg (``remote_kv_source`` or ``remote_prefiller``), stamped with
  a fresh *generation*; its producer leg (``remote_decoder``); and whether
  it failed, so :meth:`lookup` answers MISS until it finishes;
* the parked-store registry for producer legs (:mod:`p2p_kv.node.parked`);
* job bookkeeping, so every submitted job yields exactly one result.

Finished means finished: :meth:`on_request_finished` pops the request's
record (its failed flag goes with it) and marks its in-flight loads and
already-buffered results ``request_finished``; a failure that arrives later
still returns its job for cleanup but can never mark a request failed. A
reused ``kv_request_id`` is a new request with a new generation, so nothing
addressed to the old one touches it.

Records are keyed by engine request id, not by ``kv_request_id``: two live
engine requests may share one orchestrator id, and one failing must not
make the other recompute.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from p2p_kv.lifecycle import State
from p2p_kv.node.consumer_legs import Answer as Answer
from p2p_kv.node.consumer_legs import Loads
from p2p_kv.node.directory import fingerprint
from p2p_kv.node.finder import Finder
from p2p_kv.node.indexes import holders_of, residue_of, sizes_of
from p2p_kv.node.membership import Membership
from p2p_kv.node.parked import ParkedRegistry
from p2p_kv.node.requests import Job, JobTable, Request, RequestTable
from p2p_kv.node.requests import JobResult as JobResult
from p2p_kv.node.roles import Roles, Source
from p2p_kv.node.sessions import Peers, SessionWork
from p2p_kv.node.settings import NodeSettings
from p2p_kv.node.tallies import FromTallies, LoadObservation, Tallies
from p2p_kv.node.timers import (
    Due,
    LateFetchDue,
    OrphanDue,
    SessionDue,
    StoreDue,
    Timers,
    WaitNoteDue,
)
from p2p_kv.peer import (
    Limits,
    ParkedStore,
    Pinner,
    Session,
    Timeouts,
    is_inbound,
    tally,
)
from p2p_kv.peer.events import (
    BadConnection,
    BadFrame,
    Cancel,
    Closed,
    Dial,
    Hangup,
    HoldingsHeard,
    LoadDone,
    NotSent,
    Orphaned,
    ParkedFetchEnded,
    PinJob,
    PostRead,
    PostWrite,
    ProbeAnswer,
    ProbeAnswered,
    RegionKnown,
    RuntimeEvent,
    SealRefused,
    StoreDone,
    Subscribed,
    Trusted,
    WantsParked,
)
from p2p_kv.peer.handshake import FrameRefused, Identity
from p2p_kv.peer.records import LoadResult, StoreResult
from p2p_kv.protocol import (
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Subscribe,
    encode,
)

#: The longest a cache reset's drain waits (an offered READ of 1 TB is held
#: about 45 minutes at the default deadlines).
MAX_DRAIN_S = 3600.0


class LoadManager:
    """See the module docstring. Every method takes ``now``; none blocks.

    A facade: the state is its sub-objects' (requests and jobs, sessions
    and their step work, parked stores, counters), each holding its own
    few indexes, and :meth:`state_report` is derived from them."""

    def __init__(
        self,
        me: Identity | Callable[[], Identity],
        *,
        nonces: Callable[[], bytes],
        timeouts: Timeouts | None = None,
        limits: Limits | None = None,
        parked_ttl_s: float = 60.0,
        reconnect_backoff_s: float = 1.0,
        reads: bool = True,
        max_peers: int = 256,
        max_inbound: int = 512,
        membership: Membership | None = None,
    ) -> None:
        #: what every part reads, shared as one value (never the manager)
        self.settings = NodeSettings(
            me,
            timeouts=timeouts or Timeouts(),
            limits=limits or Limits(),
            parked_ttl_s=parked_ttl_s,
            reconnect_backoff_s=reconnect_backoff_s,
            reads=reads,
            max_peers=max_peers,
            max_inbound=max_inbound,
        )
        settings = self.settings
        self.tallies = Tallies()
        self.peers = Peers(settings, self.tallies, nonces, self._touch)
        #: every timer of this layer, fired by :meth:`tick` in deadline order
        self.timers = Timers()
        self.work = SessionWork(self.timers)
        self.parked = ParkedRegistry(
            settings, self.timers, self.peers.sessions.get, self._touch
        )
        self.requests = RequestTable()
        self.jobs = JobTable()
        #: who may be dialled (the ``peers`` key; without it, anyone)
        self.membership = membership or Membership()
        self.loads = Loads(
            settings, self.requests, self.jobs, self.peers, self._touch, self.membership
        )
        #: the directory, for requests that name no source: on with a
        #: ``peers`` key (the fleet it covers)
        self.finder = Finder() if self.membership.entries is not None else None

    # Counters, read by the runtime, the metrics and tests.
    refusals = FromTallies[dict[tuple[str, str], int]]()
    protocol_errors = FromTallies[dict[str, int]]()
    fallbacks = FromTallies[dict[str, int]]()
    load_observations = FromTallies[deque[LoadObservation]]()
    retired_sessions = FromTallies[deque[Session]]()
    dial_failures = FromTallies[dict[str, int]]()
    dials_refused = FromTallies[int]()
    double_results = FromTallies[int]()

    # -- vLLM-facing: requests --

    def on_new_request(self, req_id: str, roles: Roles, now: float) -> bool:
        """Start a request; True if it replaced a live one of the same id.

        vLLM may reuse an id whose request it aborted before that
        request's end reaches the tier (with its id randomization off):
        raising here would take the engine down, so the old request ends
        first, as if finished (a finished request is never failed, and its
        loads are fenced by generation). The id's later finish cannot say
        which request it meant; it ends this one, which then recomputes:
        never wrong bytes.

        A source outside the membership is dropped here, before anything
        could dial it: the request recomputes what it would have loaded
        (its decoder leg stays), counted in ``membership.refused``."""
        source = roles.source
        if source is not None and not self.membership.admits(source.peer):
            self.membership.refuse(source.peer)
            roles = dataclasses.replace(roles, source=None)
        if self.finder is not None:
            self.finder.forget(req_id)
        old = self.requests.pop(req_id)
        carried = False
        if old is not None:
            tally(self.protocol_errors, "reused_live_id", "other")
            # The same prefill again: its producer leg carries over, or a
            # decoder's Fetch waiting on the id is refused as if no producer
            # could come, just before this one parks the stores.
            if roles.dest_kv_id and old.dest_kv_id == roles.dest_kv_id:
                old.dest_kv_id, carried = None, True
            self._finish(old, now)
        if roles.source is None and not roles.dest_kv_id:
            return old is not None
        req = self.requests.add(req_id, roles.source, roles.dest_kv_id or None)
        self.loads.start(req_id, now)
        if req.dest_kv_id is not None:
            self.parked.producer_started(req.dest_kv_id, carried, now)
        return old is not None

    def on_request_finished(self, req_id: str, now: float) -> None:
        """Finish both legs of a request. Idempotent for unknown ids."""
        if self.finder is not None:
            self.finder.forget(req_id)
        req = self.requests.pop(req_id)
        if req is not None:
            self._finish(req, now)

    def _finish(self, req: Request, now: float) -> None:
        """End the legs of a request popped from the records: its consumer
        leg's results and session, its producer leg's parked entry."""
        consumer = req.consumer
        if consumer is not None:
            if consumer.found is not None and not consumer.fetched:
                # A found leg's load waits on its lookup: nothing of it
                # reached the data plane, so it ends here.
                self.jobs.results.append(
                    LoadResult(
                        consumer.found[0],
                        consumer.gen,
                        False,
                        "abort",
                        request_finished=True,
                    )
                )
                consumer.found = None
            self.jobs.request_finished(consumer.gen)
            session = self.peers.sessions.get(consumer.source.peer)
            if session is not None:
                session.consumer.finish_gen(consumer.gen, consumer.source.kv_id, now)
                self._touch(session)
        if req.dest_kv_id is not None:
            self.parked.producer_ended(req.dest_kv_id, now)

    def lookup(self, req_id: str, key: bytes) -> Answer:
        if self.finder is not None and req_id not in self.requests.by_id:
            # No source named: the directory answers, from memory.
            return Answer.HIT if self.finder.lookup(req_id, key) else Answer.MISS
        return self.loads.lookup(req_id, key)

    def submit_load(
        self,
        job_id: int,
        req_id: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        now: float,
    ) -> None:
        finder = self.finder
        if finder is None or req_id in self.requests.by_id:
            self.loads.submit_load(job_id, req_id, keys, slots, now)
            job = self.jobs.jobs.get(job_id)
            if finder is not None and job is not None:
                job.keys = list(keys)
            return
        job = self.jobs.register(job_id, "load", req_id)
        job.submitted = now
        job.keys = list(keys)
        member = finder.choose(req_id, map(fingerprint, keys), self._loads_by_peer())
        if not keys or not member:
            ok = not keys
            self.jobs.results.append(LoadResult(job_id, -1, ok, "" if ok else "miss"))
            return
        self._load_found(job_id, job, member, list(keys), list(slots), now)

    def _load_found(
        self,
        job_id: int,
        job: Job,
        member: str,
        keys: list[bytes],
        slots: list[int],
        now: float,
    ) -> None:
        """Load a request that named no source from ``member``, which the
        directory says holds ``keys``: a leg as a ``remote_kv_source`` one,
        its lookup sent now (the pins come from the member, not from the
        directory), its load once every key is answered
        (:meth:`_advance_found`)."""
        req = self.requests.add(job.req_id, Source(job.req_id, member, True), None)
        consumer = req.consumer
        assert consumer is not None
        consumer.found = (job_id, keys, slots)
        job.peer, job.gen, job.kv_id = member, consumer.gen, job.req_id
        consumer.asked.update(keys)
        consumer.unsent = list(keys)
        self.requests.unsent.add(job.req_id)
        self.loads.start(job.req_id, now)
        self.loads.flush(now)
        self._advance_found(req, now)

    def _advance_found(self, req: Request, now: float) -> None:
        """A found leg's lookup answered (or failed): load what its member
        pinned, or move to the next holder."""
        consumer, finder = req.consumer, self.finder
        if consumer is None or consumer.found is None or finder is None:
            return
        job_id, keys, slots = consumer.found
        if consumer.fetched or any(k in consumer.asked for k in keys):
            return  # loading already, or answers still to come
        missing = [k for k in keys if not consumer.keys.get(k)]
        if not missing:
            self.loads.fetch(job_id, consumer, keys, slots, now)
            return
        session = self.peers.sessions.get(consumer.source.peer)
        # Answered misses are stale entries; a lost session's are not.
        stale = [] if session is None or session.link.closed else missing
        self._fail_over(req, stale, "directory_stale" if stale else "peer_down", now)

    def _fail_over(
        self, req: Request, stale: list[bytes], why: str, now: float
    ) -> None:
        """The found leg's member could not serve its load: the load moves
        to the next member said to hold all of it, while the request's
        lookup deadline allows; else it fails, and the request recomputes."""
        consumer, finder = req.consumer, self.finder
        assert (
            consumer is not None and consumer.found is not None and finder is not None
        )
        job_id, keys, slots = consumer.found
        member = consumer.source.peer
        finder.failed(req.req_id, member, map(fingerprint, stale))
        job = self.jobs.jobs.get(job_id)
        nxt = ""
        if job is not None and now - job.submitted < self.settings.timeouts.lookup_s:
            nxt = finder.choose(
                req.req_id, map(fingerprint, keys), self._loads_by_peer()
            )
        if not nxt:
            consumer.found = None
            self.jobs.results.append(LoadResult(job_id, consumer.gen, False, why))
            return
        # The member's pins for this generation go; the request starts a
        # new generation with the next member.
        finder.failovers += 1
        self.requests.pop(req.req_id)
        session = self.peers.sessions.get(member)
        if session is not None:
            session.consumer.finish_gen(consumer.gen, consumer.source.kv_id, now)
            self._touch(session)
        assert job is not None
        self._load_found(job_id, job, nxt, keys, slots, now)

    def _loads_by_peer(self) -> dict[str, int]:
        """Load jobs in flight, by the peer they load from."""
        counts: dict[str, int] = {}
        for job in self.jobs.jobs.values():
            if job.kind == "load" and job.peer:
                counts[job.peer] = counts.get(job.peer, 0) + 1
        return counts

    def submit_store(
        self,
        job_id: int,
        req_id: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        now: float,
    ) -> bool:
        """Park a ``remote_decoder`` request's blocks for its decoder (True:
        a waiting Fetch may have been answered); any other store has
        nothing to do in a peer tier and succeeds at once (False)."""
        self.jobs.register(job_id, "store", req_id)
        req = self.requests.by_id.get(req_id)
        kv_id = req.dest_kv_id if req is not None else None
        if kv_id is None:
            if self.finder is not None:
                self.finder.stored(keys, self.settings.me.num_blocks)
            self.jobs.results.append(StoreResult(job_id, True))
            return False
        store = ParkedStore(
            job_id, kv_id, keys, slots, now + self.settings.parked_ttl_s
        )
        self.parked.park(store, now)
        return True

    def refuse_store(self, job_id: int, req_id: str, reason: str) -> None:
        """Fail a store job at once, counted in ``protocol_errors`` under
        ``reason``: a store of a request whose ``remote_decoder`` leg is
        malformed (:attr:`Roles.bad_decoder`) has no decoder to wait for."""
        self.jobs.register(job_id, "store", req_id)
        tally(self.protocol_errors, reason, "other")
        self.jobs.results.append(StoreResult(job_id, False, reason))

    def get_finished_jobs(self, now: float) -> list[JobResult]:
        """Every job that ended since the last call, each exactly once."""
        by_gen = self.requests.by_gen
        return self.jobs.hand_back(now, by_gen, self.tallies)

    # -- serve window (producer answers lookups against the engine) --

    def serve(self, pinner: Pinner, now: float) -> None:
        to_serve, self.work.to_serve = self.work.to_serve, set()
        for peer in to_serve:
            session = self.peers.sessions.get(peer)
            if session is not None and session.producer.has_lookups_to_serve:
                try:
                    session.producer.serve_lookups(pinner, now)
                finally:
                    # Pins made before anything raised are the engine's
                    # store jobs all the same (PinJob): their results must
                    # come.
                    self._touch(session)

    # -- the edge: frames in and out, connections opened and lost --

    def receive_frame(self, conn: str, frame: bytes, now: float) -> bool:
        """One frame that arrived on connection ``conn``, as the transport
        cut it; True if it was work (anything but a heartbeat, or the end of
        the connection). Its session opens it (the seal checked, then
        decoded as the handshake's stage admits); nothing a peer sends
        raises here: what the runtime must do or say arrives as events
        (:meth:`take_events`)."""
        session = self.peers.sessions.get(conn)
        if session is None:
            # Refused (max_inbound) or its session ended: its frames go
            # unread, and an inbound connection closes.
            if is_inbound(conn):
                self.work.out.append((conn, Hangup()))
            return False
        if session.link.closed:
            return False  # ended in this poll: the pump retires it
        try:
            msg = session.link.open(frame)
        except ProtocolError as exc:
            tally(self.protocol_errors, exc.reason, "other")
            ended = not session.proven
            self.work.out.append((conn, BadFrame(exc.reason, str(exc), ended)))
            if ended:
                # An honest peer's greeting always decodes: before its
                # proof, one that does not ends the connection, so a stream
                # of them costs its sender a new connection each.
                self.connection_lost(
                    conn, f"a bad frame before the handshake: {exc}", now
                )
            return ended
        except FrameRefused as exc:
            # A party without the secret is speaking (over one TCP
            # connection nothing else loses or reorders a frame).
            self.work.out.append((conn, SealRefused(str(exc))))
            session.refuse_frame(exc)
            self._tally_refusal(conn, session)
            self._touch(session)
            self.peers.remember_refused(conn)
            return True
        self._on_message(conn, session, msg, now)
        return not isinstance(msg, Heartbeat)

    def take_frames(self, now: float) -> list[tuple[str, list[bytes]]]:
        """What every session has to say, as frames for the wire: encoded,
        and sealed once its link has keys. A message that does not encode
        (a bound the protocol keeps) is left out, and said
        (:class:`NotSent`)."""
        out = []
        for peer in list(self.work.dirty):
            session = self.peers.sessions.get(peer)
            if session is None:
                continue
            msgs = session.take_outbox(now)
            if not msgs:
                if session.link.closed:
                    self._touch(session)  # lost for an overflowing outbox
                continue
            frames = []
            for msg in msgs:
                try:
                    frames.append(session.link.seal(msg, encode(msg)))
                except ProtocolError as exc:
                    self.work.out.append((peer, NotSent(type(msg).__name__, str(exc))))
            out.append((peer, frames))
        return out

    def connection_lost(
        self, conn: str, why: str, now: float, *, bad: str = "", failure: str = ""
    ) -> None:
        """Connection ``conn`` ended (``why``). ``bad``: the transport ended
        it for what the peer sent below the protocol (counted as that
        reason); ``failure``: the control plane's code for a dial that
        ended, counted in ``dial_failures`` while the peer had not proved
        itself (a source a request named that is no p2p_kv peer: a wrong
        port, a dead pod, a name that does not resolve)."""
        session = self.peers.sessions.get(conn)
        if not is_inbound(conn):
            if failure and session is not None and not session.proven:
                self.on_dial_failed(conn, failure)
        elif bad:
            tally(self.protocol_errors, bad, "other")
            if session is not None and not session.link.closed:
                # (The tail of a connection already refused, for a seal or
                # a handshake, was said once: no more.)
                self.work.out.append((conn, BadConnection(bad, why)))
        if session is not None:
            session.peer_lost(why)
            self._touch(session)

    def refuse_region(self, peer: str, why: str) -> None:
        """The peer's data-plane region (:class:`RegionKnown`) could not be
        loaded: its session ends, since no byte can move with it."""
        self.peers.close_session(peer, f"bad data-plane region: {why}")

    def _on_message(
        self, peer: str, session: Session, msg: Message, now: float
    ) -> None:
        refused = session.link.refusal is not None
        closed = session.link.closed
        greeting = not session.link.ready
        session.receive(msg, now)
        if not refused:
            self._tally_refusal(peer, session)
        ended = session.link.closed and not closed
        if ended and (session.link.refusal is not None or isinstance(msg, Hello)):
            # Refused, or ended by a second Hello: one inbound connection,
            # one session. (Not a Goodbye's end: its connection closes next,
            # and each remembered would push a refused one out of the list.)
            self.peers.remember_refused(peer)
        if (
            ended
            and self.finder is not None
            and session.link.refusal is not None
            and session.link.refusal.reason == "self"
            and not is_inbound(peer)
        ):
            # The peers key names every engine, this one too, and the
            # address we listen on was not the one listed: never again.
            self.finder.myself.add(peer)
        if greeting and session.link.ready and is_inbound(peer):
            self.peers.on_ready(session)
        elif greeting and session.link.ready:
            hello = session.link.peer_hello
            if hello is not None and self.tallies.met(peer, hello.engine_id):
                self.on_dial_failed(peer, "restarted")
            if self.finder is not None:
                self._member_ready(session)
        self._touch(session)
        if session.producer.has_lookups_to_serve:
            self.work.to_serve.add(peer)

    def _member_ready(self, session: Session) -> None:
        """A member we dialled is ready: ask what it holds."""
        finder, hello = self.finder, session.link.peer_hello
        assert finder is not None and hello is not None
        finder.directory.join(session.peer, hello.num_blocks)
        session.link.send(Subscribe())

    def pending_lookup_keys(self) -> int:
        """Lookup keys every peer together has queued for our engine."""
        return self.peers.pending_keys.keys

    def waiting_fetch_keys(self) -> int:
        """Keys of every peer's Fetches waiting for stores we have yet to
        park (Limits.engine_waiting_fetch_keys)."""
        return self.peers.waiting_keys.keys

    def on_dial_failed(self, peer: str, reason: str) -> None:
        """Our dial to ``peer`` ended before its handshake, for ``reason``
        (one of the control plane's codes): the requests naming it
        recompute, and the count tells an operator which address a router
        sends them to is wrong, and how."""
        self.tallies.dial_failures[reason] = (
            self.tallies.dial_failures.get(reason, 0) + 1
        )

    def on_bad_frame(self, peer: str, reason: str) -> None:
        """A frame that did not decode: counted, the session goes on."""
        tally(self.protocol_errors, reason, "other")

    def _tally_refusal(self, peer: str, session: Session) -> None:
        """Count a session's refusal once, when it happens (a refused
        session's later frames are ignored, not counted again)."""
        if session.link.refusal is not None:
            reason = session.link.refusal.reason
            tally(self.refusals, (peer, reason), ("other", reason))

    def on_write_unstoppable(self, peer: str, write_id: int) -> None:
        """A write given up on may still land: its session ends (see
        :meth:`Session.on_write_unstoppable`)."""
        session = self.peers.sessions.get(peer)
        if session is not None:
            session.on_write_unstoppable(write_id)
            self._touch(session)

    def on_write_done(self, peer: str, write_id: int, ok: bool, now: float) -> None:
        session = self.peers.sessions.get(peer)
        if session is not None:
            session.producer.on_write_done(write_id, ok, now)
            self._touch(session)

    def take_events(self) -> list[tuple[str, RuntimeEvent]]:
        """What the transports must do, by peer, in the order it arose:
        dials, transfers to post or cancel, sessions closed (answer each
        with :meth:`on_invalidated` once its peer's agent is dropped). A
        transfer is checked as it is taken: its load or write may have
        ended unposted since (then nothing can land, and it is left out)."""
        if not self.peers.to_connect and not self.work.out:
            return []  # the common pump: nothing arose since the last take
        dials, self.peers.to_connect = self.peers.to_connect, []
        out, self.work.out = self.work.out, []
        sessions = self.peers.sessions
        return [(peer, Dial()) for peer in dials] + [
            (peer, event)
            for peer, event in out
            if not isinstance(event, (PostRead, PostWrite))
            or ((s := sessions.get(peer)) is not None and s.posting(event))
        ]

    def on_read_done(self, peer: str, job_id: int, ok: bool, now: float) -> None:
        session = self.peers.sessions.get(peer)
        if session is not None:
            session.consumer.on_read_done(job_id, ok, now)
            self._touch(session)

    def on_invalidated(self, peer: str, now: float) -> None:
        """The data plane dropped the peer's agent: fenced loads may fail now,
        and the session's last results are collected before it goes."""
        session = self.peers.sessions.get(peer)
        if session is None:
            return
        session.consumer.confirm_invalidated()
        self._touch(session)  # its fenced loads' results
        self.retired_sessions.append(session)  # its last counts, for metrics
        session.leave_engine()
        session.on_close = None
        self.peers.retire(session, now)
        self.work.dirty.discard(peer)
        self.requests.forget_hits_through(peer)

    # -- timers and steps --

    def tick(self, now: float) -> None:
        """Fire the timers that are due, earliest first; O(due work), not
        O(peers)."""
        results = self.jobs.results
        for timer in self.timers.due(now):
            match timer:
                case SessionDue(peer):
                    session = self.peers.sessions.get(peer)
                    if session is not None:
                        session.tick(now)
                        self._touch(session)
                case OrphanDue(serve):
                    results.extend(self.work.orphan_due(serve))
                case StoreDue(store):
                    if (result := self.parked.store_due(store)) is not None:
                        results.append(result)
                case LateFetchDue():
                    self.parked.late_fetch_due(timer, now)
                case WaitNoteDue(kv_id):
                    self.parked.note_due(kv_id, now)
        self.parked.tick(now)
        self.peers.tick(now)
        if self.finder is not None:
            self._tick_finder(now)

    def _tick_finder(self, now: float) -> None:
        """The directory's work of a step: failed found loads move on, our
        news goes to every subscriber, members without a session are
        dialled (at most once a second)."""
        finder = self.finder
        assert finder is not None
        answered, finder.answered = finder.answered, set()
        for gen in answered:
            req = self.requests.by_gen.get(gen)
            if req is not None:
                self._advance_found(req, now)
        retry, finder.retry = finder.retry, []
        for result in retry:
            req = self.requests.by_gen.get(result.gen)
            if req is None or req.consumer is None or req.consumer.found is None:
                self.jobs.results.append(result)
            else:
                self._fail_over(req, [], result.reason, now)
        updates = finder.updates()
        for peer in list(finder.subscribers) if updates else ():
            session = self.peers.sessions.get(peer)
            if session is None or session.link.closed:
                finder.subscribers.discard(peer)
                continue
            for msg in updates:
                session.link.send(msg)
            self._touch(session)
        if finder.member_check_due(now):
            targets = self.membership.dial_targets()
            for member in finder.to_dial(targets, self.peers.sessions):
                self.peers.session_for(member, now, self.requests.named_peers)

    def drain_deadline(self, now: float) -> float:
        """When a cache reset's drain may give up on jobs still running:
        each ends by a deadline armed now or by a cancel's wait after it
        (an offered READ's hold grows with its bytes: no fixed bound)."""
        held = [when for when, timer in self.timers.pending() if _holds(timer)]
        held += [s.link.latest_deadline() for s in self.peers.sessions.values()]
        latest = max(held, default=-math.inf) + self.settings.timeouts.abort_ack_s + 5.0
        return min(max(now + 30.0, latest), now + MAX_DRAIN_S)

    def end_step(self, now: float) -> None:
        """Re-arm deadlines of sessions touched this step, then forget them."""
        self.work.rearm(self.peers.sessions)

    def _touch(self, session: Session) -> None:
        """Note the session changed and take its events, in order: probe
        answers apply at once (the next lookup() sees them), results wait
        for the engine's poll, transfers and the close for the runtime's."""
        peer, work = session.peer, self.work
        work.dirty.add(peer)
        for event in session.link.take_events():
            match event:
                case ProbeAnswered(answer):
                    self._apply_answer(answer)
                case LoadDone(result):
                    if self._found_load_failed(result):
                        self.finder.retry.append(result)  # type: ignore[union-attr]
                        continue
                    self.jobs.results.append(result)
                    if result.success and self.finder is not None:
                        # What we loaded is in our primary tier now: the
                        # fleet may find it here too.
                        job = self.jobs.jobs.get(result.job_id)
                        if job is not None and job.keys:
                            self.finder.stored(job.keys, self.settings.me.num_blocks)
                case StoreDone(result):
                    self.jobs.results.append(result)
                case PinJob(job_id):
                    self.jobs.register(job_id, "pin", "")
                case WantsParked(serve, at):
                    # The Fetch is the last thing its message did: binding
                    # it now (which may touch this session again) keeps
                    # every event in the order it happened.
                    self.parked.bind(peer, serve, at)
                case ParkedFetchEnded(serve):
                    self.parked.fetch_ended(serve)
                case Orphaned(serve):
                    work.adopt(serve)
                case HoldingsHeard(add, drop):
                    if self.finder is not None and not is_inbound(peer):
                        self.finder.heard(peer, add, drop)
                case Subscribed():
                    if self.finder is not None and is_inbound(peer):
                        self.finder.subscribers.add(peer)
                        for msg in self.finder.snapshot():
                            session.link.send(msg)
                case Closed():
                    if self.finder is not None:
                        self.finder.left(peer)
                    work.out.append((peer, event))
                case PostRead() | PostWrite() | Cancel() | Trusted() | RegionKnown():
                    work.out.append((peer, event))

    def _apply_answer(self, answer: ProbeAnswer) -> None:
        req = self.requests.by_gen.get(answer.gen)
        consumer = req.consumer if req is not None else None
        if consumer is None:
            return
        if answer.hits is None:
            consumer.keys.update(dict.fromkeys(answer.keys, False))
        else:
            consumer.keys.update(zip(answer.keys, answer.hits, strict=True))
        consumer.asked.difference_update(answer.keys)
        if consumer.found is not None and self.finder is not None:
            self.finder.answered.add(answer.gen)  # at the next tick

    def _found_load_failed(self, result: LoadResult) -> bool:
        """Whether ``result`` is a failed load of a found leg whose request
        is live: it may move to another holder."""
        if result.success or result.request_finished or self.finder is None:
            return False
        req = self.requests.by_gen.get(result.gen)
        return (
            req is not None
            and req.consumer is not None
            and (req.consumer.found is not None)
        )

    def release_parked(self, now: float) -> None:
        """Cache reset: parked stores go back to the engine as failed."""
        self.jobs.results.extend(self.parked.release())

    def release_for_reset(self, now: float) -> None:
        """Cache reset: give back everything not mid-write (parked stores,
        pins of unfetched lookups); writes in flight finish normally, and
        our Fetches wait no longer than a fetch deadline."""
        self.release_parked(now)
        for session in self.peers.sessions.values():
            session.producer.release_unwritten()
            session.consumer.stop_waiting(now)
            self._touch(session)

    def close_all(self, reason: str) -> None:
        for session in self.peers.sessions.values():
            session.close(reason)
            self._touch(session)

    # -- introspection --

    @property
    def has_lookups_to_serve(self) -> bool:
        return bool(self.work.to_serve)

    @property
    def limit_refusals(self) -> dict[str, int]:
        """Refusals no session counts, by reason (exported as ``refusals``,
        peer ``unknown``): dials refused at ``max_peers``, connections at
        ``max_inbound_peers``, and sources outside the membership
        (``not_a_member``), whose address a client chose."""
        return {**self.tallies.limit_refusals(), **self.membership.refused}

    def has_unsent(self) -> bool:
        """A session changed since the last pump and holds output for it."""
        return self.work.has_output(self.peers.sessions)

    def peer_transfers(self) -> bool:
        """A peer may be moving bytes to or from our region (see
        :meth:`SessionWork.peer_transfers`)."""
        return self.work.peer_transfers(self.peers.sessions)

    def waiting_requests(self) -> int:
        """Live consumer requests blocked on us (an unanswered lookup or a
        load in flight): when every live request is, the engine is idle."""
        return self.requests.waiting(self.jobs)

    def has_pending_work(self) -> bool:
        """Work of ours in flight that needs the engine to keep stepping.

        Pins and parked stores are not: they end by a peer's message or a
        deadline, which the poll (or the waker) handles without an engine
        step, and their result then wakes the engine (``results_ready``).
        Counting them would keep a producer stepping for a pin's lifetime.
        """
        busy = self.jobs.results or self.requests.unsent or self.work.to_serve
        return bool(busy) or (self.waiting_requests() > 0)

    def results_ready(self) -> bool:
        """Something for the engine: a job result (lookup answers apply
        as they come)."""
        return bool(self.jobs.results)

    def jobs_in_flight(self) -> int:
        return self.jobs.in_flight()

    def jobs_unended(self, now: float) -> int:
        """Jobs with no result yet: what a cache reset's drain waits for. A
        result buffered for the next :meth:`get_finished_jobs` has ended
        (vLLM's drain contract: "yielded by a prior call or queued for the
        next one")."""
        return self.jobs.unended()

    def parked_store_count(self) -> int:
        return self.parked.store_count()

    def sessions(self) -> Iterable[Session]:
        return self.peers.sessions.values()

    def session(self, peer: str) -> Session | None:
        return self.peers.sessions.get(peer)

    def sizes(self) -> dict[str, int]:
        """Every container's size, residue or not (for diagnostics)."""
        return sizes_of(self)

    def state_report(self) -> dict[str, int]:
        """Every per-request structure's size: all zero once work drains.

        Derived, not listed: this manager's own containers and each
        sub-object's residue (its containers, what its records hold, the
        sessions' sizes). A container added later is reported unless its
        holder declares it per-peer state or a timer."""
        report = residue_of(self)
        for holder in holders_of(self).values():
            report.update(holder.residue())
        return report


def _holds(timer: Due) -> bool:
    """Whether a timer ends a job the engine still waits on (a drain's
    bound): a parked store not yet bound, an orphan's offer not yet ended,
    a late Fetch."""
    match timer:
        case StoreDue(store):
            return store.state is State.STORED
        case OrphanDue(serve):
            return not serve.terminal
        case LateFetchDue():
            return True
    return False
