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

import heapq
from itertools import compress

from p2p_kv.lifecycle import Effect, Event, State
from p2p_kv.peer.events import (
    Cancel,
    Direction,
    LoadDone,
    LoadResult,
    PostRead,
    ProbeAnswer,
    ProbeAnswered,
    TransferRef,
)
from p2p_kv.peer.link import Link
from p2p_kv.peer.records import Gen, Load, Offer, Probe
from p2p_kv.protocol import (
    MAX_KEYS,
    Abort,
    AbortAck,
    Fetch,
    FetchOffer,
    FetchWait,
    Lookup,
    LookupResp,
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
        #: one record per live generation (engine request) asking this peer
        self._gens: dict[int, Gen] = {}
        self._probe_seq = 0
        #: load jobs by job id (a finished generation's may still settle)
        self._loads: dict[int, Load] = {}
        #: results of loads a write may still land in, with their slot
        #: counts: out once the peer's agent is invalidated
        self._fenced: list[tuple[LoadResult, int]] = []
        #: (valid until, gen) of every offer, stale entries skipped
        self._offer_heap: list[tuple[float, int]] = []

    def _gen(self, gen: int, req: str) -> Gen:
        record = self._gens.get(gen)
        if record is None:
            record = self._gens[gen] = Gen(req, gen)
        return record

    def _tidy(self, record: Gen | None) -> None:
        """Forget a generation's record once it holds nothing."""
        if record is not None and record.empty:
            self._gens.pop(record.gen, None)

    # -- outputs ---------------------------------------------------------------

    def _done(self, result: LoadResult) -> None:
        self.link.emit(LoadDone(result))

    def _answered(self, answer: ProbeAnswer) -> None:
        self.link.emit(ProbeAnswered(answer))

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
        for record in self._gens.values():
            for probe in record.probes.values():
                if not probe.sent:
                    self._send_probe(record, probe)
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
        for record in self._gens.values():
            for probe in record.probes.values():
                probe.fire(Event.PEER_LOST)
                self._answered(ProbeAnswer(probe.gen, probe.keys, None))
        self._gens.clear()
        for load in self._loads.values():
            effect = load.fire(Event.PEER_LOST)
            why = self._count_failure(load, kind)
            result = self._result(load, False, why, load.started)
            match effect:
                case Effect.FENCE:
                    self._fenced.append((result, load.blocks))
                case Effect.END:
                    self._done(result)
        self._loads.clear()
        self._offer_heap.clear()

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
            record = self._gens[item.gen]
            del record.probes[item.seq]
            self._tidy(record)
            item.fire(Event.TIMEOUT)
            self.link.counters.bump(self.link.counters.failures, "lookup_timeout")
            self._answered(ProbeAnswer(item.gen, item.keys, None))
            return True
        effect = item.fire(Event.TIMEOUT)
        if effect is not Effect.LOSE_SESSION:
            self._count_failure(item, "timeout")
        match effect:
            case Effect.LOSE_SESSION:
                return False
            case Effect.END:  # was only queued
                self._end_unstarted(item, "timeout", now)
            case Effect.STOP_READ:
                self.link.arm(item, now + self.link.timeouts.abort_ack_s)
                self.link.emit(Cancel(TransferRef(Direction.READ, item.job)))
            case Effect.AWAIT_ACK:
                self.link.arm(item, now + self.link.timeouts.abort_ack_s)
                self.link.send(Abort(item.req, item.gen))
        return True

    def expire_offers(self, now: float) -> None:
        """Offers past their window go: a load then takes the Fetch path."""
        offers = self._offer_heap
        while offers and offers[0][0] <= now:
            until, gen = heapq.heappop(offers)
            record = self._gens.get(gen)
            if record is not None and record.offer_until == until:
                record.offer = None
                self._tidy(record)

    def next_offer_deadline(self) -> float:
        offers = self._offer_heap
        gens = self._gens
        while offers and (
            (record := gens.get(offers[0][1])) is None
            or record.offer_until != offers[0][0]
        ):
            heapq.heappop(offers)
        return offers[0][0] if offers else float("inf")

    # -- introspection -----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._gens) + len(self._loads)

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
        return bool(self._loads or self._fenced) or any(
            g.probes or g.offer for g in self._gens.values()
        )

    def sizes(self) -> dict[str, int]:
        return {
            "generations": len(self._gens),
            "probes": sum(len(g.probes) for g in self._gens.values()),
            "loads": len(self._loads),
            "fenced_results": len(self._fenced),
            "offers": sum(g.offer is not None for g in self._gens.values()),
            "revoked": sum(g.revoked for g in self._gens.values()),
        }

    # -- requests and the peer's answers -------------------------------------------

    def send_lookup(self, req: str, gen: int, keys: list[bytes], now: float) -> None:
        """Ask the peer about ``keys``; the answer arrives as a ProbeAnswer."""
        if self.link.closed:
            self._answered(ProbeAnswer(gen, keys, None))
            return
        self._probe_seq += 1
        probe = Probe(req, gen, self._probe_seq, keys, now, self.link.timeouts.lookup_s)
        self.link.arm(probe, probe.deadline)
        record = self._gen(gen, req)
        record.probes[probe.seq] = probe
        if self.link.ready:
            self._send_probe(record, probe)

    def _send_probe(self, record: Gen, probe: Probe) -> None:
        probe.sent = True
        self.link.counters.lookups += 1
        record.contacted = True
        self.link.send(
            Lookup(req=probe.req, gen=probe.gen, seq=probe.seq, keys=probe.keys)
        )

    def on_lookup_resp(self, msg: LookupResp, now: float) -> None:
        record = self._gens.get(msg.gen)
        probe = record.probes.get(msg.seq) if record is not None else None
        if record is None or probe is None or probe.req != msg.req:
            # A reply to a probe we gave up on, or to an earlier use of the
            # id: count it, change nothing.
            self.link.counters.bump(
                self.link.counters.protocol_errors, "stale_lookup_resp"
            )
            return
        # (``decode`` already checked that ``slots`` is empty or parallel.)
        n = len(probe.keys)
        if len(msg.hits) != n:
            self.link.protocol_error(
                "bad_lookup_resp",
                f"{len(msg.hits)} answers for {n} keys",
                msg.req,
                msg.gen,
            )
            return
        probe.fire(Event.LOOKUP_RESP)
        del record.probes[msg.seq]
        if msg.slots and msg.ttl_ms and self.reads:
            self._take_offer(record, probe, msg, now)
        self._tidy(record)
        nhit = sum(msg.hits)
        self.link.counters.hits += nhit
        self.link.counters.misses += n - nhit
        self._answered(ProbeAnswer(msg.gen, probe.keys, msg.hits))

    def _take_offer(
        self, record: Gen, probe: Probe, msg: LookupResp, now: float
    ) -> None:
        if not record.contacted:
            # We already released (or gave up) what the peer holds for this
            # generation: a late answer's pins may go any moment.
            return
        region = self.link.peer_hello
        assert region is not None
        # Per-key work in C (compress, max, dict.update): a 256-key answer
        # is on the request's critical path.
        hit_slots = list(compress(msg.slots, msg.hits))
        if hit_slots and max(hit_slots) >= region.num_blocks:
            # Never read outside the region the peer registered: the Fetch
            # path (which the peer range-checks itself) still works.
            self.link.counters.bump(
                self.link.counters.protocol_errors, "offer_out_of_range"
            )
            return
        until = probe.created + msg.ttl_ms / 1000.0 * self.link.timeouts.read_window
        offer = record.offer
        if offer is None or offer.valid_until <= now:
            # An offer past its window (not purged yet: no tick since) may
            # name pins the peer let go: this answer came from a new serve,
            # which pinned only its own keys. Within the window the serve
            # that answered is the one that holds them all.
            offer = record.offer = Offer(probe.req, until)
        # Every lookup answer re-arms all of the generation's pins.
        offer.valid_until = max(offer.valid_until, until)
        heapq.heappush(self._offer_heap, (offer.valid_until, probe.gen))
        offer.slots.update(zip(compress(probe.keys, msg.hits), hit_slots, strict=True))

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
            self._done(
                LoadResult(job_id, gen, False, "peer_down", request_finished=False)
            )
            return
        if slots and max(slots) >= self.link.me.num_blocks:
            # Our own caller's mistake: refuse before any message or READ.
            self.link.counters.bump(self.link.counters.failures, "slot_out_of_range")
            self._done(LoadResult(job_id, gen, False, "slot_out_of_range"))
            return
        record = self._gen(gen, req)
        if record.revoked:
            self.link.counters.bump(self.link.counters.failures, "revoked")
            self._done(LoadResult(job_id, gen, False, "revoked"))
            return
        deadline = self.link.timeouts.fetch_deadline(now, nbytes)
        record.contacted = True
        offer, record.offer = record.offer, None
        fetch: Fetch | None = None
        if (
            offer is not None
            # Time to READ it all inside the trust window, at the rate the
            # deadlines assume (a READ chosen at the window's end failed,
            # where a Fetch, the pins still held, would load).
            and now + nbytes / self.link.timeouts.fetch_bytes_per_s < offer.valid_until
            and all(map(offer.slots.__contains__, keys))
        ):
            deadline = min(deadline, offer.valid_until)
            initial, read_until = State.READ_QUEUED, offer.valid_until
            self.link.counters.loads_read += 1
        else:
            if len(keys) > MAX_KEYS or len(set(keys)) != len(keys):
                # A Fetch asks for each block once, at most MAX_KEYS of them
                # (a peer refuses the frame): recompute now, not at the
                # deadline.
                self.link.counters.bump(self.link.counters.failures, "unsendable_keys")
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
            self.link.counters.bump(
                self.link.counters.protocol_errors, "stale_fetch_wait"
            )
            return
        if fetch is not None and not fetch.parked:
            self.link.counters.bump(
                self.link.counters.protocol_errors, "bad_fetch_wait"
            )
            return
        until = min(
            self.link.timeouts.fetch_deadline(now, load.nbytes),
            now + msg.ttl_ms / 1000,
            load.started + self.link.timeouts.parked_wait_s,
        )
        if until > load.deadline:
            load.fire(Event.WAIT)
            self.link.arm(load, until)

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
            self.link.counters.bump(
                self.link.counters.protocol_errors, "stale_fetch_offer"
            )
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
            self._count_failure(load, "bad_fetch_offer")
            load.fire(Event.ABORT)
            self.link.arm(load, now + self.link.timeouts.abort_ack_s)
            self.link.send(Abort(load.req, load.gen))
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
        record = self._gens.get(load.gen)
        if record is not None:
            record.offer = None
        if record is not None and record.contacted:
            # Nothing of ours reads the pins any more: the peer may drop them.
            record.contacted = False
            # (A count, for the peer's bytes-served total: a frame carries
            # at most MAX_KEYS; a larger one was dropped, and with it the
            # Release, so the pins stayed to their deadline.)
            read = min(load.blocks, MAX_KEYS) if ok else 0
            self.link.send(Release(load.req, load.gen, read))
        self._tidy(record)
        if ok:
            self.link.counters.bytes_loaded += load.nbytes
            self._done(self._result(load, True, "", now))
            return
        reason = "abort" if was_cancelled else "read_late" if late else "read_failed"
        reason = self._count_failure(load, reason)
        self._done(self._result(load, False, reason, now))

    def _end_unstarted(self, load: Load, reason: str, now: float) -> None:
        """A load that failed from QUEUED or READ_QUEUED: its Fetch was
        never sent, its READ never posted, so nothing can land and it ends
        now. A READ's order is forgotten and the peer may drop the pins."""
        # A READ's PostRead, if not taken yet, goes stale (see posting).
        record = self._gens.get(load.gen)
        if load.is_read and record is not None and record.contacted:
            record.contacted = False
            self.link.send(Release(load.req, load.gen, 0))
            self._tidy(record)
        del self._loads[load.job]
        reason = self._count_failure(load, reason)
        self._done(self._result(load, False, reason, now))

    def _count_failure(self, load: Load, reason: str) -> str:
        """Count ``load``'s failure once, under the first reason it failed
        for, and return that reason (the one its result carries)."""
        if not load.failed_as:
            load.failed_as = reason
            self.link.counters.bump(self.link.counters.failures, reason)
        return load.failed_as

    def on_revoke(self, msg: Revoke) -> None:
        record = self._gens.get(msg.gen)
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
        self._tidy(record)

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
        record = self._gens.get(gen)
        if record is not None:
            for probe in record.probes.values():
                probe.fire(Event.FINISH)
            record.probes.clear()
            record.offer, record.revoked = None, False
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
        self._gens.pop(gen, None)

    def on_transfer_done(self, msg: TransferDone, now: float) -> None:
        load = self._loads.get(msg.job)
        if (
            load is None
            or load.is_read  # only our own data plane ends a READ
            or load.gen != msg.gen
            or load.req != msg.req
        ):
            self.link.counters.bump(
                self.link.counters.protocol_errors, "stale_transfer_done"
            )
            return
        effect = load.fire(Event.TRANSFER_OK if msg.ok else Event.TRANSFER_FAILED)
        del self._loads[msg.job]
        if msg.ok:
            # A producer releases everything for (req, gen) once its writes
            # are done, so finishing the request needs no Abort round trip.
            # (A refusal may leave pins behind: the Abort still goes.)
            record = self._gens.get(msg.gen)
            if record is not None:
                record.contacted = False
                self._tidy(record)
            self.link.counters.loads_written += 1
        ok = effect is Effect.SUCCEED  # an aborted load fails even if whole
        if ok:
            self.link.counters.bytes_loaded += load.nbytes
            reason = ""
        elif msg.ok or load.failed_as:  # (failed_as: it timed out first)
            reason = self._count_failure(load, "abort")
        else:
            self._count_failure(load, "transfer_failed")
            reason = f"peer: {msg.reason}"
        self._done(self._result(load, ok, reason, now))

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
            reason = self._count_failure(load, "abort")
            self._done(self._result(load, False, reason, now))

    def _result(self, load: Load, ok: bool, reason: str, now: float) -> LoadResult:
        return LoadResult(
            job_id=load.job,
            gen=load.gen,
            success=ok,
            reason=reason,
            nbytes=load.nbytes if ok else 0,
            elapsed_s=max(0.0, now - load.started),
            request_finished=load.request_finished,
        )
