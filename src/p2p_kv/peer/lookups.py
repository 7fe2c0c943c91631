"""What the consumer side asked the peer and what it answered, by
generation: the PROBE machines and the :class:`~p2p_kv.peer.records.Gen`
records.

A generation's record holds its probes (lookup batches in flight), the
offer its answers made (blocks the peer pinned and let us READ, and until
when), and whether the peer may hold pins for it. The consumer side's loads
read and settle those records through this index; the record goes once it
holds nothing, or when its request finishes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import compress

from p2p_kv.lifecycle import Event
from p2p_kv.peer.events import ProbeAnswer, ProbeAnswered
from p2p_kv.peer.link import Link
from p2p_kv.peer.records import Gen, Offer, Probe
from p2p_kv.protocol import Lookup, LookupResp


class Lookups:
    """The index of :class:`Gen` records, the probes in them and when their
    offers end (a heap; stale entries are skipped, as the timer heap's)."""

    def __init__(self, link: Link, *, reads: bool) -> None:
        self.link = link
        #: take the peer's READ offers (else every load is a Fetch)
        self.reads = reads
        #: the records by generation (callers read and drop them here;
        #: :meth:`open` and :meth:`tidy` make and forget them)
        self.gens: dict[int, Gen] = {}
        self._offer_heap: list[tuple[float, int]] = []
        self._seq = 0

    # -- the records -------------------------------------------------------------

    def open(self, gen: int, req: str) -> Gen:
        record = self.gens.get(gen)
        if record is None:
            record = self.gens[gen] = Gen(req, gen)
        return record

    def tidy(self, record: Gen | None) -> None:
        """Forget a generation's record once it holds nothing."""
        if record is not None and record.empty:
            self.gens.pop(record.gen, None)

    def clear(self) -> None:
        self.gens.clear()
        self._offer_heap.clear()

    def __len__(self) -> int:
        return len(self.gens)

    def offer(
        self,
        record: Gen,
        keys: Iterable[bytes],
        slots: Iterable[int],
        until: float,
        now: float,
    ) -> None:
        """The peer pinned ``keys`` in its ``slots`` for ``record`` and let
        us READ them until ``until``: every answer re-arms all of the
        generation's pins. An offer past its window (not purged yet: no
        tick since) may name pins the peer let go: an answer then comes from
        a new serve, which pinned only its own keys, so the offer starts
        over. Within the window the serve that answered holds them all."""
        offer = record.offer
        if offer is None or offer.valid_until <= now:
            offer = record.offer = Offer(record.req, until)
        offer.valid_until = max(offer.valid_until, until)
        heapq.heappush(self._offer_heap, (offer.valid_until, record.gen))
        offer.slots.update(zip(keys, slots, strict=True))

    def expire_offers(self, now: float) -> None:
        """Offers past their window go: a load then takes the Fetch path."""
        heap = self._offer_heap
        while heap and heap[0][0] <= now:
            until, gen = heapq.heappop(heap)
            record = self.gens.get(gen)
            if record is not None and record.offer_until == until:
                record.offer = None
                self.tidy(record)

    def next_offer_deadline(self) -> float:
        heap, gens = self._offer_heap, self.gens
        while heap and (
            (record := gens.get(heap[0][1])) is None or record.offer_until != heap[0][0]
        ):
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    # -- the PROBE machines --------------------------------------------------------

    def _answered(self, answer: ProbeAnswer) -> None:
        self.link.emit(ProbeAnswered(answer))

    def send(self, req: str, gen: int, keys: list[bytes], now: float) -> None:
        """Ask the peer about ``keys``; the answer comes as ProbeAnswered."""
        if self.link.closed:
            self._answered(ProbeAnswer(gen, keys, None))
            return
        self._seq += 1
        probe = Probe(req, gen, self._seq, keys, now, self.link.timeouts.lookup_s)
        self.link.arm(probe, probe.deadline)
        record = self.open(gen, req)
        record.probes[probe.seq] = probe
        if self.link.ready:
            self._send(record, probe)

    def _send(self, record: Gen, probe: Probe) -> None:
        probe.sent = True
        self.link.counters.lookups += 1
        record.contacted = True
        self.link.send(
            Lookup(req=probe.req, gen=probe.gen, seq=probe.seq, keys=probe.keys)
        )

    def flush(self) -> None:
        """The link became ready: probes that waited for it leave now."""
        for record in self.gens.values():
            for probe in record.probes.values():
                if not probe.sent:
                    self._send(record, probe)

    def on_lookup_resp(self, msg: LookupResp, now: float) -> None:
        record = self.gens.get(msg.gen)
        probe = record.probes.get(msg.seq) if record is not None else None
        if record is None or probe is None or probe.req != msg.req:
            # A reply to a probe we gave up on, or to an earlier use of the
            # id: count it, change nothing.
            self.link.counters.error("stale_lookup_resp")
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
        self.tidy(record)
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
            self.link.counters.error("offer_out_of_range")
            return
        until = probe.created + msg.ttl_ms / 1000.0 * self.link.timeouts.read_window
        self.offer(record, compress(probe.keys, msg.hits), hit_slots, until, now)

    def expire(self, probe: Probe) -> None:
        """A probe's deadline passed: its keys count as misses."""
        record = self.open(probe.gen, probe.req)
        del record.probes[probe.seq]
        self.tidy(record)
        probe.fire(Event.TIMEOUT)
        self.link.counters.failed("lookup_timeout")
        self._answered(ProbeAnswer(probe.gen, probe.keys, None))

    def finish(self, gen: int) -> Gen | None:
        """The request of ``gen`` finished: its probes stop, its offer and
        revocation go; the record is returned for its loads' last word."""
        record = self.gens.get(gen)
        if record is not None:
            for probe in record.probes.values():
                probe.fire(Event.FINISH)
            record.probes.clear()
            record.offer, record.revoked = None, False
        return record

    def lose(self) -> None:
        """The link ended: every probe is unanswered, every record goes."""
        for record in self.gens.values():
            for probe in record.probes.values():
                probe.fire(Event.PEER_LOST)
                self._answered(ProbeAnswer(probe.gen, probe.keys, None))
        self.clear()

    def sizes(self) -> dict[str, int]:
        gens = self.gens.values()
        return {
            "generations": len(self.gens),
            "probes": sum(len(g.probes) for g in gens),
            "offers": sum(g.offer is not None for g in gens),
            "revoked": sum(g.revoked for g in gens),
        }

    @property
    def active(self) -> bool:
        return any(g.probes or g.offer for g in self.gens.values())
