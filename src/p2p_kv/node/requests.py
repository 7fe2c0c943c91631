"""The manager's engine requests and jobs: one record each, and their indexes.

A :class:`Request` is everything the manager keeps for one live engine
request with a p2p leg; :class:`RequestTable` indexes the records (by id,
by consumer generation, with lookups to flush), so popping a record takes it out of every index at once. A
:class:`Job` is a submitted job until its one result is handed back:
jobs outlive their request (a finished request's load still settles), so
they live in a :class:`JobTable` of their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from p2p_kv.node.indexes import residue_of
from p2p_kv.node.roles import Source
from p2p_kv.node.tallies import LoadObservation, Tallies
from p2p_kv.peer import is_inbound, tally
from p2p_kv.peer.records import LoadResult, StoreResult


@dataclass(slots=True)
class JobResult:
    """Engine-neutral twin of vLLM's JobResult."""

    job_id: int
    success: bool
    transfer_time: float | None = None
    transfer_bytes: int | None = None
    #: why a load failed (the fallback reason); empty on success
    reason: str = ""
    #: a load's engine request, its ``kv_request_id`` and the peer: what
    #: an operator greps for when a request recomputed
    req_id: str = ""
    kv_id: str = ""
    peer: str = ""


@dataclass(slots=True, eq=False)
class Consumer:
    """A request's consumer leg: what it asked its source and loaded."""

    source: Source
    gen: int
    #: answered keys: True (hit) / False (miss)
    keys: dict[bytes, bool] = field(default_factory=dict)
    #: keys asked and not answered yet (each key is here or in ``keys``,
    #: never both): the engine's idle check reads its size every step
    asked: set[bytes] = field(default_factory=set)
    unsent: list[bytes] = field(default_factory=list)
    fetched: bool = False
    #: its peer was past ``max_peers`` when it began: it recomputes (asked
    #: again, it would only be refused again)
    refused: bool = False
    #: a leg the directory found (the request named no source): its load
    #: job, keys and slots, from submit_load until the job's result, so a
    #: load the member could not serve moves to another holder
    found: tuple[int, list[bytes], list[int]] | None = None


@dataclass(slots=True, eq=False)
class Request:
    """One live engine request with a p2p leg: finishing it is popping it
    from :class:`RequestTable` and ending its legs
    (:meth:`p2p_kv.node.manager.LoadManager._finish`)."""

    req_id: str
    #: consumer leg: loads from a peer (None: it loads nothing)
    consumer: Consumer | None = None
    #: producer leg: the ``kv_request_id`` its stores are parked under for
    #: a decoder (None: its stores succeed at once, parking nothing)
    dest_kv_id: str | None = None
    #: a load of it failed: it must recompute, so lookups answer MISS
    failed: bool = False


class RequestTable:
    """The live requests' records and the indexes the hot paths read."""

    def __init__(self) -> None:
        self._gens = itertools.count(1)
        self.by_id: dict[str, Request] = {}
        #: consumer legs by generation: what probe answers and load
        #: results name
        self.by_gen: dict[int, Request] = {}
        #: ids of requests with lookups to flush
        self.unsent: set[str] = set()

    def add(self, req_id: str, source: Source | None, dest: str | None) -> Request:
        req = self.by_id[req_id] = Request(req_id, dest_kv_id=dest)
        if source is not None:
            req.consumer = Consumer(source, next(self._gens))
            self.by_gen[req.consumer.gen] = req
        return req

    def pop(self, req_id: str) -> Request | None:
        """Take a request out of every index; its legs are the caller's to
        end."""
        req = self.by_id.pop(req_id, None)
        if req is not None and req.consumer is not None:
            self.unsent.discard(req_id)
            del self.by_gen[req.consumer.gen]
        return req

    def consumer(self, req_id: str) -> Consumer | None:
        req = self.by_id.get(req_id)
        return req.consumer if req is not None else None

    def forget_hits_through(self, peer: str) -> None:
        """The hits a session answered died with it: the peer pinned them
        for that session, so a load of them through the next one is
        refused (``not pinned``) and recomputes. Asked again instead, as
        keys never asked are. (Misses stay misses.) Runs once a dialled
        session ends, over the live consumer legs (an engine's batch, not
        a peer's choosing: no leg names an inbound session, whose end
        reads nothing)."""
        if is_inbound(peer):
            return
        for req in self.by_gen.values():
            consumer = req.consumer
            if consumer is None or consumer.fetched or consumer.source.peer != peer:
                continue
            if consumer.source.probe and any(consumer.keys.values()):
                consumer.keys = {k: hit for k, hit in consumer.keys.items() if not hit}

    def named_peers(self) -> set[str]:
        """The peers live consumer legs name (a dial for room closes none
        of theirs). Read only when ``max_peers`` is reached, so no index
        is kept for it."""
        return {
            r.consumer.source.peer
            for r in self.by_gen.values()
            if r.consumer is not None
        }

    def waiting(self, jobs: JobTable) -> int:
        """Live consumer requests blocked on us (an unanswered lookup or a
        load in flight). A finished request's load may still be settling
        (its abort, its fence): it blocks nobody, and its id may already
        name a new request that computes."""
        by_gen = self.by_gen
        waiting = {
            j.req_id
            for j in jobs.jobs.values()
            if j.kind == "load"
            and (r := by_gen.get(j.gen)) is not None
            and r.req_id == j.req_id
        }
        waiting.update(
            r.req_id
            for r in by_gen.values()
            if r.consumer is not None and (r.consumer.unsent or r.consumer.asked)
        )
        return len(waiting)

    def failed_ids(self) -> frozenset[str]:
        return frozenset(r.req_id for r in self.by_id.values() if r.failed)

    def residue(self) -> dict[str, int]:
        report = residue_of(self, "requests_")
        report["failed_ids"] = sum(r.failed for r in self.by_id.values())
        return report


@dataclass(slots=True, eq=False)
class Job:
    """A submitted job, until its one result is handed to the engine."""

    kind: str  # "load" | "store" | "pin"
    req_id: str
    peer: str = ""  # load jobs: the source peer
    submitted: float = 0.0
    gen: int = -1  # load jobs: the request's generation when submitted
    kv_id: str = ""  # load jobs: the leg's kv_request_id
    #: load jobs: what they load, once loaded part of our primary tier (the
    #: directory tells subscribers; empty without a ``peers`` key)
    keys: list[bytes] = field(default_factory=list)


class JobTable:
    """Jobs by id, and the results buffered for the engine's next poll."""

    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self.results: list[LoadResult | StoreResult] = []

    def register(self, job_id: int, kind: str, req_id: str) -> Job:
        if job_id in self.jobs:
            raise ValueError(f"job {job_id} submitted twice")
        job = self.jobs[job_id] = Job(kind, req_id)
        return job

    def request_finished(self, gen: int) -> None:
        """Mark the buffered results of generation ``gen`` as belonging to
        a finished request: their failure must never fail its id."""
        for result in self.results:
            if isinstance(result, LoadResult) and result.gen == gen:
                result.request_finished = True

    def hand_back(
        self, now: float, by_gen: Mapping[int, Request], tallies: Tallies
    ) -> list[JobResult]:
        """Every buffered result, each with its job (then forgotten), for
        the engine. A failed load of a live request's generation fails the
        request: it recomputes (never one already finished)."""
        out: list[JobResult] = []
        for result in self.results:
            job = self.jobs.pop(result.job_id, None)
            if job is None:
                tallies.double_results += 1
                continue
            if not isinstance(result, LoadResult):
                out.append(JobResult(result.job_id, result.success))
                continue
            if not result.success:
                tally(tallies.fallbacks, result.reason, "other")
                req = by_gen.get(result.gen)
                if (
                    not result.request_finished
                    and req is not None
                    and job.req_id == req.req_id
                ):
                    req.failed = True
            tallies.load_observations.append(
                LoadObservation(
                    job.peer,
                    result.success,
                    result.elapsed_s,
                    result.nbytes,
                    result.reason,
                    max(0.0, now - job.submitted),
                )
            )
            out.append(
                JobResult(
                    result.job_id,
                    result.success,
                    result.elapsed_s if result.success else None,
                    result.nbytes if result.success else None,
                    result.reason,
                    job.req_id,
                    job.kv_id,
                    job.peer,
                )
            )
        self.results.clear()
        return out

    def in_flight(self) -> int:
        return len(self.jobs) + len(self.results)

    def loads_in_flight(self) -> int:
        """Load jobs submitted and not yet handed back."""
        return sum(1 for job in self.jobs.values() if job.kind == "load")

    def unended(self) -> int:
        """Jobs with no result yet (a buffered result has ended)."""
        ended = {r.job_id for r in self.results}
        return sum(1 for job_id in self.jobs if job_id not in ended)

    def residue(self) -> dict[str, int]:
        return residue_of(self)
