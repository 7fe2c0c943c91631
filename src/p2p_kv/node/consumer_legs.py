"""The consumer side of the manager: asking a peer for keys, and loading.

A request's consumer leg names one peer (``remote_kv_source``: ask first;
``remote_prefiller``: every block is there). :class:`Loads` answers vLLM's
per-block lookups from what the peer said, gathers the keys to ask into one
Lookup per request and step, and turns a load job into one Fetch. It holds
no state of its own: the records are the :class:`~p2p_kv.node.requests.RequestTable`'s,
the jobs the :class:`~p2p_kv.node.requests.JobTable`'s, the sessions the
:class:`~p2p_kv.node.sessions.Peers`'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

from p2p_kv.node.membership import Membership
from p2p_kv.node.requests import Consumer, JobTable, RequestTable
from p2p_kv.node.sessions import Peers
from p2p_kv.node.settings import NodeSettings
from p2p_kv.peer import Session
from p2p_kv.peer.records import LoadResult
from p2p_kv.protocol import MAX_KEYS


class Answer(Enum):
    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


class Loads:
    """Lookups and loads of the live requests' consumer legs."""

    def __init__(
        self,
        settings: NodeSettings,
        requests: RequestTable,
        jobs: JobTable,
        peers: Peers,
        touch: Callable[[Session], None],
        membership: Membership,
    ) -> None:
        self._settings = settings
        self._requests = requests
        self._jobs = jobs
        self._peers = peers
        self._touch = touch
        self._membership = membership

    def start(self, req_id: str, now: float) -> None:
        """A request with a consumer leg began: dial its peer now, so the
        session is up by the time its lookups leave."""
        consumer = self._requests.consumer(req_id)
        if consumer is None:
            return
        peer = consumer.source.peer
        if self._peers.session_for(peer, now, self._requests.named_peers) is None:
            consumer.refused = self._peers.refused_dial(peer, now)

    def lookup(self, req_id: str, key: bytes) -> Answer:
        # vLLM calls this once per block, twice per block for a remote hit
        # (RETRY, then the answer): the common case, an answered key of a
        # live request, is tested first and costs a few dict reads. It takes
        # no time: nothing here has a deadline (the lookups leave at flush).
        req = self._requests.by_id.get(req_id)
        consumer = req.consumer if req is not None else None
        if req is None or consumer is None or req.failed:
            return Answer.MISS
        session = self._peers.sessions.get(consumer.source.peer)
        if session is None and consumer.refused:
            return Answer.MISS
        if session is not None and session.link.closed:
            return Answer.MISS
        if consumer.fetched:
            # One fetch per generation: the peer released its pins with it
            # (a prefiller's blocks were all loaded by it).
            return Answer.MISS
        if not consumer.source.probe:
            return Answer.HIT if session is not None else Answer.MISS
        # No session (one lost since the request began): the key is asked
        # all the same, and flush dials again (or, in the reconnect backoff
        # or past max_peers, answers it a miss). Answered MISS here, the
        # request would never ask again, and lose its remote hits for good.
        known = consumer.keys.get(key)
        if known is not None:
            return Answer.HIT if known else Answer.MISS
        if key not in consumer.asked:
            consumer.asked.add(key)
            consumer.unsent.append(key)
            self._requests.unsent.add(req_id)
        return Answer.RETRY

    def flush(self, now: float) -> None:
        """Send the lookups gathered this step, one message per request."""
        for req_id in self._requests.unsent:
            consumer = self._requests.consumer(req_id)
            if consumer is None or not consumer.unsent:
                continue
            keys, consumer.unsent = consumer.unsent, []
            peer = consumer.source.peer
            if peer not in self._peers.sessions and not self._membership.admits(peer):
                # Its session lost, and its peer left the fleet since the
                # request began: not dialled again; it misses from now on.
                self._membership.refuse(peer)
                consumer.refused = True
                consumer.keys.update(dict.fromkeys(keys, False))
                consumer.asked.difference_update(keys)
                continue
            session = self._peers.session_for(peer, now, self._requests.named_peers)
            if session is None:
                # Refused for max_peers, the request is counted once and
                # misses from now on, not dialled (and counted) each batch.
                consumer.refused = self._peers.refused_dial(peer, now)
                consumer.keys.update(dict.fromkeys(keys, False))
                consumer.asked.difference_update(keys)
                continue
            # A peer refuses a Lookup of more keys than a frame may list
            # (a 1M-token prompt in 16-token chunks): several, then.
            for i in range(0, len(keys), MAX_KEYS):
                batch = keys[i : i + MAX_KEYS]
                session.send_lookup(consumer.source.kv_id, consumer.gen, batch, now)
            self._touch(session)
        self._requests.unsent.clear()

    def submit_load(
        self,
        job_id: int,
        req_id: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        now: float,
    ) -> None:
        consumer = self._requests.consumer(req_id)
        job = self._jobs.register(job_id, "load", req_id)
        job.submitted = now
        if consumer is not None:
            job.peer, job.gen = consumer.source.peer, consumer.gen
            job.kv_id = consumer.source.kv_id
        if not keys:
            self._jobs.results.append(LoadResult(job_id, -1, True))
            return
        if consumer is None:
            self._jobs.results.append(
                LoadResult(job_id, -1, False, "unknown_request", request_finished=True)
            )
            return
        if consumer.fetched:
            # One load per generation: the first one's READ or WRITE ends by
            # releasing every pin the peer holds for it, so a second job
            # could only read slots that are no longer ours to trust.
            self._jobs.results.append(
                LoadResult(job_id, consumer.gen, False, "second_load")
            )
            return
        self.fetch(job_id, consumer, keys, slots, now)

    def fetch(
        self,
        job_id: int,
        consumer: Consumer,
        keys: Sequence[bytes],
        slots: Sequence[int],
        now: float,
    ) -> None:
        """Load ``keys`` of a registered job from the leg's peer: a READ of
        what its lookup offered, or a Fetch."""
        session = self._peers.sessions.get(consumer.source.peer)
        if session is None or session.link.closed:
            self._jobs.results.append(
                LoadResult(job_id, consumer.gen, False, "peer_down")
            )
            return
        consumer.fetched = True
        session.consumer.send_fetch(
            job_id,
            consumer.source.kv_id,
            consumer.gen,
            list(keys),
            list(slots),
            self._settings.me.block_bytes,
            now,
            parked=not consumer.source.probe,
        )
        self._touch(session)
