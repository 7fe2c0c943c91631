"""A peer that sends what it should not: every bad message is refused or
counted for that message only, and the session goes on serving good ones.

Engines ``a`` (producer, holds KEYS) and ``b`` (consumer) from memnet. Bad
frames are built by hand and put through the real codec, then either
*injected* into a manager (replies flow through the net as usual) or
*poked* into a session (replies are taken and inspected, never delivered).
"""

from __future__ import annotations

import pytest

from p2p_kv.lifecycle import State
from p2p_kv.node.manager import Answer
from p2p_kv.peer import MAX_TALLY_KEYS, Limits, PinResult, Session, Timeouts
from p2p_kv.peer.events import PostWrite
from p2p_kv.peer.handshake import make_hello
from p2p_kv.protocol import (
    Abort,
    AbortAck,
    Error,
    Fetch,
    Goodbye,
    Lookup,
    LookupResp,
    Message,
    TransferDone,
    decode,
    encode,
)

from .memnet import NBLOCKS, Net, identity, key, payload

KEYS = [key(i) for i in range(4)]
SRC_SLOTS = [10, 13, 16, 19]


def make_net(**kw: object) -> Net:
    """Most tests here attack the Fetch/WRITE path, so one-sided reads are
    off unless a test asks (``reads=True``)."""
    kw.setdefault("reads", False)
    net = Net(**kw)  # type: ignore[arg-type]
    for k, s in zip(KEYS, SRC_SLOTS, strict=True):
        net.engines["a"].put(k, s)
    return net


def peer_key(net: Net, engine: str) -> str:
    """The key under which ``engine`` knows the other engine (live link)."""
    for link in net.links:
        if link.up:
            for end in (link.a, link.b):
                if end[0] == engine:
                    return end[1]
    raise AssertionError(f"{engine} has no live link")


def session(net: Net, engine: str) -> Session:
    s = net.engines[engine].manager.session(peer_key(net, engine))
    assert s is not None
    return s


def wire(msg: Message) -> Message:
    return decode(encode(msg))


def inject(net: Net, to: str, msg: Message) -> None:
    """A frame from the other engine arrives at ``to``'s manager."""
    net.engines[to].manager.receive_frame(peer_key(net, to), encode(msg), net.now)


def poke(net: Net, to: str, msg: Message) -> list[Message]:
    """Feed ``to``'s session directly; return (and swallow) its replies."""
    s = session(net, to)
    s.receive(wire(msg), net.now)
    return s.take_outbox(net.now)


def errors(net: Net, engine: str) -> dict[str, int]:
    return dict(session(net, engine).link.counters.protocol_errors)


def serve_of(net: Net, kv_id: str) -> tuple[int, State]:
    """(gen, state) of the producer's SERVE for ``kv_id``."""
    (serve,) = [s for s in session(net, "a").serves() if s.req == kv_id]
    return serve.gen, serve.state


def probe(net: Net, req: str, kv_id: str) -> None:
    b = net.engines["b"].manager
    b.on_new_request(req, net.roles("a", kv_id), net.now)
    assert [b.lookup(req, k) for k in KEYS] == [Answer.RETRY] * 4
    net.run()
    assert [b.lookup(req, k) for k in KEYS] == [Answer.HIT] * 4


def load(net: Net, req: str, slots: list[int]) -> int:
    eng = net.engines["b"]
    job = eng.new_job()
    owner = getattr(eng, "slot_owner", None)  # memnet's fence check, if present
    if owner is not None:
        owner.update(dict.fromkeys(slots, job))
    eng.manager.submit_load(job, req, KEYS, slots, net.now)
    return job


def expect_loaded(net: Net, job: int, slots: list[int]) -> None:
    b = net.engines["b"]
    b.collect(net.now)
    assert [r.success for r in b.results[job]] == [True]
    assert [b.block(s) for s in slots] == [payload(k) for k in KEYS]


def finish(net: Net, req: str) -> None:
    net.engines["b"].manager.on_request_finished(req, net.now)
    net.run()
    for eng in net.engines.values():
        eng.collect(net.now)


def healthy_request(net: Net, req: str, kv_id: str, slots: list[int]) -> None:
    """A whole good request on the same session: probe, load, bytes, finish."""
    probe(net, req, kv_id)
    job = load(net, req, slots)
    net.run()
    expect_loaded(net, job, slots)
    finish(net, req)


def assert_drained(net: Net) -> None:
    assert getattr(net, "violations", []) == [], "a write landed unfenced"
    for name, eng in net.engines.items():
        residue = {k: v for k, v in eng.manager.state_report().items() if v}
        assert not residue, f"{name} left {residue}"
        assert not eng.pin_count, f"{name} still pins {eng.pin_count}"
        assert eng.submitted == set(eng.results), f"{name}: jobs without result"
        assert all(len(r) == 1 for r in eng.results.values())


# ---------------------------------------------------------------------------
# Fetch
# ---------------------------------------------------------------------------


def test_fetch_with_out_of_range_slots_is_refused_without_writes() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    for bad in ([1, 2, NBLOCKS, 3], [2**40 - 1, 1, 2, 3]):
        replies = poke(net, "a", Fetch("kv1", gen, 900, KEYS, bad))
        err, done = replies
        assert isinstance(err, Error) and err.code == "slot_out_of_range"
        assert (err.req, err.gen) == ("kv1", gen)
        assert done == TransferDone("kv1", gen, 900, False, "slot out of range")
        assert not any(
            isinstance(e, PostWrite) for e in session(net, "a").link.take_events()
        )
    assert errors(net, "a") == {"slot_out_of_range": 2}
    assert serve_of(net, "kv1") == (gen, State.PINNED)  # that message only
    job = load(net, "r1", [5, 6, 7, 8])
    net.run()
    expect_loaded(net, job, [5, 6, 7, 8])
    finish(net, "r1")
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_consumer_load_into_out_of_range_slot_fails_cleanly() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    net.hold_writes = True
    job = load(net, "r1", [1, 2, NBLOCKS + 5, 3])
    net.run()
    # Refused on our side before anything moved: no read, no write, no Fetch.
    assert net.writes == [] and net.reads == []
    b = net.engines["b"]
    b.collect(net.now)
    assert [r.success for r in b.results[job]] == [False]
    assert session(net, "b").link.counters.failures == {"slot_out_of_range": 1}
    assert errors(net, "a") == {}
    assert b.region == bytearray(len(b.region))  # nothing landed anywhere
    net.hold_writes = False
    finish(net, "r1")
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


@pytest.mark.parametrize("which", ["wrong_gen", "unknown_req"])
def test_fetch_for_a_request_the_producer_does_not_hold(which: str) -> None:
    net = make_net(timeouts=Timeouts(parked_wait_s=0.5, heartbeat_interval_s=0.2))
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    net.hold_writes = True
    req, g = ("kv1", gen + 7) if which == "wrong_gen" else ("ghost", gen)
    inject(net, "a", Fetch(req, g, 901, KEYS, [40, 41, 42, 43]))
    net.run()
    # Treated as a fetch of parked stores that may still come (a decode
    # sent before its prefill): the producer says so each heartbeat
    # interval, and when none has come by the deadline it is refused. Both
    # reach b, which holds no such job and counts them.
    for _ in range(8):
        net.advance(0.1)
        net.run(1)
    assert net.writes == []
    assert errors(net, "b") == {"stale_fetch_wait": 3, "stale_transfer_done": 1}
    assert serve_of(net, "kv1") == (gen, State.PINNED)
    assert session(net, "a").sizes()["serves"] == 1
    net.hold_writes = False
    job = load(net, "r1", [5, 6, 7, 8])
    net.run()
    expect_loaded(net, job, [5, 6, 7, 8])
    assert net.engines["b"].block(40) == bytes(16)
    finish(net, "r1")
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_duplicate_fetch_is_refused_and_the_first_one_completes() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    net.hold_writes = True
    job = load(net, "r1", [5, 6, 7, 8])
    net.run(2)
    assert serve_of(net, "kv1") == (gen, State.WRITING)
    assert len(net.writes) == 1
    inject(net, "a", Fetch("kv1", gen, 902, KEYS, [20, 21, 22, 23]))
    net.run(2)
    assert errors(net, "a") == {"duplicate_fetch": 1}
    assert errors(net, "b") == {"peer:duplicate_fetch": 1, "stale_transfer_done": 1}
    assert len(net.writes) == 1  # still only the first
    assert net.engines["b"].manager.state_report()["fenced_slots"] == 4
    net.hold_writes = False
    net.run()
    expect_loaded(net, job, [5, 6, 7, 8])
    assert net.engines["b"].block(20) == bytes(16)
    finish(net, "r1")
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_duplicate_fetch_with_the_same_job_keeps_the_fence() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    net.hold_writes = True
    job = load(net, "r1", [5, 6, 7, 8])
    net.run(2)
    assert len(net.writes) == 1
    inject(net, "a", Fetch("kv1", gen, job, KEYS, [5, 6, 7, 8]))  # a replay
    net.run(2)
    b = net.engines["b"]
    # The write is still pending, so the job must not have a result yet.
    assert len(net.writes) == 1
    assert b.collect(net.now) == []
    assert b.manager.state_report()["fenced_slots"] == 4


# ---------------------------------------------------------------------------
# replies addressed to something else
# ---------------------------------------------------------------------------


def test_lookup_resp_for_unknown_seq_gen_or_req_is_counted() -> None:
    net = make_net()
    b = net.engines["b"].manager
    b.on_new_request("r1", net.roles("a", "kv1"), net.now)
    assert [b.lookup("r1", k) for k in KEYS] == [Answer.RETRY] * 4
    for _ in range(5):  # connect, handshake, region, lookup -- no serve yet
        net.step()
    gen, state = serve_of(net, "kv1")
    assert state is State.LOOKUP_QUEUED
    for msg in (
        LookupResp("kv1", gen, 999, [True] * 4),  # unknown seq
        LookupResp("kv1", gen + 1, 1, [True] * 4),  # unknown gen
        LookupResp("other", gen, 1, [True] * 4),  # another request's id
    ):
        assert poke(net, "b", msg) == []  # counted, no reply
    assert errors(net, "b") == {"stale_lookup_resp": 3}
    (err,) = poke(net, "b", LookupResp("kv1", gen, 1, [True]))  # wrong length
    assert isinstance(err, Error) and err.code == "bad_lookup_resp"
    assert errors(net, "b") == {"stale_lookup_resp": 3, "bad_lookup_resp": 1}
    assert [b.lookup("r1", k) for k in KEYS] == [Answer.RETRY] * 4
    net.run()  # the real answer still applies
    assert [b.lookup("r1", k) for k in KEYS] == [Answer.HIT] * 4
    job = load(net, "r1", [5, 6, 7, 8])
    net.run()
    expect_loaded(net, job, [5, 6, 7, 8])
    finish(net, "r1")
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_transfer_done_for_another_gen_or_job_is_counted() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    net.hold_writes = True
    job = load(net, "r1", [5, 6, 7, 8])
    net.run(2)
    for msg in (
        TransferDone("kv1", gen + 1, job, True),  # another generation
        TransferDone("kv1", gen, job + 1000, True),  # another job
        TransferDone("other", gen, job, False, "x"),  # another request
        TransferDone("kv1", gen - 1, job, False, "x"),
    ):
        inject(net, "b", msg)
    b = net.engines["b"]
    assert errors(net, "b") == {"stale_transfer_done": 4}
    assert b.collect(net.now) == []
    assert b.manager.state_report()["fenced_slots"] == 4
    net.hold_writes = False
    net.run()
    expect_loaded(net, job, [5, 6, 7, 8])
    finish(net, "r1")
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_stray_abort_acks_change_nothing() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    net.hold_writes = True
    job = load(net, "r1", [5, 6, 7, 8])
    net.run(2)
    b = net.engines["b"]
    # Not aborting: even an ack for our own (req, gen) must not fail the load.
    for msg in (AbortAck("kv1", gen), AbortAck("kv1", gen + 1), AbortAck("x", gen)):
        inject(net, "b", msg)
    assert b.collect(net.now) == []
    assert b.manager.state_report()["fenced_slots"] == 4
    # A stray AbortAck is indistinguishable from the ack of an Abort sent
    # after a probe-only request, so it is not a protocol error: no counter.
    assert errors(net, "b") == {}
    net.hold_writes = False
    net.run()
    expect_loaded(net, job, [5, 6, 7, 8])
    finish(net, "r1")
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_abort_ack_for_another_gen_does_not_release_an_aborting_load() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    net.hold_writes = True
    job = load(net, "r1", [5, 6, 7, 8])
    net.run(2)
    b = net.engines["b"]
    b.manager.on_request_finished("r1", net.now)  # load -> ABORTING
    net.run(2)
    assert serve_of(net, "kv1") == (gen, State.ABORT_WRITING)
    (ld,) = session(net, "b").loads()
    assert ld.state is State.ABORTING
    for msg in (AbortAck("kv1", gen + 1), AbortAck("other", gen)):
        inject(net, "b", msg)
    assert b.collect(net.now) == []
    assert b.manager.state_report()["fenced_slots"] == 4
    net.hold_writes = False
    net.run()  # the write settles; the real AbortAck fences the job
    b.collect(net.now)
    assert [r.job_id for r in b.results[job]] == [job]
    assert b.manager.state_report()["fenced_slots"] == 0
    assert b.manager.requests.failed_ids() == frozenset()
    for eng in net.engines.values():
        eng.collect(net.now)
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_abort_for_unknown_request_is_acked_and_harmless() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    assert poke(net, "a", Abort("ghost", gen)) == [AbortAck("ghost", gen)]
    assert poke(net, "a", Abort("kv1", gen + 1)) == [AbortAck("kv1", gen + 1)]
    assert serve_of(net, "kv1") == (gen, State.PINNED)
    job = load(net, "r1", [5, 6, 7, 8])
    net.run()
    expect_loaded(net, job, [5, 6, 7, 8])
    finish(net, "r1")
    assert_drained(net)


# ---------------------------------------------------------------------------
# Error, second Hello
# ---------------------------------------------------------------------------


def test_error_from_peer_is_counted_and_changes_nothing() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    net.hold_writes = True
    job = load(net, "r1", [5, 6, 7, 8])
    net.run(2)
    inject(net, "b", Error(code="forged", detail="fail it", req="kv1", gen=gen))
    inject(net, "a", Error(code="forged", req="kv1", gen=gen))
    assert errors(net, "b") == {"peer:forged": 1}
    assert errors(net, "a") == {"peer:forged": 1}
    assert net.engines["b"].collect(net.now) == []
    assert serve_of(net, "kv1") == (gen, State.WRITING)
    net.hold_writes = False
    net.run()
    expect_loaded(net, job, [5, 6, 7, 8])
    finish(net, "r1")
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_a_flood_of_distinct_error_codes_grows_no_table() -> None:
    # The code is the peer's to choose: each new one was a new key for the
    # life of the session.
    net = make_net()
    probe(net, "r1", "kv1")
    for i in range(3 * MAX_TALLY_KEYS):
        inject(net, "b", Error(code=f"junk-{i}"))
    counted = errors(net, "b")
    assert len(counted) == MAX_TALLY_KEYS + 1
    assert counted["other"] == 2 * MAX_TALLY_KEYS
    assert sum(counted.values()) == 3 * MAX_TALLY_KEYS
    finish(net, "r1")
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_a_second_hello_ends_the_session_adopting_nothing() -> None:
    """A peer that greets again began a new session on the connection (it
    dropped ours without a Goodbye), so it holds nothing of ours: kept
    alive, the session answered every later lookup at its deadline. It
    ends, says so, adopts nothing of the new Hello (another layout here),
    and the next request, past the reconnect backoff, dials afresh."""
    net = make_net()
    probe(net, "r1", "kv1")
    sb = session(net, "b")
    first = sb.link.peer_hello
    (bye,) = poke(net, "b", make_hello(identity("a", layout="other"), b"n" * 16))
    assert isinstance(bye, Goodbye)
    assert sb.link.closed and sb.link.peer_hello is first and sb.link.refusal is None
    assert (
        sb.link.close_reason
        == "peer_down: the peer began a new session on our connection"
    )
    assert errors(net, "b") == {"duplicate_hello": 1}
    finish(net, "r1")
    net.run()
    net.advance(net.engines["b"].manager.settings.reconnect_backoff_s)
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert session(net, "b") is not sb
    assert_drained(net)


def test_a_second_hello_from_a_dialler_leaves_its_connection_done_with() -> None:
    """On an inbound connection a second Hello ends the session too, and
    the connection opens no new one: one connection, one session (a peer
    that means well dials anew, as ours do)."""
    net = make_net()
    probe(net, "r1", "kv1")
    m = net.engines["a"].manager
    sa = session(net, "a")
    conn = sa.peer
    inject(net, "a", make_hello(identity("b"), b"m" * 16))
    assert sa.link.closed
    assert (
        sa.link.close_reason
        == "peer_down: the peer began a new session on our connection"
    )
    assert m.peers.on_inbound(net.now, conn) == conn  # refused: no new session
    assert m.session(conn) is sa
    finish(net, "r1")
    net.run()


def test_a_goodbye_leaves_its_connection_to_close() -> None:
    """A session ended by its peer's Goodbye is an ordinary end: its
    connection closes next, and remembering it as done with pushed real
    refusals out of the bounded list (4,096 ordinary ends and a refused
    connection opened sessions again)."""
    net = make_net()
    probe(net, "r1", "kv1")
    m = net.engines["a"].manager
    sa = session(net, "a")
    inject(net, "a", Goodbye(reason="shutdown"))
    assert sa.link.closed
    assert sa.peer not in m.peers.refused_inbound
    finish(net, "r1")
    net.run()


def test_lookups_for_one_request_cannot_queue_unbounded_keys() -> None:
    """One (req, gen) with lookup after lookup before our engine serves:
    the queued keys stay under max_pending_keys; the rest are all-miss."""
    limits = Limits(max_pending_keys=10)
    net = make_net(limits=limits)
    probe(net, "r1", "kv1")
    sa = session(net, "a")
    for i in range(8):  # 4 keys each: two fit, six are refused
        inject(net, "a", Lookup("greedy", 1, i + 1, KEYS))
        assert sa.sizes()["pending_lookup_keys"] <= limits.max_pending_keys
    assert sa.sizes()["pending_lookup_keys"] == 8
    assert errors(net, "a") == {"limit_pending_keys": 6}
    net.serve()  # the engine's window empties the queue
    assert sa.sizes()["pending_lookup_keys"] == 0
    for i in range(3):  # and the budget is there again
        inject(net, "a", Lookup("greedy2", 1, i + 1, KEYS[:3]))
    assert errors(net, "a") == {"limit_pending_keys": 6}
    finish(net, "r1")
    net.settle(20.0, 0.1)  # the greedy serves expire at their pin deadline
    assert_drained(net)


def test_all_peers_together_stay_under_the_engine_wide_key_bounds() -> None:
    """Each key bound held per session, so every peer connected multiplied
    it (512 peers: ~60 GB). The engine-wide bounds count all sessions."""
    limits = Limits(engine_pending_keys=6, engine_waiting_fetch_keys=6)
    net = make_net(names=("a", "b", "c"), limits=limits)
    for consumer, kv_id in (("b", "kv1"), ("c", "kv2")):
        m = net.engines[consumer].manager
        m.on_new_request(kv_id, net.roles("a", kv_id), net.now)
        m.lookup(kv_id, KEYS[0])
        net.run()
        m.on_request_finished(kv_id, net.now)
        net.run()
    a = net.engines["a"].manager
    sb, sc = [s for s in a.sessions() if s.link.ready]
    a.receive_frame(sb.peer, encode(Lookup("g1", 1, 1, KEYS)), net.now)  # 4 of 6
    a.receive_frame(sc.peer, encode(Lookup("g2", 1, 1, KEYS)), net.now)  # 8 > 6
    assert a.pending_lookup_keys() == 4
    assert sc.link.counters.protocol_errors == {"limit_engine_pending_keys": 1}
    net.serve()  # the engine's window empties the queue: room again
    a.receive_frame(sc.peer, encode(Lookup("g3", 1, 1, KEYS)), net.now)
    assert a.pending_lookup_keys() == 4
    a.receive_frame(sb.peer, encode(Fetch("p1", 1, 7, KEYS, [1, 2, 3, 4])), net.now)
    a.receive_frame(sc.peer, encode(Fetch("p2", 1, 8, KEYS, [5, 6, 7, 8])), net.now)
    assert a.waiting_fetch_keys() == 4
    assert sc.link.counters.protocol_errors["limit_engine_waiting_fetch_keys"] == 1
    parked_wait = a.settings.timeouts.parked_wait_s + 1.0
    net.settle(parked_wait, 0.5)
    assert a.waiting_fetch_keys() == 0  # the keys left with the state
    a.receive_frame(sc.peer, encode(Fetch("p3", 1, 9, KEYS, [5, 6, 7, 8])), net.now)
    assert a.waiting_fetch_keys() == 4
    net.settle(parked_wait, 0.5)


def test_pins_stay_under_max_pinned_blocks_within_one_serve_window() -> None:
    """Lookups answered in one window share the pin budget: the one that
    would go over it is answered all-miss and counted; pins come back."""
    limits = Limits(max_pinned_blocks=10)
    net = make_net(limits=limits, timeouts=Timeouts(pin_ttl_s=1.0))
    probe(net, "r1", "kv1")  # 4 pinned
    sa = session(net, "a")
    assert sa.producer.pinned_blocks == 4
    inject(net, "a", Lookup("g1", 1, 1, KEYS))  # fits: 8 pinned
    inject(net, "a", Lookup("g2", 1, 2, KEYS))  # would make 12: refused
    net.serve()
    assert sa.producer.pinned_blocks == 8
    assert sa.link.counters.refused == {"limit_pinned_blocks": 1}
    answers = {
        m.req: m.hits for m in sa.take_outbox(net.now) if isinstance(m, LookupResp)
    }
    assert answers == {"g1": [True] * 4, "g2": [False] * 4}
    finish(net, "r1")
    for _ in range(20):  # g1's pins end at their deadline
        net.advance(0.1)
        net.run(1)
    assert sa.producer.pinned_blocks == 0
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_peer_over_max_serves_gets_refusals_and_state_stays_bounded() -> None:
    limits = Limits(max_serves=4)
    net = make_net(limits=limits, timeouts=Timeouts(pin_ttl_s=1.0))
    probe(net, "r1", "kv1")
    _gen, _ = serve_of(net, "kv1")
    sa = session(net, "a")
    flood = 200
    for i in range(flood):
        inject(net, "a", Lookup(f"flood-{i}", 1, i + 1, KEYS))
        assert sa.sizes()["serves"] <= limits.max_serves
    refused_lookups = flood - (limits.max_serves - 1)
    assert errors(net, "a") == {"limit_serves": refused_lookups}
    for i in range(50):
        inject(net, "a", Fetch(f"fetch-flood-{i}", 1, 5000 + i, KEYS, [1, 2, 3, 4]))
    assert sa.sizes()["serves"] == limits.max_serves
    net.run()
    assert sa.sizes()["serves"] <= limits.max_serves
    assert net.engines["a"].manager.state_report()["serves"] <= limits.max_serves
    # Every flooding lookup got an answer (misses) and every fetch a refusal.
    assert errors(net, "b") == {
        "peer:limit_serves": refused_lookups,
        "stale_lookup_resp": flood,
        "stale_transfer_done": 50,
    }
    # The request that was in before the flood still loads.
    job = load(net, "r1", [5, 6, 7, 8])
    net.run()
    expect_loaded(net, job, [5, 6, 7, 8])
    finish(net, "r1")
    # The flood's serves expire at their pin deadline; then new work fits.
    for _ in range(12):
        net.advance(0.1)
        net.run(1)
    assert sa.sizes()["serves"] == 0 and sa.link.ready
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_fetches_waiting_for_stores_cannot_hold_unbounded_keys() -> None:
    """Disaggregated-prefill Fetches wait for stores we have yet to park,
    each holding its keys and slots: bounded per peer by their keys (the
    serve count alone let one peer make us hold 4,096 of 65,536 keys)."""
    limits = Limits(max_waiting_fetch_keys=10)
    net = make_net(limits=limits, timeouts=Timeouts(parked_wait_s=1.0))
    probe(net, "r1", "kv1")  # brings the link up
    finish(net, "r1")
    sa = session(net, "a")
    inject(net, "a", Fetch("p1", 1, 9001, KEYS, [1, 2, 3, 4]))
    inject(net, "a", Fetch("p2", 1, 9002, KEYS, [5, 6, 7, 8]))
    assert errors(net, "a") == {}
    inject(net, "a", Fetch("p3", 1, 9003, KEYS, [9, 10, 11, 12]))  # 12 > 10
    assert errors(net, "a") == {"limit_waiting_fetch_keys": 1}
    assert sa.sizes()["serves"] == 2
    net.settle(1.5, 0.1)  # the waiting ones end at parked_wait_s
    assert sa.sizes()["serves"] == 0
    inject(net, "a", Fetch("p4", 1, 9004, KEYS, [1, 2, 3, 4]))  # fits again
    assert errors(net, "a") == {"limit_waiting_fetch_keys": 1}
    net.settle(1.5, 0.1)
    assert_drained(net)


def test_fetches_aborted_while_waiting_leave_nothing_behind() -> None:
    """A Fetch waiting for stores, then its Abort, a frame apart: the serve
    left every bound at once, but its timer entry, and with it the Fetch's
    keys and slots, stayed in the session's heap behind one earlier
    waiting Fetch until parked_wait_s passed (60 such pairs of 60,000 keys
    held 500 MiB, against a waiting-keys bound of 58 MB)."""
    net = make_net(timeouts=Timeouts(parked_wait_s=30.0))
    probe(net, "r1", "kv1")  # brings the link up
    finish(net, "r1")
    sa = session(net, "a")
    inject(net, "a", Fetch("anchor", 1, 9000, KEYS[:1], [1]))  # waits 30 s
    many = [key(100 + i) for i in range(NBLOCKS)]
    for i in range(200):
        inject(net, "a", Fetch(f"p{i}", 1, i, many, list(range(NBLOCKS))))
        inject(net, "a", Abort(f"p{i}", 1))
    assert errors(net, "a") == {}
    assert sa.sizes()["serves"] == 1
    live = [t for t in sa.link._timers if not t[2].terminal]
    assert len(live) == 1 and len(sa.link._timers) <= 4 * 16, len(sa.link._timers)
    kept = [t[2] for t in sa.link._timers if t[2].fetch is not None]
    assert [sv.req for sv in kept] == ["anchor"], "an ended serve kept its Fetch"
    net.settle(31.0, 1.0)
    assert_drained(net)


def test_an_engine_that_cannot_pin_costs_one_lookup_not_the_window() -> None:
    """The engine's pin raising (vLLM's parent manager failed) answers that
    lookup all-miss and the serve window goes on: the exception used to
    leave the engine's step, and the pins made earlier in the window were
    never registered, so vLLM's store jobs for them never ended."""
    from .memnet import FakePinner

    class FlakyPinner(FakePinner):
        calls = 0

        def pin(self, label: str, keys: list[bytes]) -> PinResult:  # type: ignore[override]
            FlakyPinner.calls += 1
            if FlakyPinner.calls == 2:
                raise RuntimeError("parent manager failed")
            return super().pin(label, keys)

    net = make_net(timeouts=Timeouts(pin_ttl_s=1.0))
    probe(net, "r1", "kv1")
    finish(net, "r1")
    a = net.engines["a"]
    peer = peer_key(net, "a")
    for seq, req in enumerate(("x", "y", "z"), start=1):
        a.manager.receive_frame(peer, encode(Lookup(req, 1, seq, KEYS)), net.now)
    a.manager.serve(FlakyPinner(a), net.now)  # does not raise
    answers = {
        m.req: m.hits
        for _, frames in a.manager.take_frames(net.now)
        for m in map(decode, frames)
        if isinstance(m, LookupResp)
    }
    assert answers == {"x": [True] * 4, "y": [False] * 4, "z": [True] * 4}
    assert session(net, "a").link.counters.failures == {"pin_error": 1}
    net.settle(2.0, 0.1)  # the pins end at their deadline and come back
    assert_drained(net)


@pytest.mark.parametrize("stops", [True, False], ids=["stopped", "unstoppable"])
def test_a_write_past_its_deadline_is_answered_only_once_it_cannot_land(
    stops: bool,
) -> None:
    """The producer gives up on a WRITE at its deadline. It told the
    consumer so (TransferDone / AbortAck) before knowing the WRITE had
    stopped, and NIXL cannot stop one: over TCP, a WRITE to a consumer that
    stalled lands once it progresses again (measured: all of a cancelled
    4 MiB WRITE). Now the reply waits for the data plane; a WRITE it could
    not stop ends the session instead, so the consumer fences it by
    dropping the producer's agent, and nothing lands in its freed slots."""
    net = make_net(timeouts=Timeouts(fetch_floor_s=0.5, abort_ack_s=5.0))
    net.unstoppable_writes = not stops
    probe(net, "r1", "kv1")
    net.hold_writes = True
    job = load(net, "r1", [1, 2, 3, 4])
    net.run(2)
    sa, sb = session(net, "a"), session(net, "b")
    for _ in range(30):  # past both sides' deadlines
        net.advance(0.1)
        net.run(1)
    assert sa.link.counters.failures.get("write_timeout") == 1
    b = net.engines["b"]
    b.collect(net.now)
    (result,) = b.results[job]
    assert not result.success
    if stops:
        assert sa.link.ready and sb.link.ready  # answered, and the session goes on
    else:
        assert sa.link.closed and "could not stop" in sa.link.close_reason
        assert sb.link.closed
    net.hold_writes = False  # the WRITE would land now: its link is gone
    net.run()
    finish(net, "r1")
    for eng in net.engines.values():
        eng.collect(net.now)
    assert_drained(net)


def test_session_whose_outbox_is_not_drained_is_closed() -> None:
    limits = Limits(max_outbox=16)
    a = Session("b:1", identity("a"), 0.0, limits=limits, nonce=b"A" * 16)
    b = Session("in:1", identity("b"), 0.0, limits=limits, nonce=b"B" * 16)
    for _ in range(3):
        for src, dst in ((a, b), (b, a)):
            for msg in src.take_outbox(0.0):
                dst.receive(wire(msg), 0.0)
    assert a.link.ready and b.link.ready
    # The peer keeps sending and never reads our replies.
    for i in range(1000):
        b.receive(wire(Abort(f"r{i}", 1)), 0.0)
        assert len(b.link._outbox) <= limits.max_outbox
    assert b.take_outbox(0.0) == []  # lost when its outbox is taken
    assert b.link.closed and b.link.close_reason.startswith("outbox_full")
    assert b.sizes() == dict.fromkeys(b.sizes(), 0)


def test_manager_closes_a_peer_that_does_not_drain() -> None:
    net = make_net(limits=Limits(max_outbox=16))
    probe(net, "r1", "kv1")
    finish(net, "r1")
    a = net.engines["a"].manager
    peer = peer_key(net, "a")
    for i in range(100):  # nobody takes a's outgoing frames meanwhile
        a.receive_frame(peer, encode(Abort(f"r{i}", 1)), net.now)
    sa = a.session(peer)
    assert sa is not None
    assert a.take_frames(net.now) == []  # the next pump sends nothing
    assert sa.link.closed
    assert sa.link.close_reason.startswith("outbox_full")
    net.run()
    assert a.session(peer) is None  # invalidated and dropped
    assert not any(link.up for link in net.links)
    # b reconnects after its backoff and works again. (memnet routes by the
    # first link naming a peer key, so forget the dead one before "a:1" is
    # reused.)
    net.links = [link for link in net.links if link.up]
    for _ in range(12):
        net.advance(0.1)
        net.run(1)
    healthy_request(net, "r2", "kv2", [30, 31, 32, 33])
    assert_drained(net)


def test_outbox_overflow_inside_a_serve_window_closes_cleanly() -> None:
    """A peer queues more lookups than our outbox holds before our engine's
    serve window. The answer that did not fit lost the session inside the
    window's loop, which then marked the serve it had just orphaned as
    served: IllegalTransition out of the engine's step, and pins the engine
    had made that never came back. Now the session is lost once the window
    ends, and every pin comes back."""
    limits = Limits(max_outbox=8)
    net = make_net(limits=limits, timeouts=Timeouts(pin_ttl_s=1.0))
    probe(net, "r1", "kv1")
    finish(net, "r1")
    a = net.engines["a"].manager
    peer = peer_key(net, "a")
    for seq in range(1, 21):  # one-key lookups, one (req, gen)
        a.receive_frame(peer, encode(Lookup("x", 7, seq, [KEYS[seq % 4]])), net.now)
    net.serve()  # answers all 20: only 8 fit
    sa = a.session(peer)
    assert sa is not None and not sa.link.closed
    assert a.take_frames(net.now) == []
    assert sa.link.closed and sa.link.close_reason.startswith("outbox_full")
    net.run()
    assert a.session(peer) is None
    net.settle(3.0, 0.1)  # offered pins are held to their deadline, then freed
    assert_drained(net)


# ---------------------------------------------------------------------------
# a benign race: two lookup batches before one serve window
# ---------------------------------------------------------------------------


def test_second_lookup_before_the_serve_window_is_answered() -> None:
    net = make_net()
    b = net.engines["b"].manager
    b.on_new_request("r1", net.roles("a", "kv1"), net.now)
    assert b.lookup("r1", KEYS[0]) is Answer.RETRY
    for _ in range(4):  # handshake done; Lookup seq 1 queued at a, not served
        net.step()
    assert b.lookup("r1", KEYS[1]) is Answer.RETRY
    net.step()  # Lookup seq 2 reaches a before its serve window
    net.run()
    assert errors(net, "a") == {}
    assert [b.lookup("r1", k) for k in KEYS[:2]] == [Answer.HIT] * 2


def test_a_write_past_its_deadline_before_it_was_posted_ends_at_once() -> None:
    """WRITE_QUEUED: the data plane never took the WRITE, so nothing can
    land; its deadline answers the peer at once and the stale PostWrite is
    never posted."""
    net = make_net()
    probe(net, "r1", "kv1")
    gen, _ = serve_of(net, "kv1")
    job = load(net, "r1", [5, 6, 7, 8])
    net.step()  # b's Fetch reaches a; a's PostWrite waits for a's next pump
    assert serve_of(net, "kv1") == (gen, State.WRITE_QUEUED)
    a = net.engines["a"].manager
    net.now += 60.0
    a.tick(net.now)
    replies = [decode(f) for _, frames in a.take_frames(net.now) for f in frames]
    assert TransferDone("kv1", gen, job, False, "write deadline") in replies
    assert not [e for _, e in a.take_events() if isinstance(e, PostWrite)]
    assert session(net, "a").link.counters.failures == {"write_timeout": 1}
    for msg in replies:
        inject(net, "b", msg)
    net.run()
    b = net.engines["b"]
    b.collect(net.now)
    net.engines["a"].collect(net.now)
    assert not b.results[job][0].success
    assert net.writes == [] and net.violations == []
    finish(net, "r1")
    assert_drained(net)
