"""The producer side of a session: the peer loads blocks from us.

A SERVE per peer request (``(req, gen)``) answers the peer's lookups in our
engine's serve window, pinning the hits (which the peer may READ until it
releases them), or takes its Fetch: for blocks it pinned, or for parked
stores of a disaggregated prefill (bound by the owner when they are there),
which it offers for READ or WRITEs. A serve owns the pins it created and
the parked stores bound to it until its one release path gives them back.
"""

from __future__ import annotations

from p2p_kv.lifecycle import ABORTED_WRITES, WRITES_IN_FLIGHT, Effect, Event, State
from p2p_kv.peer.events import (
    Cancel,
    Direction,
    Orphaned,
    ParkedFetchEnded,
    PinJob,
    PostWrite,
    StoreDone,
    TransferRef,
    WantsParked,
)
from p2p_kv.peer.link import Link
from p2p_kv.peer.records import (
    KeyCount,
    ParkedStore,
    Pin,
    Pinner,
    PinResult,
    Serve,
    StoreResult,
    all_miss,
)
from p2p_kv.protocol import (
    Abort,
    AbortAck,
    Fetch,
    FetchOffer,
    Lookup,
    Release,
    Revoke,
    TransferDone,
)


class ProducerSide:
    """Serves over one :class:`~p2p_kv.peer.link.Link`."""

    def __init__(
        self,
        link: Link,
        *,
        reads: bool,
        engine_keys: tuple[KeyCount, KeyCount] | None = None,
    ) -> None:
        self.link = link
        #: offer our pinned blocks for one-sided READ
        self.reads = reads
        pending, waiting = engine_keys or (KeyCount(), KeyCount())
        self._serves: dict[tuple[str, int], Serve] = {}
        self._serve_queue: list[Serve] = []  # LOOKUP_QUEUED, in arrival order
        #: keys of queued lookups (Limits.max_pending_keys) and of this
        #: peer's serves in FETCH_WAITING (see Serve.waiting), passed on to
        #: the engine's counts while the session is the engine's
        self.pending, self.waiting = KeyCount(pending), KeyCount(waiting)
        self._writing: dict[int, Serve] = {}  # by write id
        self._next_write = 0

    # -- outputs ---------------------------------------------------------------

    def _stores_done(self, results: list[StoreResult]) -> None:
        for result in results:
            self.link.emit(StoreDone(result))

    def posting(self, event: PostWrite) -> bool:
        """Whether ``event`` is still to be posted (its serve still writes);
        if so, the data plane has it from now on."""
        serve = self._writing.get(event.ref.ident)
        if serve is None or not serve.can(Event.POSTED):
            return False
        serve.fire(Event.POSTED)
        return True

    # -- the link's turns --------------------------------------------------------

    def lose(self, kind: str) -> None:
        """The link ended: every serve is released, except offered blocks
        the peer may still READ (it may not know yet): those outlive the
        session, handed to the owner (``Orphaned``) to their deadline."""
        for serve in list(self._serves.values()):
            if serve.exposed and serve.can(Event.ORPHAN):
                serve.fire(Event.ORPHAN)
                self._drop_pending(serve)
                del self._serves[(serve.req, serve.gen)]
                self.link.emit(Orphaned(serve))
                continue
            self._release_serve(serve, Event.PEER_LOST, ok=False, reason=kind)
        self._serve_queue.clear()

    # -- introspection -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._serves)

    def serves(self) -> list[Serve]:
        return list(self._serves.values())

    @property
    def has_lookups_to_serve(self) -> bool:
        return bool(self._serve_queue)

    @property
    def transfers(self) -> bool:
        """Blocks of ours the peer was told of and that are still held for
        it: it may be READing them now."""
        return any(sv.exposed for sv in self._serves.values())

    @property
    def pinned_blocks(self) -> int:
        return sum(s.pinned_blocks for s in self._serves.values())

    @property
    def active(self) -> bool:
        return bool(self._serves)

    def sizes(self) -> dict[str, int]:
        return {
            "serves": len(self._serves),
            "writes": len(self._writing),
            "pending_lookup_keys": self.pending.keys,
            "serve_queue": len(self._serve_queue),
        }

    # -- the peer's requests and the engine's answers ------------------------------

    def on_lookup(self, msg: Lookup, now: float) -> None:
        cost, limits = max(1, len(msg.keys)), self.link.limits
        if self.link.over_bound(
            self.pending,
            cost,
            (limits.max_pending_keys, limits.engine_pending_keys),
            "pending_keys",
            "lookup keys already wait for our engine",
            msg,
        ):
            self.link.send(all_miss(msg))
            return
        serve = self._serves.get((msg.req, msg.gen))
        if serve is None:
            if len(self._serves) >= self.link.limits.max_serves:
                self.link.protocol_error(
                    "limit_serves", "too many requests in flight", msg.req, msg.gen
                )
                self.link.send(all_miss(msg))
                return
            serve = Serve(
                msg.req,
                msg.gen,
                State.LOOKUP_QUEUED,
                now + self.link.timeouts.pin_ttl_s,
            )
            self.link.arm(serve, serve.deadline)
            self._serves[(msg.req, msg.gen)] = serve
        elif not serve.can(Event.LOOKUP):
            # Revoking, or past its Fetch (one load per generation: a key
            # asked in the step of the load, sent after it).
            self.link.send(all_miss(msg))
            return
        else:
            serve.fire(Event.LOOKUP)
        serve.pending_lookups.append(msg)
        self.pending.add(cost)
        if serve not in self._serve_queue:
            self._serve_queue.append(serve)

    def _drop_pending(self, serve: Serve) -> list[Lookup]:
        """Take a serve's queued lookups off the pending-keys budget."""
        pending, serve.pending_lookups = serve.pending_lookups, []
        self.pending.add(-sum(max(1, len(lk.keys)) for lk in pending))
        return pending

    def serve_lookups(self, pinner: Pinner, now: float) -> None:
        """Answer queued lookups against the engine (its serve window)."""
        queue, self._serve_queue = self._serve_queue, []
        if not queue:
            return
        # Counted once per window, not per lookup: a sum per lookup over
        # thousands of serves would make a busy window quadratic.
        pinned = self.pinned_blocks
        for serve in queue:
            pending = self._drop_pending(serve)
            if serve.state is not State.LOOKUP_QUEUED:
                continue
            for lookup in pending:
                budget = self.link.limits.max_pinned_blocks - pinned
                keys = lookup.keys if len(lookup.keys) <= budget else []
                if len(keys) < len(lookup.keys):
                    self.link.counters.bump(
                        self.link.counters.refused, "limit_pinned_blocks"
                    )
                label = f"p2p_kv:{self.link.peer}:{serve.req}:{serve.gen}:{lookup.seq}"
                try:
                    result = pinner.pin(label, keys) if keys else PinResult([], [])
                except Exception:
                    # The engine could not pin: an all-miss answer, and the
                    # window goes on for every other lookup.
                    self.link.counters.failed("pin_error")
                    result = PinResult([], [])
                hits = result.hits or [False] * len(lookup.keys)
                for job_id, pkeys, pslots in result.pins:
                    pinned += len(pkeys)
                    self.link.emit(PinJob(job_id))
                    serve.pins.append(
                        Pin(job_id, dict(zip(pkeys, pslots, strict=True)))
                    )
                hold_ms = round(self.link.timeouts.hold_s() * 1000) if self.reads else 0
                self.link.send(serve.answer(lookup, hits, hold_ms))
            serve.fire(Event.SERVED)
            # Never less than an offer announces (whole milliseconds, one at
            # least): a pin lifetime under 1 ms is announced as 1 ms and
            # must not be released before it, under a READ still trusted.
            self.link.arm(
                serve,
                now + max(self.link.timeouts.pin_ttl_s, self.link.timeouts.hold_s()),
            )

    def on_release(self, msg: Release) -> None:
        serve = self._serves.get((msg.req, msg.gen))
        if serve is None:
            return  # already released (deadline, abort): nothing to do
        serve.fire(Event.RELEASE)
        blocks = min(msg.blocks, serve.held_blocks)
        self.link.counters.bytes_served += blocks * self.link.me.block_bytes
        # Parked stores the consumer never read (it gave the load up) were
        # not served; pins only held blocks either way.
        ok = blocks > 0 or not serve.parked
        self._release_serve(serve, None, ok=ok, reason="" if ok else "unread")

    def on_fetch(self, msg: Fetch, now: float) -> None:
        region = self.link.peer_hello
        assert region is not None
        bad = [s for s in msg.slots if s >= region.num_blocks]
        if bad:
            self.link.protocol_error(
                "slot_out_of_range",
                f"slot {bad[0]} outside the peer's {region.num_blocks} blocks",
                msg.req,
                msg.gen,
            )
            self.link.send(
                TransferDone(msg.req, msg.gen, msg.job, False, "slot out of range")
            )
            return
        serve = self._serves.get((msg.req, msg.gen))
        if serve is None and not msg.parked:
            # A lookup came first, and its pins are gone: nothing of ours
            # will ever serve this.
            self.link.counters.failed("fetch_not_pinned")
            self.link.send(TransferDone(msg.req, msg.gen, msg.job, False, "not pinned"))
            return
        if serve is None:
            if len(self._serves) >= self.link.limits.max_serves:
                self.link.send(TransferDone(msg.req, msg.gen, msg.job, False, "busy"))
                return
            cost, limits = len(msg.keys), self.link.limits
            # Counted per serve alone, a peer could make us hold 4,096
            # Fetches of 65,536 keys each: 28 GiB.
            if self.link.over_bound(
                self.waiting,
                cost,
                (limits.max_waiting_fetch_keys, limits.engine_waiting_fetch_keys),
                "waiting_fetch_keys",
                "keys of fetches already wait for our stores",
                msg,
            ):
                self.link.send(TransferDone(msg.req, msg.gen, msg.job, False, "busy"))
                return
            # No lookup came first: a disaggregated-prefill fetch for parked
            # stores. The manager binds them (wants_parked).
            serve = Serve(
                msg.req,
                msg.gen,
                State.FETCH_WAITING,
                now + self.link.timeouts.parked_wait_s,
            )
            serve.fetch = msg
            self.link.arm(serve, serve.deadline)
            self._serves[(msg.req, msg.gen)] = serve
            serve.waiting = self.waiting
            self.waiting.add(cost)
            self.link.emit(WantsParked(serve, now))
            return
        if serve.state is State.REVOKING:
            # The consumer had not seen our Revoke yet: the pins are going.
            self.link.send(TransferDone(msg.req, msg.gen, msg.job, False, "reset"))
            return
        if serve.state is not State.PINNED:
            # One Fetch per serve: a second one re-offering (or writing)
            # blocks whose Release a first READ may send would let a peer
            # hold parked stores for good, or read them after their release.
            self.link.protocol_error(
                "duplicate_fetch",
                f"fetch job {msg.job} while the request is {serve.state.value}",
                msg.req,
                msg.gen,
            )
            # A replay of the job being served must not fail it early (its
            # slots would be released while our write can still land); a
            # different job has nothing in flight and can be refused.
            if serve.fetch is None or msg.job != serve.fetch.job:
                self.link.send(
                    TransferDone(msg.req, msg.gen, msg.job, False, "duplicate fetch")
                )
            return
        # (A read Fetch here: the consumer's READ window on our lookup
        # answer closed before its load; the pins are offered again.)
        serve.fetch = msg
        self._serve_fetch(serve, Event.FETCH, now)

    def attach_parked(
        self, serve: Serve, stores: list[ParkedStore], complete: bool, now: float
    ) -> None:
        """The owner hands over parked stores for a waiting fetch (and says
        whether more may come)."""
        if serve.bind(stores, complete):
            self._serve_fetch(serve, Event.STORES_READY, now)
        elif serve.complete:
            assert serve.fetch is not None
            job = serve.fetch.job
            self.link.send(
                TransferDone(serve.req, serve.gen, job, False, "blocks not stored")
            )
            self._release_serve(serve, Event.TIMEOUT, ok=False, reason="missing")

    def tell_waiting(self, serve: Serve, now: float) -> None:
        """The prefill ``serve``'s Fetch waits for is running here: tell the
        peer (FetchWait), at most once a heartbeat interval, so that it
        waits on past its fetch deadline. Promised for no longer than we
        hold the Fetch ourselves (its deadline, ``parked_ttl_s``)."""
        if self.link.ready:
            note = serve.wait_note(now, self.link.timeouts.heartbeat_interval_s)
            if note is not None:
                self.link.send(note)

    def _serve_fetch(self, serve: Serve, write_event: Event, now: float) -> None:
        """The serve's Fetch, its blocks all held: offered for the consumer
        to READ if it asked and we offer reads at all (``read_path``), else
        written (``write_event`` starts the write)."""
        assert serve.fetch is not None
        if serve.fetch.read and self.reads:
            self._offer(serve, now)
        else:
            self._start_writes(serve, write_event, now)

    def _offer(self, serve: Serve, now: float) -> None:
        """Answer a ``read`` Fetch whose blocks we hold (pins, or parked
        stores all here) with where they are, and hold them as offered pins
        are held: to the consumer's Release or Abort, the hold's deadline,
        or orphaned past a lost session."""
        src = self._fetch_sources(serve)
        if src is None:
            return
        serve.fire(Event.OFFER)
        serve.offered = True
        hold_s = self.link.timeouts.hold_s(len(src) * self.link.me.block_bytes)
        self.link.arm(serve, now + hold_s)
        fetch = serve.fetch
        assert fetch is not None
        ttl_ms = round(hold_s * 1000)
        self.link.send(FetchOffer(fetch.req, fetch.gen, fetch.job, src, ttl_ms))

    def _fetch_sources(self, serve: Serve) -> list[int] | None:
        """Our slots of the serve's Fetch, key by key; None (the peer told,
        the serve released) if a key is not among what it holds."""
        fetch = serve.fetch
        assert fetch is not None
        table = serve.slot_table()
        src = [table.get(key, -1) for key in fetch.keys]
        if -1 in src:
            self.link.send(
                TransferDone(serve.req, serve.gen, fetch.job, False, "block not pinned")
            )
            self._release_serve(serve, Event.ABORT, ok=False, reason="not_pinned")
            return None
        return src

    def _start_writes(self, serve: Serve, event: Event, now: float) -> None:
        fetch = serve.fetch
        assert fetch is not None
        src = self._fetch_sources(serve)
        if src is None:
            return
        serve.fire(event)
        self._next_write += 1
        serve.write_id = self._next_write
        nbytes = len(src) * self.link.me.block_bytes
        self.link.arm(serve, self.link.timeouts.fetch_deadline(now, nbytes))
        self._writing[serve.write_id] = serve
        self.link.emit(
            PostWrite(
                TransferRef(Direction.WRITE, serve.write_id),
                src,
                list(fetch.slots),
                f"{fetch.req}:{fetch.gen}:{fetch.job}".encode(),
            )
        )

    def on_write_done(self, write_id: int, ok: bool, now: float) -> None:
        """The data plane finished (or failed) a posted write."""
        serve = self._writing.pop(write_id, None)
        if serve is None:
            return
        fetch = serve.fetch
        assert fetch is not None
        self.link.send(serve.write_reply(ok))
        if ok:
            self.link.counters.bytes_served += (
                len(fetch.keys) * self.link.me.block_bytes
            )
        self._release_serve(
            serve,
            Event.WRITES_DONE if ok else Event.WRITES_FAILED,
            ok=ok,
            reason="" if ok else "write_failed",
        )

    def on_write_unstoppable(
        self, write_id: int, event: Event = Event.WRITES_FAILED
    ) -> None:
        """A write of ours was given up on while still running: its bytes
        may yet land in the peer's slots (NIXL cannot stop them). The serve
        is released; the session then ends (the peer must not hear that the
        write is over: it hears Goodbye, fails the load and drops our agent,
        which is what fences it). ``event``: what ended the serve (the data
        plane's report, or its own TIMEOUT row when no report came)."""
        serve = self._writing.pop(write_id, None)
        if serve is not None:
            self._release_serve(serve, event, ok=False, reason="write_failed")

    def on_abort(self, msg: Abort) -> None:
        serve = self._serves.get((msg.req, msg.gen))
        if serve is None:
            # Nothing held for it (already released): the fence holds.
            self.link.send(AbortAck(msg.req, msg.gen))
            return
        if serve.state in ABORTED_WRITES:
            return  # its AbortAck goes once the write settles
        match serve.fire(Event.ABORT):
            case Effect.ACK_AND_RELEASE:
                self.link.send(AbortAck(msg.req, msg.gen))
                self._release_serve(serve, None, ok=False, reason="abort")
            case Effect.ACK_WHEN_SETTLED:
                pass  # on_write_done replies

    def _release_serve(
        self, serve: Serve, event: Event | None, *, ok: bool, reason: str
    ) -> None:
        """The one release path of a SERVE: pins back to the engine, bound
        parked stores released, bookkeeping dropped."""
        if event is not None and serve.state is not State.RELEASED:
            serve.fire(event)
        for lookup in self._drop_pending(serve):
            # Answered, not dropped: the consumer need not wait for its
            # lookup deadline to learn that nothing is held.
            self.link.send(all_miss(lookup))
        self._serves.pop((serve.req, serve.gen), None)
        if serve.write_id in self._writing:
            del self._writing[serve.write_id]
        self._stores_done(serve.let_go(event, ok, reason))
        if serve.fetch is not None and serve.fetch.parked:
            self.link.emit(ParkedFetchEnded(serve))
        # Its timer entry may outlive it (see _arm): not the peer's keys and
        # slots (8 MiB for 60,000 keys, outside every per-peer bound).
        serve.fetch = None

    def release_unwritten(self) -> None:
        """Release every serve with no write in flight (cache reset). A later
        fetch for it is answered TransferDone(ok=False): the peer recomputes.
        Pins offered for READ are revoked instead: they go back when the
        peer's Release says no read is in flight (or at their deadline)."""
        for serve in list(self._serves.values()):
            if serve.exposed and serve.can(Event.REVOKE):
                for lookup in self._drop_pending(serve):
                    self.link.send(all_miss(lookup))
                if serve in self._serve_queue:
                    self._serve_queue.remove(serve)
                serve.fire(Event.REVOKE)
                self.link.send(Revoke(serve.req, serve.gen))
                continue
            if serve.can(Event.RESET):
                fetch = serve.fetch
                if fetch is not None:
                    self.link.send(
                        TransferDone(serve.req, serve.gen, fetch.job, False, "reset")
                    )
                self._release_serve(serve, Event.RESET, ok=False, reason="reset")

    def expire(self, serve: Serve, now: float) -> bool:
        """``serve``'s deadline passed; False if that must end the session
        (a write the data plane never said it stopped)."""
        fetch, prior = serve.fetch, serve.state
        if prior in WRITES_IN_FLIGHT or prior is State.WRITE_QUEUED:
            self.link.counters.failed("write_timeout")
        match serve.fire(Event.TIMEOUT):
            case Effect.LOSE_SESSION:
                # The data plane never said the write stopped.
                self._writing.pop(serve.write_id, None)
                self._release_serve(serve, None, ok=False, reason="write_failed")
                return False
            case Effect.CANCEL_WRITE:
                # The data plane stops it (Cancel) and then reports it
                # (on_write_done: the reply goes), or reports it unstopped
                # (on_write_unstoppable: the session ends instead).
                ref = TransferRef(Direction.WRITE, serve.write_id)
                self.link.emit(Cancel(ref))
                self.link.arm(serve, now + self.link.timeouts.abort_ack_s)
                return True
            case Effect.REFUSE_AND_RELEASE if fetch is not None:
                # Waiting for stores, or a WRITE never posted: nothing can
                # land, so the peer hears at once.
                why = (
                    "blocks not stored in time"
                    if prior is State.FETCH_WAITING
                    else "write deadline"
                )
                self.link.send(
                    TransferDone(serve.req, serve.gen, fetch.job, False, why)
                )
        self._release_serve(serve, None, ok=False, reason="deadline")
        return True
