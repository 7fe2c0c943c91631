"""Prometheus metrics of the p2p tier, exported the way vLLM exports its own.

vLLM's tiering connector asks every secondary tier for metric definitions
(``build_metric_definitions``, a classmethod read by the Prometheus logger
when it starts) and, at every scheduler step, for the observations since the
last call (``get_stats``, an ``OffloadingConnectorStats``). The adapter turns
:data:`DEFINITIONS` into vLLM's metadata and hands a fresh stats object to
:meth:`MetricsExporter.collect`; nothing here imports vLLM.

Counters are sent as increments: the exporter remembers what it last saw of
every session's :class:`~p2p_kv.peer.SessionCounters` (and of the
sessions the manager retired since) and sends the difference. Gauges are
sent when they change; a label series that disappears (a peer gone) is set
to zero once, since vLLM never removes a series. Load outcomes come from
:attr:`~p2p_kv.node.manager.LoadManager.load_observations`.

Label cardinality: ``peer`` is the address we dial (outbound) or, for an
inbound session, the peer's Hello ``engine_id`` up to its first ``/`` (the
address it is dialled at, so both directions of one peer share a label and
a restarted peer keeps it); before a Hello it is ``unknown``. At most
``max_peers`` distinct peers get their own label, later ones are ``other``;
reasons are cut at their first ``": "`` (details are free text) and capped
the same way per metric; the codes a peer names (its ``Error`` frames,
``peer:<code>``, which anyone may send before a handshake) have their own
budget of half as many, so they cannot take the labels of our own reasons.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from p2p_kv.node.manager import LoadManager
from p2p_kv.peer import PEER_REASON, Session, SessionCounters, is_inbound

PREFIX = "vllm:kv_offload_p2p_"

LOOKUPS = PREFIX + "lookups"
LOOKUP_HITS = PREFIX + "lookup_hit_blocks"
LOOKUP_MISSES = PREFIX + "lookup_miss_blocks"
LOADED_BYTES = PREFIX + "loaded_bytes"
SERVED_BYTES = PREFIX + "served_bytes"
LOADS_READ = PREFIX + "loads_read"
LOADS_FETCHED = PREFIX + "loads_fetched"
LOADS_WRITTEN = PREFIX + "loads_written"
SAME_HOST_READS = PREFIX + "same_host_reads"
LOAD_TIME = PREFIX + "load_time_seconds"
FALLBACKS = PREFIX + "fallbacks"
FALLBACK_TIME = PREFIX + "fallback_time_seconds"
FAILURES = PREFIX + "failures"
REFUSALS = PREFIX + "refusals"
PROTOCOL_ERRORS = PREFIX + "protocol_errors"
DIAL_FAILURES = PREFIX + "dial_failures"
LIVE_REQUESTS = PREFIX + "live_requests"
FAILED_IDS = PREFIX + "failed_ids"
FENCED_SLOTS = PREFIX + "fenced_slots"
STAGING_HELD = PREFIX + "read_staging_held_blocks"
PARKED_STORES = PREFIX + "parked_stores"
REQUEST_STATE = PREFIX + "request_state"
SESSIONS = PREFIX + "sessions"

UNKNOWN = "unknown"
OTHER = "other"
#: Characters of a peer label: an address a client named (or an engine id)
#: of any length is cut to this.
MAX_PEER_LABEL = 128

TIME_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricDef:
    kind: Kind
    documentation: str
    labelnames: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


_PEER = ("peer",)
_PEER_REASON = ("peer", "reason")

DEFINITIONS: dict[str, MetricDef] = {
    LOOKUPS: MetricDef("counter", "Lookup batches sent to a peer.", _PEER),
    LOOKUP_HITS: MetricDef(
        "counter", "Blocks a peer said it holds, in lookup answers.", _PEER
    ),
    LOOKUP_MISSES: MetricDef(
        "counter", "Blocks a peer said it lacks, in lookup answers.", _PEER
    ),
    LOADED_BYTES: MetricDef("counter", "Bytes loaded from a peer.", _PEER),
    SERVED_BYTES: MetricDef(
        "counter", "Bytes a peer loaded from us (WRITE or its READ).", _PEER
    ),
    LOADS_READ: MetricDef(
        "counter",
        "Load jobs started as a one-sided READ of a peer's pins (counted when "
        "submitted; how they ended is in load_time_seconds and fallbacks).",
        _PEER,
    ),
    LOADS_FETCHED: MetricDef(
        "counter",
        "Load jobs started by a Fetch (the peer offers its blocks for READ, "
        "or WRITEs them; counted when submitted, like loads_read).",
        _PEER,
    ),
    LOADS_WRITTEN: MetricDef(
        "counter",
        "Load jobs the peer reported WRITTEN into our slots (read_path "
        "false on either side; 0 otherwise).",
        _PEER,
    ),
    SAME_HOST_READS: MetricDef(
        "counter",
        "READs done as a copy out of a same-host peer's shared region "
        "instead of through NIXL.",
    ),
    LOAD_TIME: MetricDef(
        "histogram",
        "Time from a load's submission (its READ or Fetch) to its successful "
        "completion, in seconds.",
        _PEER,
        TIME_BUCKETS,
    ),
    FALLBACKS: MetricDef(
        "counter",
        "Load jobs that failed, so the request recomputes, by reason.",
        _PEER_REASON,
    ),
    FALLBACK_TIME: MetricDef(
        "histogram",
        "Time from a load's submission to its failure reaching the engine "
        "(time to fall back to recompute), in seconds.",
        _PEER,
        TIME_BUCKETS,
    ),
    FAILURES: MetricDef(
        "counter",
        "Failures by reason: each load a session's end failed (peer_down, "
        "handshake_timeout, abort_timeout, ..., one per load in flight), and "
        "each deadline or serve step that failed (lookup_timeout, "
        "write_timeout, pin_error, fetch_not_pinned, ...); a load counts once, "
        "under the first reason it failed for.",
        _PEER_REASON,
    ),
    REFUSALS: MetricDef(
        "counter",
        "Refusals: handshakes refused (by field) and lookups over limits.",
        _PEER_REASON,
    ),
    PROTOCOL_ERRORS: MetricDef(
        "counter", "Protocol errors, ours and the peer's, by code.", _PEER_REASON
    ),
    DIAL_FAILURES: MetricDef(
        "counter",
        "Dials to a peer a request named that reached no p2p_kv engine, or "
        "not the one before, by "
        "reason (refused: nothing listens; not_p2p_kv: another protocol "
        "answered, such as the engine's API port; unresolvable; "
        "unreachable; framing; lost: closed before the handshake; restarted: "
        "another engine answers at the address than before, a pod restarted "
        "under it, so requests naming the old one's blocks miss).",
        ("reason",),
    ),
    LIVE_REQUESTS: MetricDef("gauge", "Engine requests live in the p2p tier."),
    FAILED_IDS: MetricDef(
        "gauge", "Live requests whose remote load failed (they recompute)."
    ),
    FENCED_SLOTS: MetricDef(
        "gauge",
        "Destination slots a transfer (our READ, a peer's WRITE) may still land in.",
        _PEER,
    ),
    STAGING_HELD: MetricDef(
        "gauge",
        "Read-staging blocks held by READs given up on while they ran; freed "
        "when UCX ends those READs (a stalled peer resumes or dies).",
    ),
    PARKED_STORES: MetricDef("gauge", "Store jobs parked for a remote decoder."),
    REQUEST_STATE: MetricDef(
        "gauge",
        "Per-request records the tier holds, of every kind (the sum of its "
        "state report): 0 once no request is live and nothing is in flight, "
        "so a value that stays above 0 at rest is a leak.",
    ),
    SESSIONS: MetricDef("gauge", "Peer sessions, by link state.", ("peer", "state")),
}


class StatsSink(Protocol):
    """What vLLM's ``OffloadingConnectorStats`` offers (structurally)."""

    def increase_counter(
        self,
        counter_name: str,
        counter_increase_value: int | float = 1,
        labelvalues: tuple[str, ...] = (),
    ) -> None: ...

    def set_gauge(
        self,
        gauge_name: str,
        gauge_value: int | float,
        labelvalues: tuple[str, ...] = (),
    ) -> None: ...

    def observe_histogram(
        self,
        histogram_name: str,
        histogram_value: int | float,
        labelvalues: tuple[str, ...] = (),
    ) -> None: ...


#: Session counters exported as per-peer counters: metric -> attribute of
#: SessionCounters (plain totals, then per-reason tables).
_TOTALS = {
    LOOKUPS: "lookups",
    LOOKUP_HITS: "hits",
    LOOKUP_MISSES: "misses",
    LOADED_BYTES: "bytes_loaded",
    SERVED_BYTES: "bytes_served",
    LOADS_READ: "loads_read",
    LOADS_FETCHED: "loads_fetched",
    LOADS_WRITTEN: "loads_written",
}
_TABLES = {
    REFUSALS: "refused",
    PROTOCOL_ERRORS: "protocol_errors",
    FAILURES: "failures",
}


def _snapshot(c: SessionCounters) -> SessionCounters:
    """What was exported: a copy whose tables do not follow the live ones."""
    return replace(
        c,
        refused=dict(c.refused),
        protocol_errors=dict(c.protocol_errors),
        failures=dict(c.failures),
    )


_BAD_CHARS = re.compile(r"[^A-Za-z0-9_:.\-\[\]]")


def session_peer(session: Session) -> str:
    """The raw peer label of a session (before the cardinality cap). A
    dialled peer's is the address a client named, cut as an inbound one's
    engine id is."""
    if not is_inbound(session.peer):
        return session.peer[:MAX_PEER_LABEL]
    hello = session.link.peer_hello
    if hello is None or not session.proven:
        # Anyone may connect and name itself: a party without the secret
        # filled every peer label (64 Hellos) before this.
        return UNKNOWN
    return hello.engine_id.split("/", 1)[0][:MAX_PEER_LABEL] or UNKNOWN


class MetricsExporter:
    """Turns a manager's counters and observations into stats increments.
    One per tier; :meth:`collect` is called once per vLLM stats poll."""

    def __init__(self, *, max_peers: int = 64, max_reasons: int = 32) -> None:
        self.max_peers = max_peers
        self.max_reasons = max_reasons
        self._peers: set[str] = set()
        self._reasons: dict[tuple[str, bool], set[str]] = {}
        self._seen: dict[Session, SessionCounters] = {}
        self._manager_errors: dict[str, int] = {}
        self._limit_refusals: dict[str, int] = {}
        self._dial_failures: dict[str, int] = {}
        self._same_host_reads = 0
        self._gauges: dict[tuple[str, tuple[str, ...]], float] = {}

    # -- labels -----------------------------------------------------------

    def peer(self, raw: str) -> str:
        raw = raw or UNKNOWN
        if raw in self._peers:
            return raw
        if len(self._peers) >= self.max_peers:
            return OTHER
        self._peers.add(raw)
        return raw

    def reason(self, metric: str, raw: str) -> str:
        label = _BAD_CHARS.sub("_", raw.split(": ", 1)[0].strip())[:64] or UNKNOWN
        # 32 Error frames with made-up codes, from a party that never
        # handshook, took every label: before_handshake went to "other".
        theirs = label.startswith(PEER_REASON)
        seen = self._reasons.setdefault((metric, theirs), set())
        if label in seen:
            return label
        if len(seen) >= (self.max_reasons // 2 if theirs else self.max_reasons):
            return PEER_REASON + OTHER if theirs else OTHER
        seen.add(label)
        return label

    # -- collection -------------------------------------------------------

    def collect(
        self,
        manager: LoadManager,
        sink: StatsSink,
        *,
        request_state: int,
        live_requests: int = 0,
        same_host_reads: int = 0,
        staging_held: int = 0,
    ) -> None:
        """Add everything new since the last call to ``sink``.
        ``same_host_reads`` and ``staging_held`` are the data plane's (the
        manager cannot tell a copy from a NIXL READ, nor sees staging);
        ``request_state`` is the runtime's state report summed (the
        manager's containers and the runtime's own), passed in because
        the runtime takes it at most once a second while requests are
        live."""
        if same_host_reads > self._same_host_reads:
            sink.increase_counter(
                SAME_HOST_READS, same_host_reads - self._same_host_reads, ()
            )
            self._same_host_reads = same_host_reads
        while manager.retired_sessions:
            session = manager.retired_sessions.popleft()
            self._session_deltas(session, sink)
            self._seen.pop(session, None)
        live = list(manager.sessions())
        for session in live:
            self._session_deltas(session, sink)
        if len(self._seen) > len(live):  # retirements lost to the bound
            alive = set(live)
            for session in [s for s in self._seen if s not in alive]:
                del self._seen[session]
        self._loads(manager, sink)
        self._manager_errors_deltas(manager, sink)
        self._gauges_now(
            manager, live, sink, live_requests, staging_held, request_state
        )

    def _session_deltas(self, session: Session, sink: StatsSink) -> None:
        c = session.link.counters
        seen = self._seen.get(session) or SessionCounters()
        label: tuple[str, ...] | None = None

        def peer() -> tuple[str, ...]:
            nonlocal label
            if label is None:
                label = (self.peer(session_peer(session)),)
            return label

        for name, attr in _TOTALS.items():
            d = getattr(c, attr) - getattr(seen, attr)
            if d > 0:
                sink.increase_counter(name, d, peer())
        for name, attr in _TABLES.items():
            table: dict[str, int] = getattr(c, attr)
            before: dict[str, int] = getattr(seen, attr)
            if table == before:
                continue
            for raw, n in table.items():
                d = n - before.get(raw, 0)
                if d > 0:
                    sink.increase_counter(name, d, (peer()[0], self.reason(name, raw)))
        self._seen[session] = _snapshot(c)

    def _loads(self, manager: LoadManager, sink: StatsSink) -> None:
        obs = manager.load_observations
        while obs:
            o = obs.popleft()
            peer = self.peer(o.peer[:MAX_PEER_LABEL])  # as its session's counts
            if o.success:
                if o.nbytes > 0:  # an empty load moved nothing: no sample
                    sink.observe_histogram(LOAD_TIME, o.elapsed_s, (peer,))
            else:
                reason = self.reason(FALLBACKS, o.reason)
                sink.increase_counter(FALLBACKS, 1, (peer, reason))
                sink.observe_histogram(FALLBACK_TIME, o.waited_s, (peer,))

    def _manager_errors_deltas(self, manager: LoadManager, sink: StatsSink) -> None:
        """What the manager counts outside any session, peer ``unknown``:
        frames that did not decode and malformed request parameters
        (protocol errors); peers refused at ``max_peers`` or
        ``max_inbound_peers`` (refusals: the peer is a client's choice);
        and, by reason alone, dials that failed before a handshake (the
        address is a client's choice, so it is no label)."""
        self._manager_errors = self._table_deltas(
            manager.protocol_errors, self._manager_errors, PROTOCOL_ERRORS, sink
        )
        self._limit_refusals = self._table_deltas(
            manager.limit_refusals, self._limit_refusals, REFUSALS, sink
        )
        failed = manager.dial_failures
        if failed != self._dial_failures:
            for reason, n in failed.items():
                d = n - self._dial_failures.get(reason, 0)
                if d > 0:  # our own codes: no label budget
                    sink.increase_counter(DIAL_FAILURES, d, (reason,))
            self._dial_failures = dict(failed)

    def _table_deltas(
        self, table: dict[str, int], seen: dict[str, int], metric: str, sink: StatsSink
    ) -> dict[str, int]:
        if not table or table == seen:
            return seen
        for raw, n in table.items():
            d = n - seen.get(raw, 0)
            if d > 0:
                sink.increase_counter(
                    metric, d, (self.peer(UNKNOWN), self.reason(metric, raw))
                )
        return dict(table)

    def _gauges_now(
        self,
        manager: LoadManager,
        sessions: Iterable[Session],
        sink: StatsSink,
        live_requests: int,
        staging_held: int,
        request_state: int,
    ) -> None:
        now: dict[tuple[str, tuple[str, ...]], float] = {
            (LIVE_REQUESTS, ()): live_requests,
            (STAGING_HELD, ()): staging_held,
            (FAILED_IDS, ()): len(manager.requests.failed_ids()),
            (PARKED_STORES, ()): manager.parked_store_count(),
            (REQUEST_STATE, ()): request_state,
        }
        for session in sessions:
            peer = self.peer(session_peer(session))
            key: tuple[str, tuple[str, ...]] = (
                SESSIONS,
                (peer, session.link.state.value),
            )
            now[key] = now.get(key, 0) + 1
            fenced = session.consumer.fenced_slots
            if fenced:
                key = (FENCED_SLOTS, (peer,))
                now[key] = now.get(key, 0) + fenced
        for key, value in now.items():
            if self._gauges.get(key) != value:
                sink.set_gauge(key[0], value, key[1])
        for key in self._gauges.keys() - now.keys():
            if self._gauges[key] != 0:
                sink.set_gauge(key[0], 0, key[1])
        self._gauges = now
