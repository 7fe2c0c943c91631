"""p2p_kv.runtime.metrics: definitions, and stats from managers driven in memory."""

from __future__ import annotations

from collections import defaultdict

import pytest

from p2p_kv.node.roles import Roles
from p2p_kv.node.tallies import LoadObservation
from p2p_kv.peer import MAX_TALLY_KEYS, tally
from p2p_kv.runtime.metrics import (
    DEFINITIONS,
    FAILED_IDS,
    FAILURES,
    FALLBACK_TIME,
    FALLBACKS,
    FENCED_SLOTS,
    LIVE_REQUESTS,
    LOAD_TIME,
    LOADED_BYTES,
    LOADS_FETCHED,
    LOADS_READ,
    LOOKUP_HITS,
    LOOKUP_MISSES,
    LOOKUPS,
    MAX_PEER_LABEL,
    OTHER,
    PARKED_STORES,
    PREFIX,
    PROTOCOL_ERRORS,
    REFUSALS,
    REQUEST_STATE,
    SAME_HOST_READS,
    SERVED_BYTES,
    SESSIONS,
    STAGING_HELD,
    MetricsExporter,
)

from .memnet import Net, identity, key

pytestmark = pytest.mark.vllm_compat  # the adapter's metadata: vLLM's classes

KEYS = [key(i) for i in range(4)]
Labels = tuple[str, ...]


class Sink:
    """Records what the exporter sends, checking it the way vLLM's
    Prometheus logger would (known name, right kind, right label count)."""

    def __init__(self) -> None:
        self.counters: dict[str, dict[Labels, float]] = defaultdict(dict)
        self.gauges: dict[str, dict[Labels, float]] = defaultdict(dict)
        self.hist: dict[str, dict[Labels, list[float]]] = defaultdict(dict)

    def _check(self, name: str, kind: str, labels: Labels) -> None:
        d = DEFINITIONS[name]
        assert d.kind == kind, name
        assert len(labels) == len(d.labelnames), (name, labels)
        assert all(isinstance(v, str) for v in labels)

    def increase_counter(
        self,
        counter_name: str,
        counter_increase_value: float = 1,
        labelvalues: Labels = (),
    ) -> None:
        self._check(counter_name, "counter", labelvalues)
        assert counter_increase_value > 0
        c = self.counters[counter_name]
        c[labelvalues] = c.get(labelvalues, 0) + counter_increase_value

    def set_gauge(
        self, gauge_name: str, gauge_value: float, labelvalues: Labels = ()
    ) -> None:
        self._check(gauge_name, "gauge", labelvalues)
        self.gauges[gauge_name][labelvalues] = gauge_value

    def observe_histogram(
        self, histogram_name: str, histogram_value: float, labelvalues: Labels = ()
    ) -> None:
        self._check(histogram_name, "histogram", labelvalues)
        self.hist[histogram_name].setdefault(labelvalues, []).append(histogram_value)

    @property
    def empty(self) -> bool:
        return not (self.counters or self.gauges or self.hist)


def collect(exp: MetricsExporter, net: Net, name: str, live: int = 0) -> Sink:
    sink = Sink()
    m = net.engines[name].manager
    state = sum(m.state_report().values())
    exp.collect(m, sink, live_requests=live, request_state=state)
    return sink


def make_net() -> Net:
    net = Net()
    for i, k in enumerate(KEYS):
        net.engines["a"].put(k, 10 + 3 * i)
    return net


def probe_and_load(net: Net, req: str, slots: list[int]) -> int:
    b = net.engines["b"]
    b.manager.on_new_request(req, net.roles("a", f"kv-{req}"), net.now)
    for k in [*KEYS, key(99)]:
        b.manager.lookup(req, k)
    net.run()
    job = b.new_job()
    for s in slots:
        b.slot_owner[s] = job
    b.manager.submit_load(job, req, KEYS, slots, net.now)
    return job


def test_definitions_are_prometheus_names_with_bounded_labels() -> None:
    assert len(DEFINITIONS) == 23
    for name, d in DEFINITIONS.items():
        assert name.startswith(PREFIX) and name.startswith("vllm:kv_offload")
        assert not name.endswith("_total")  # prometheus_client adds it
        assert set(d.labelnames) <= {"peer", "reason", "state"}
        assert (d.buckets is not None) == (d.kind == "histogram")


def test_adapter_builds_vllm_metadata() -> None:
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
    )

    from p2p_kv.adapter import tier  # CI must fail, not skip, without vllm

    defs = tier.P2PKVTier.build_metric_definitions({})
    assert defs.keys() == DEFINITIONS.keys()
    kinds = {
        "counter": OffloadingCounterMetadata,
        "gauge": OffloadingGaugeMetadata,
        "histogram": OffloadingHistogramMetadata,
    }
    for name, meta in defs.items():
        assert type(meta) is kinds[DEFINITIONS[name].kind]
        assert meta.labelnames == DEFINITIONS[name].labelnames
    assert defs[LOAD_TIME].buckets == DEFINITIONS[LOAD_TIME].buckets


def test_hit_and_load_are_counted_per_peer_once() -> None:
    net = make_net()
    ea, eb = MetricsExporter(), MetricsExporter()
    job = probe_and_load(net, "r1", [5, 6, 7, 30])
    t0 = net.now
    net.advance(0.25)  # the fetch and its write land a quarter second later
    net.run()
    (res,) = net.engines["b"].collect(net.now)
    assert res.job_id == job and res.success

    b = collect(eb, net, "b", live=1)
    peer = ("a:1",)
    assert b.counters[LOOKUPS] == {peer: 1}
    assert b.counters[LOOKUP_HITS] == {peer: 4}
    assert b.counters[LOOKUP_MISSES] == {peer: 1}
    assert b.counters[LOADED_BYTES] == {peer: 64}
    assert b.counters[LOADS_READ] == {peer: 1}  # the default path
    assert LOADS_FETCHED not in b.counters
    assert b.hist[LOAD_TIME][peer] == [pytest.approx(net.now - t0)]
    assert FALLBACKS not in b.counters
    assert b.gauges[LIVE_REQUESTS] == {(): 1}
    assert b.gauges[SESSIONS] == {("a:1", "ready"): 1}
    assert b.gauges[FAILED_IDS] == {(): 0}

    # a labels its inbound session with b's engine_id from b's Hello
    a = collect(ea, net, "a")
    assert a.counters[SERVED_BYTES] == {("b",): 64}
    assert a.gauges[SESSIONS] == {("b", "ready"): 1}
    assert LOOKUPS not in a.counters

    # nothing new: nothing sent (counters are increments, gauges on change)
    assert collect(eb, net, "b", live=1).empty
    assert collect(ea, net, "a").empty
    assert collect(eb, net, "b", live=0).gauges == {LIVE_REQUESTS: {(): 0}}


def test_failed_load_counts_fallback_failure_and_time_to_fall_back() -> None:
    net = make_net()
    eb = MetricsExporter()
    probe_and_load(net, "r1", [1, 2, 3, 4])
    collect(eb, net, "b")
    net.advance(0.5)
    net.cut("a", "b")
    net.run()
    net.engines["b"].collect(net.now)
    b = collect(eb, net, "b")
    assert b.counters[FALLBACKS] == {("a:1", "peer_down"): 1}
    assert b.counters[FAILURES] == {("a:1", "peer_down"): 1}
    assert b.hist[FALLBACK_TIME][("a:1",)] == [pytest.approx(0.5)]
    assert LOAD_TIME not in b.hist
    assert b.gauges[FAILED_IDS] == {(): 1}  # live and unfinished: recomputes
    assert b.gauges[REQUEST_STATE][()] >= 1  # its records, until it finishes
    # the session is gone: its series drops to zero
    assert b.gauges[SESSIONS] == {("a:1", "ready"): 0}
    net.engines["b"].manager.on_request_finished("r1", net.now)
    assert collect(eb, net, "b").gauges == {
        FAILED_IDS: {(): 0},
        REQUEST_STATE: {(): 0},
    }


def test_retired_session_last_counts_are_not_lost() -> None:
    """A session that comes and goes between two polls still counts."""
    net = Net(identities={"b": identity("b", hash_seed="other")})
    ea, eb = MetricsExporter(), MetricsExporter()
    b = net.engines["b"]
    b.manager.on_new_request("r1", net.roles("a", "kv1"), net.now)
    b.manager.lookup("r1", KEYS[0])
    net.run()
    assert not list(b.manager.sessions())  # refused, invalidated, gone
    assert not list(net.engines["a"].manager.sessions())
    sa = collect(ea, net, "a")
    # a refused b's Hello, so it never learnt who b is
    assert sa.counters[REFUSALS] == {("unknown", "hash_seed"): 1}
    assert not any(sa.gauges.get(SESSIONS, {}).values())
    # (in memory, b hears a's Goodbye before a's Hello: a plain peer_down)
    assert REFUSALS not in collect(eb, net, "b").counters


def test_fenced_slots_and_parked_stores_gauges() -> None:
    net = make_net()
    ea, eb = MetricsExporter(), MetricsExporter()
    probe_and_load(net, "r1", [1, 2, 3, 4])
    net.hold_writes = True
    net.run(2)
    b = net.engines["b"]
    b.manager.on_request_finished("r1", net.now)
    net.run(2)
    assert collect(eb, net, "b").gauges[FENCED_SLOTS] == {("a:1",): 4}
    net.hold_writes = False
    net.run()
    b.collect(net.now)
    assert collect(eb, net, "b").gauges[FENCED_SLOTS] == {("a:1",): 0}

    a = net.engines["a"]
    roles = Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}})
    a.manager.on_new_request("p1", roles, net.now)
    a.store(a.new_job(), "p1", KEYS, [20, 21, 22, 23], net.now)
    assert collect(ea, net, "a").gauges[PARKED_STORES] == {(): 1}


def test_labels_are_bounded() -> None:
    exp = MetricsExporter(max_peers=2, max_reasons=2)
    assert [exp.peer(p) for p in ("x:1", "y:1", "z:1", "x:1")] == [
        "x:1",
        "y:1",
        OTHER,
        "x:1",
    ]
    # free-text details after ": " never reach a label
    assert exp.reason(FALLBACKS, "peer: write failed at 0x1234") == "peer"
    assert exp.reason(FALLBACKS, "we ird{}") == "we_ird__"
    assert exp.reason(FALLBACKS, "third") == OTHER
    assert exp.reason(FAILURES, "third") == "third"  # caps are per metric


def test_undecodable_frames_count_as_protocol_errors() -> None:
    net = make_net()
    exp = MetricsExporter()
    net.engines["b"].manager.on_bad_frame("in:ff", "decode")
    net.engines["b"].manager.on_bad_frame("in:ff", "decode")
    s = collect(exp, net, "b")
    assert s.counters[PROTOCOL_ERRORS] == {("unknown", "decode"): 2}
    net.engines["b"].manager.on_bad_frame("in:ff", "decode")
    assert collect(exp, net, "b").counters[PROTOCOL_ERRORS] == {
        ("unknown", "decode"): 1
    }


@pytest.mark.parametrize("refused_before", [0, MAX_TALLY_KEYS + 5])
def test_peers_refused_at_max_peers_reach_the_refusals_counter(
    refused_before: int,
) -> None:
    """The refusals the docs promise for ``max_peers`` (and its inbound
    twins) are counted by the manager, outside any session: the exporter
    read only sessions' counters, and they never appeared. And each refused
    session is its own key of the manager's refusals table (64 at most):
    once anyone who reaches the port had filled it, a ``too_many_peers``
    refusal was tallied as ("other", "other") and never exported again."""
    net = Net(names=("a", "b", "c"))
    exp = MetricsExporter()
    b = net.engines["b"].manager
    for i in range(refused_before):
        tally(b.refusals, (f"in:#{i}", "auth"), ("other", "auth"))
    b.settings.max_peers = 1
    b.on_new_request("r1", net.roles("a", "kv1"), net.now)
    b.on_new_request("r2", net.roles("c", "kv2"), net.now)
    b.lookup("r1", key(1))
    b.lookup("r2", key(1))
    net.run()
    assert collect(exp, net, "b").counters[REFUSALS] == {
        ("unknown", "too_many_peers"): 1
    }
    assert REFUSALS not in collect(exp, net, "b").counters  # sent once


def test_codes_a_peer_names_cannot_take_our_reason_labels() -> None:
    """An Error is read before the handshake, and its code is the sender's:
    32 made-up codes took every protocol_errors label, and our own
    before_handshake was exported as "other" from then on."""
    exp = MetricsExporter(max_reasons=4)
    theirs = [exp.reason(PROTOCOL_ERRORS, f"peer:junk-{i}") for i in range(10)]
    assert theirs == ["peer:junk-0", "peer:junk-1"] + ["peer:other"] * 8
    ours = [exp.reason(PROTOCOL_ERRORS, r) for r in ("before_handshake", "decode")]
    assert ours == ["before_handshake", "decode"]


def test_a_long_peer_address_is_one_label_for_loads_and_sessions() -> None:
    """Session counts cut a peer's address to 128 characters and load
    observations did not: a host name past that was two series, and took
    two of the 64 peer labels."""
    net = make_net()
    exp = MetricsExporter()
    b = net.engines["b"].manager
    long_peer = "h" * 200 + ":5800"
    b.load_observations.append(LoadObservation(long_peer, True, 0.01, 4096, "", 0.01))
    b.load_observations.append(LoadObservation(long_peer, False, 0, 0, "timeout", 0.5))
    sink = collect(exp, net, "b")
    label = (long_peer[:MAX_PEER_LABEL],)
    assert list(sink.hist[LOAD_TIME]) == [label]
    assert list(sink.counters[FALLBACKS]) == [(*label, "timeout")]
    assert exp.peer(long_peer[:MAX_PEER_LABEL]) == label[0]  # one label, not two


def test_same_host_reads_are_sent_as_increments_of_the_data_planes_count() -> None:
    net = make_net()
    exp = MetricsExporter()
    b = net.engines["b"].manager
    first = Sink()
    exp.collect(b, first, same_host_reads=3, request_state=0)
    assert first.counters[SAME_HOST_READS] == {(): 3}
    again = Sink()
    exp.collect(b, again, same_host_reads=3, request_state=0)
    assert SAME_HOST_READS not in again.counters
    later = Sink()
    exp.collect(b, later, same_host_reads=5, request_state=0)
    assert later.counters[SAME_HOST_READS] == {(): 2}


def test_staging_held_gauge_follows_the_data_plane() -> None:
    """The manager never sees staging: the data plane's count is passed in,
    and a gauge that fell to 0 is set to 0 (not left at its last value)."""
    net = make_net()
    exp = MetricsExporter()
    sink = Sink()
    exp.collect(net.engines["b"].manager, sink, staging_held=3, request_state=0)
    assert sink.gauges[STAGING_HELD] == {(): 3}
    sink = Sink()
    exp.collect(net.engines["b"].manager, sink, staging_held=0, request_state=0)
    assert sink.gauges[STAGING_HELD] == {(): 0}


def test_an_inbound_peer_is_named_by_its_hello_only_once_proven() -> None:
    """Anyone may connect and name itself in a Hello: a party without the
    secret filled every peer label (64 Hellos) for the life of the
    process. Until its proof checks an inbound peer is ``unknown``."""
    from p2p_kv.peer import Session
    from p2p_kv.protocol import Hello
    from p2p_kv.runtime.metrics import UNKNOWN, session_peer

    from .memnet import identity as ident

    me, them = ident("a"), ident("b")
    s = Session("in:#1", me, 0.0, nonce=b"\0" * 16)
    other = Session("x:1", them, 0.0, nonce=b"\1" * 16)
    (hello,) = [m for m in other.take_outbox(0.0) if isinstance(m, Hello)]
    s.receive(hello, 0.0)
    assert s.link.peer_hello is not None and not s.proven
    assert session_peer(s) == UNKNOWN
    for msg in s.take_outbox(0.0):
        other.receive(msg, 0.0)  # our Hello and proof
    for msg in other.take_outbox(0.0):
        s.receive(msg, 0.0)  # theirs
    assert s.proven and session_peer(s) == "b"


def test_failed_dials_are_exported_by_reason_alone() -> None:
    """A request naming an address where nothing listens, or another
    protocol answers, changes a counter an alert can see; the address is a
    client's choice, so it is no label."""
    from p2p_kv.runtime.metrics import DIAL_FAILURES

    net = make_net()
    m = net.engines["b"].manager
    m.on_dial_failed("10.0.0.9:5555", "refused")
    m.on_dial_failed("10.0.0.9:5555", "refused")
    m.on_dial_failed("10.0.0.9:8000", "not_p2p_kv")
    exp = MetricsExporter()
    sink = collect(exp, net, "b")
    assert sink.counters[DIAL_FAILURES] == {("refused",): 2, ("not_p2p_kv",): 1}
    assert DIAL_FAILURES not in collect(exp, net, "b").counters  # nothing new
