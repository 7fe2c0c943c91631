"""The consumer side of a session: we load blocks from the peer.

It asks the peer which blocks it holds (a PROBE per lookup batch) and loads
them (a LOAD per job): a one-sided READ of blocks the peer offered with its
lookup answer, or else a Fetch, which the peer answers with an offer we
READ (a ``read`` Fetch) or a WRITE of its own. A READ is trusted only if it
ended well inside the pins' lifetime as the peer announced it, measured
from before we sent the Lookup, so a slot is never read after the peer
could have reused it.

The fence rule lives here: a LOAD whose slots may still be written (by our
READ or by the peer's WRITE) never yields its result until that is over:
our READ ended, the peer said so (TransferDone or AbortAck), or the peer's
data agent was invalidated (:meth:`ConsumerSide.confirm_invalidated`).
Until then its slots are counted as fenced.
"""

from __future__ import annotations

from p2p_kv.lifecycle import Effect, Event, State
from p2p_kv.peer.events import Cancel, Direction, LoadDone, PostRead, TransferRef
from p2p_kv.peer.link import Link
from p2p_kv.peer.lookups import Lookups
from p2p_kv.peer.records import Load, LoadResult, Probe
from p2p_kv.protocol import (
    MAX_KEYS,
    Abort,
    AbortAck,
    Fetch,
    FetchOffer,
    FetchWait,
    Release,
    Revoke,
    TransferDone,
)


class ConsumerSide:
    """Probes and loads over one :class:`~p2p_kv.peer.link.Link`."""

    def __init__(self, link: Link, *, reads: bool) -> None:
        self.link = link
        #: READ blocks the peer offers (else every load is a Fetch it WRITEs)
        self.reads = reads
        #: one record per live generation (engine request) asking this
        #: peer, with its probes (the PROBE machines)
        self.lookups = Lookups(link, reads=reads)
        #: load jobs by job id (a finished generation's may still settle)
        self._loads: dict[int, Load] = {}
        #: results of loads a write may still land in, with their slot
        #: counts: out once the peer's agent is invalidated
        self._fenced: list[tuple[LoadResult, int]] = []

    # -- outputs ---------------------------------------------------------------

    def _done(self, result: LoadResult) -> None:
        self.link.emit(LoadDone(result))

    def _post_read(self, job_id: int, local: list[int], remote: list[int]) -> None:
        self.link.emit(PostRead(TransferRef(Direction.READ, job_id), local, remote))

    def posting(self, event: PostRead) -> bool:
        """Whether ``event`` is still to be posted (its load still waits in
        READ_QUEUED); if so, its load is fenced from now on: its bytes may
        land once the data plane has it."""
        load = self._loads.get(event.ref.ident)
        if load is None or load.state is not State.READ_QUEUED:
            return False
        load.fire(Event.POSTED)
        return True

    # -- the link's turns --------------------------------------------------------

    def flush(self) -> None:
        """The link became ready: what waited for it leaves now."""
        self.lookups.flush()
        for load in self._loads.values():
            if load.can(Event.SESSION_READY) and (
                load.fire(Event.SESSION_READY) is Effect.SEND_FETCH
            ):
                assert load.fetch is not None  # only a Fetch waits for READY
                self.link.send(load.fetch)
                if not load.fetch.read:
                    load.fetch = None  # sent: the keys and slots are not kept

    def lose(self, kind: str) -> None:
        """The link ended: every probe is unanswered, every load fails;
        loads that may still be written wait in the fence until
        :meth:`confirm_invalidated`."""
        self.lookups.lose()
        for load in self._loads.values():
            effect = load.fire(Event.PEER_LOST)
            why = load.fail_as(self.link.counters, kind)
            result = load.result(False, why, load.started)
            match effect:
                case Effect.FENCE:
                    self._fenced.append((result, load.blocks))
                case Effect.END:
                    self._done(result)
        self._loads.clear()

    def confirm_invalidated(self) -> None:
        """The peer's data agent is gone: its writes can no longer land."""
        for result, _ in self._fenced:
            self._done(result)
        self._fenced.clear()

    def expire(self, item: Probe | Load, now: float) -> bool:
        """``item``'s deadline passed; False if that must end the session
        (a load neither finished nor acknowledged: only dropping the peer's
        agent fences its slots)."""
        if isinstance(item, Probe):
            self.lookups.expire(item)
            return True
        effect = item.fire(Event.TIMEOUT)
        if effect is not Effect.LOSE_SESSION:
            item.fail_as(self.link.counters, "timeout")
        match effect:
            case Effect.LOSE_SESSION:
                return False
            case Effect.END:  # was only queued
                self._end_unstarted(item, "timeout", now)
            case Effect.STOP_READ | Effect.AWAIT_ACK as effect:
                self._stop(item, effect, now + self.link.timeouts.abort_ack_s)
        return True

    def _give_up(self, load: Load, event: Event, now: float) -> None:
        """Give a started load up (``event``: ABORT or TIMEOUT)."""
        effect = load.fire(event)
        self._stop(load, effect, now + self.link.timeouts.abort_ack_s)

    def _stop(self, load: Load, effect: Effect, ack_by: float) -> None:
        """Stop a load's transfer, waiting for its end until ``ack_by``: our
        READ is cancelled (STOP_READ), the peer's WRITE aborted (AWAIT_ACK:
        it answers AbortAck, or TransferDone if it finished first)."""
        self.link.arm(load, ack_by)
        if effect is Effect.STOP_READ:
            self.link.emit(Cancel(TransferRef(Direction.READ, load.job)))
        else:
            self.link.send(Abort(load.req, load.gen))

    # -- introspection -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self.lookups) + len(self._loads)

    def loads(self) -> list[Load]:
        return list(self._loads.values())

    @property
    def transfers(self) -> bool:
        """A load of ours a peer's WRITE (or our READ) may still land in."""
        return any(ld.fenced for ld in self._loads.values())

    @property
    def fenced_slots(self) -> int:
        """Destination slots a transfer may still land in."""
        n = sum(ld.blocks for ld in self._loads.values() if ld.fenced)
        return n + sum(blocks for _, blocks in self._fenced)

    @property
    def active(self) -> bool:
        return bool(self._loads or self._fenced) or self.lookups.active

    def sizes(self) -> dict[str, int]:
        return {
            **self.lookups.sizes(),
            "loads": len(self._loads),
            "fenced_results": len(self._fenced),
        }

    # -- requests and the peer's answers -------------------------------------------

    def send_fetch(
        self,
        job_id: int,
        req: str,
        gen: int,
        keys: list[bytes],
        slots: list[int],
        block_bytes: int,
        now: float,
        *,
        parked: bool = True,
    ) -> None:
        """Load ``keys`` into our ``slots`` (one load job): READ them if the
        peer offered all of them and the offer is still good, else ask the
        peer to WRITE them (from parked stores, if ``parked``: no lookup
        came first)."""
        nbytes = len(keys) * block_bytes
        if job_id in self._loads:
            raise ValueError(f"load job {job_id} submitted twice")
        if self.link.closed:
            self._done(LoadResult(job_id, gen, False, "peer_down"))
            return
        # A slot past our region is our own caller's mistake: refused before
        # any message or READ.
        record = self.lookups.open(gen, req)
        why = (
            "slot_out_of_range"
            if slots and max(slots) >= self.link.me.num_blocks
            else ""
        )
        why = why or ("revoked" if record.revoked else "")
        if why:
            self.link.counters.failed(why)
            self._done(LoadResult(job_id, gen, False, why))
            self.lookups.tidy(record)
            return
        deadline = self.link.timeouts.fetch_deadline(now, nbytes)
        record.contacted = True
        offer, record.offer = record.offer, None
        fetch: Fetch | None = None
        if offer is not None and offer.covers(
            keys, now + nbytes / self.link.timeouts.fetch_bytes_per_s
        ):
            deadline = min(deadline, offer.valid_until)
            initial, read_until = State.READ_QUEUED, offer.valid_until
            self.link.counters.loads_read += 1
        else:
            if len(keys) > MAX_KEYS or len(set(keys)) != len(keys):
                # A Fetch asks for each block once, at most MAX_KEYS of them
                # (a peer refuses the frame): recompute now, not at the
                # deadline.
                self.link.counters.failed("unsendable_keys")
                self._done(LoadResult(job_id, gen, False, "unsendable_keys"))
                return
            fetch = Fetch(
                req=req,
                gen=gen,
                job=job_id,
                keys=keys,
                slots=slots,
                parked=parked,
                # Offered to a reader, not written: a producer's WRITE into
                # our slots is fenced only by its word or its death.
                read=self.reads,
            )
            initial = State.FETCH_POSTED if self.link.ready else State.QUEUED
            offer, read_until = None, 0.0
            self.link.counters.loads_fetched += 1
        load = Load(
            job_id,
            req,
            gen,
            len(keys),
            nbytes,
            now,
            deadline,
            initial,
            fetch=fetch if initial is State.QUEUED or self.reads else None,
            read_until=read_until,
        )
        self._loads[job_id] = load
        self.link.arm(load, load.deadline)
        if offer is not None:
            remote = list(map(offer.slots.__getitem__, keys))
            self._post_read(job_id, list(slots), remote)
        elif fetch is not None and initial is State.FETCH_POSTED:
            self.link.send(fetch)

    def on_fetch_wait(self, msg: FetchWait, now: float) -> None:
        """The prefill our parked Fetch waits for is running at the peer:
        wait on, a fetch deadline from now, but no longer than it holds our
        Fetch (``ttl_ms``) nor ``parked_ttl_s`` from the load's start."""
        load = self._loads.get(msg.job)
        fetch = load.fetch if load is not None else None
        if (
            load is None
            or load.state is not State.FETCH_POSTED
            or (load.req, load.gen) != (msg.req, msg.gen)
        ):
            self.link.counters.error("stale_fetch_wait")
            return
        if fetch is not None and not fetch.parked:
            self.link.counters.error("bad_fetch_wait")
            return
        until = min(
            self.link.timeouts.fetch_deadline(now, load.nbytes),
            now + msg.ttl_ms / 1000,
            load.started + self.link.timeouts.parked_wait_s,
            load.wait_cap,
        )
        if until > load.deadline:
            load.fire(Event.WAIT)
            self.link.arm(load, until)

    def stop_waiting(self, now: float) -> None:
        """A cache reset: a posted Fetch waits at most a fetch deadline from
        now, whatever FetchWait said or says: vLLM's drain waits for every
        load, and one held for a prefill that may never come would hold it
        up to ``parked_ttl_s``. At the deadline the load fails, its slots
        fenced until the peer answers."""
        for load in self._loads.values():
            # Every load, a Fetch still queued behind the handshake too: it
            # is posted later, and FetchWait must not hold it past this.
            cap = self.link.timeouts.fetch_deadline(now, load.nbytes)
            load.wait_cap = cap
            if load.state is State.FETCH_POSTED and load.deadline > cap:
                self.link.arm(load, cap)

    def on_fetch_offer(self, msg: FetchOffer, now: float) -> None:
        load = self._loads.get(msg.job)
        fetch = load.fetch if load is not None else None
        if (
            load is None
            or fetch is None  # kept in FETCH_POSTED for a read Fetch only
            or load.state is not State.FETCH_POSTED
            or (load.req, load.gen) != (msg.req, msg.gen)
        ):
            # For a load we gave up on (its Abort crossed this offer) or
            # never asked an offer for: the peer holds nothing past our
            # Abort or its deadline, so nothing to answer.
            self.link.counters.error("stale_fetch_offer")
            return
        region = self.link.peer_hello
        assert region is not None
        if (
            len(msg.slots) != load.blocks
            or not msg.slots
            or max(msg.slots) >= region.num_blocks
        ):
            self.link.protocol_error(
                "bad_fetch_offer",
                f"{len(msg.slots)} slots for {load.blocks} keys, or outside the "
                f"peer's {region.num_blocks} blocks",
                msg.req,
                msg.gen,
            )
            # Nothing read, and the producer offered rather than wrote: end
            # it as an abort does, through the peer's ack (the fence), but
            # counted and reported as what it was.
            load.fail_as(self.link.counters, "bad_fetch_offer")
            self._give_up(load, Event.ABORT, now)
            return
        # Counted from when our Fetch left, before the peer's hold began.
        until = load.started + msg.ttl_ms / 1000.0 * self.link.timeouts.read_window
        load.fire(Event.OFFER)  # QUEUE_READ
        load.fetch, load.read_until = None, until
        if now + load.nbytes / self.link.timeouts.fetch_bytes_per_s >= until:
            # No time left to READ it all inside the window: the load
            # recomputes, and its Release frees what the peer holds.
            if load.fire(Event.TIMEOUT) is Effect.END:
                self._end_unstarted(load, "offer_too_late", now)
            return
        if until < load.deadline:
            self.link.arm(load, until)
        self._post_read(load.job, list(fetch.slots), list(msg.slots))

    def on_read_done(self, job_id: int, ok: bool, now: float) -> None:
        """The data plane ended our READ of job ``job_id`` (exactly once)."""
        load = self._loads.get(job_id)
        if load is None or not load.is_read:
            return
        late = ok and now > load.read_until
        if late:
            ok = False  # it may have read slots the peer had already reused
        was_cancelled = load.state is State.READ_CANCELLING
        ok = load.fire(Event.TRANSFER_OK if ok else Event.TRANSFER_FAILED) is (
            Effect.SUCCEED
        )
        del self._loads[job_id]
        record = self.lookups.gens.get(load.gen)
        if record is not None:
            record.offer = None
        if record is not None and record.contacted:
            # Nothing of ours reads the pins any more: the peer may drop them.
            record.contacted = False
            # (A count, for the peer's bytes-served total, capped: a frame
            # carries at most MAX_KEYS, and a larger one would be dropped,
            # and with it the Release.)
            read = min(load.blocks, MAX_KEYS) if ok else 0
            self.link.send(Release(load.req, load.gen, read))
        self.lookups.tidy(record)
        if ok:
            self.link.counters.bytes_loaded += load.nbytes
            self._done(load.result(True, "", now))
            return
        reason = "abort" if was_cancelled else "read_late" if late else "read_failed"
        reason = load.fail_as(self.link.counters, reason)
        self._done(load.result(False, reason, now))

    def _end_unstarted(self, load: Load, reason: str, now: float) -> None:
        """A load that failed from QUEUED or READ_QUEUED: its Fetch was
        never sent, its READ never posted, so nothing can land and it ends
        now. A READ's order is forgotten and the peer may drop the pins."""
        # A READ's PostRead, if not taken yet, goes stale (see posting).
        record = self.lookups.gens.get(load.gen)
        if load.is_read and record is not None and record.contacted:
            record.contacted = False
            self.link.send(Release(load.req, load.gen, 0))
            self.lookups.tidy(record)
        del self._loads[load.job]
        reason = load.fail_as(self.link.counters, reason)
        self._done(load.result(False, reason, now))

    def on_revoke(self, msg: Revoke) -> None:
        record = self.lookups.gens.get(msg.gen)
        if record is not None:
            if record.offer is not None and record.offer.req == msg.req:
                record.offer = None
            if record.contacted:  # live: finish_gen forgets it
                record.revoked = True
        reading = any(
            ld.is_read and ld.gen == msg.gen and ld.req == msg.req
            for ld in self._loads.values()
        )
        if not reading:
            # A read in flight sends the Release when it ends.
            if record is not None:
                record.contacted = False
            self.link.send(Release(msg.req, msg.gen, 0))
        self.lookups.tidy(record)

    def finish_gen(self, gen: int, req: str, now: float) -> None:
        """vLLM finished the consumer request: mark every in-flight load and
        buffered result of ``gen``, stop its probes, and tell the peer to
        release whatever it pinned for us (fencing any write in flight)."""
        for load in self._loads.values():
            if load.gen == gen:
                load.request_finished = True
        queued = [e.result for e in self.link.queued() if isinstance(e, LoadDone)]
        for result in (*queued, *(r for r, _ in self._fenced)):
            if result.gen == gen:
                result.request_finished = True
        record = self.lookups.finish(gen)
        for job_id, load in list(self._loads.items()):
            if load.gen != gen or not load.can(Event.ABORT):
                continue
            effect = load.fire(Event.ABORT)
            if effect is Effect.END:  # was only queued: nothing to fence
                self._end_unstarted(load, "abort", now)
                continue
            if effect is Effect.STOP_READ:
                self.link.emit(Cancel(TransferRef(Direction.READ, job_id)))
            # (AWAIT_ACK: one Abort for the generation goes below.)
            # The ack comes once the transfer it fences has settled, which
            # may take as long as the transfer was given: only a peer silent
            # past that is unhealthy (and closing it fails every load).
            self.link.arm(
                load, max(load.deadline, now) + self.link.timeouts.abort_ack_s
            )
        # The peer pins hits when it answers a lookup and releases them on a
        # fetch, on our Abort or at its pin deadline. Which came first is
        # unknowable here; an Abort is cheap and always safe.
        if record is not None and record.contacted:
            record.contacted = False
            if self.link.ready:
                self.link.send(Abort(req=req, gen=gen))
        self.lookups.gens.pop(gen, None)

    def on_transfer_done(self, msg: TransferDone, now: float) -> None:
        load = self._loads.get(msg.job)
        if (
            load is None
            or load.is_read  # only our own data plane ends a READ
            or load.gen != msg.gen
            or load.req != msg.req
        ):
            self.link.counters.error("stale_transfer_done")
            return
        effect = load.fire(Event.TRANSFER_OK if msg.ok else Event.TRANSFER_FAILED)
        del self._loads[msg.job]
        if msg.ok:
            # A producer releases everything for (req, gen) once its writes
            # are done, so finishing the request needs no Abort round trip.
            # (A refusal may leave pins behind: the Abort still goes.)
            record = self.lookups.gens.get(msg.gen)
            if record is not None:
                record.contacted = False
                self.lookups.tidy(record)
            self.link.counters.loads_written += 1
        ok = effect is Effect.SUCCEED  # an aborted load fails even if whole
        if ok:
            self.link.counters.bytes_loaded += load.nbytes
            reason = ""
        elif msg.ok or load.failed_as:  # (failed_as: it timed out first)
            reason = load.fail_as(self.link.counters, "abort")
        else:
            load.fail_as(self.link.counters, "transfer_failed")
            reason = f"peer: {msg.reason}"
        self._done(load.result(ok, reason, now))

    def on_abort_ack(self, msg: AbortAck, now: float) -> None:
        acked = [
            job
            for job, load in self._loads.items()
            if load.gen == msg.gen
            and load.req == msg.req
            and load.state is State.ABORTING
        ]
        for job in acked:
            load = self._loads.pop(job)
            load.fire(Event.ABORT_ACK)
            reason = load.fail_as(self.link.counters, "abort")
            self._done(load.result(False, reason, now))
