"""One-sided READs of offered pins, scenario by scenario (pure core, memnet).

The consumer reads the producer's pinned blocks itself and then releases
them. What must hold: a read is trusted only inside the announced pin
window; an aborted read keeps its slots fenced until it ends; a producer's
cache reset waits for the consumer's Release; nobody but our own data
plane can end a read.
"""

from __future__ import annotations

import pytest

from p2p_kv.lifecycle import State
from p2p_kv.node.manager import Answer
from p2p_kv.peer import Session, Timeouts
from p2p_kv.protocol import (
    Lookup,
    LookupResp,
    Release,
    Revoke,
    TransferDone,
    decode,
    encode,
)

from .memnet import POISON, Net, key, payload
from .scenarios import (
    KEYS,
    assert_drained,
    collect_all,
    load,
    make_net,
    probe,
    wait,
)

SLOTS = [5, 6, 7, 30]


def sent(net: Net, engine: str) -> list[str]:
    """Type names of the frames ``engine`` has queued, in order (but
    heartbeats)."""
    names = [type(decode(f)).__name__ for n, _, f in net.queue if n == engine]
    return [n for n in names if n != "Heartbeat"]


def session(net: Net, engine: str) -> Session:
    (s,) = list(net.engines[engine].manager.sessions())
    return s


def load_state(net: Net) -> State:
    (ld,) = list(session(net, "b").loads())
    return ld.state


def test_a_hit_is_read_one_sided_and_released_without_a_reply() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    b = net.engines["b"]
    job = load(net, "r1", SLOTS)
    net.step(deliver=False)  # the read is posted and ends (memnet: at once)
    net.step(deliver=False)
    # No Fetch went out: the only message is the Release.
    assert sent(net, "b") == ["Release"]
    assert net.writes == [] and net.reads == []
    (result,) = b.collect(net.now)
    assert result.job_id == job and result.success
    assert [b.block(s) for s in SLOTS] == [payload(k) for k in KEYS]
    net.run()
    # The producer released its pins on the Release, and answered nothing.
    assert sent(net, "a") in ([], ["Heartbeat"])
    assert list(session(net, "a").serves()) == []
    assert session(net, "a").link.counters.bytes_served == 4 * 16
    b.manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_reads_off_uses_fetch_and_write() -> None:
    net = make_net(reads=False)
    probe(net, "r1", "kv1")
    load(net, "r1", SLOTS)
    net.step(deliver=False)
    assert sent(net, "b") == ["Fetch"]
    net.run()
    b = net.engines["b"]
    assert [r.success for r in b.collect(net.now)] == [True]
    assert [b.block(s) for s in SLOTS] == [payload(k) for k in KEYS]


def test_peers_move_bytes_while_an_offer_is_held_or_a_write_is_awaited() -> None:
    """What keeps the data plane progressed without a descriptor to wake
    on (``LoadManager.peer_transfers``): on the producer, blocks offered and
    held for a READ; on the consumer, a load the producer may be WRITing,
    also once aborted (over UCX's TCP transport both move only as the
    other side progresses)."""
    net = make_net()
    a, b = net.engines["a"].manager, net.engines["b"].manager
    assert not a.peer_transfers() and not b.peer_transfers()
    probe(net, "r1", "kv1")
    assert a.peer_transfers()  # offered pins, held for b's READ
    b.on_request_finished("r1", net.now)  # released unread
    net.run()
    assert not a.peer_transfers()
    net = make_net(reads=False)
    a, b = net.engines["a"].manager, net.engines["b"].manager
    probe(net, "r1", "kv1")
    assert not a.peer_transfers()  # nothing offered: a will WRITE
    net.hold_writes = True
    load(net, "r1", SLOTS)
    net.run(2)
    assert b.peer_transfers()  # the Fetch sent, the WRITE awaited
    b.on_request_finished("r1", net.now)
    net.run(1)
    assert b.peer_transfers()  # aborting: the WRITE may still be moving
    net.hold_writes = False
    net.run()
    collect_all(net)
    assert not b.peer_transfers()


def test_a_read_of_more_blocks_than_a_frame_counts_is_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_KEYS blocks (lookups go in several frames) the READ's
    Release carried a count the peer's decoder refuses: the frame was
    dropped, and the peer held every pin to its deadline."""
    from p2p_kv.protocol import MAX_KEYS

    from . import memnet

    n = MAX_KEYS + 1
    monkeypatch.setattr(memnet, "NBLOCKS", n + 8)
    net = Net()
    a, b = net.engines["a"], net.engines["b"]
    keys = [key(i) for i in range(n)]
    for i, k in enumerate(keys):
        a.put(k, i)
    b.manager.on_new_request("r1", net.roles("a", "kv1"), net.now)
    for k in keys:
        b.manager.lookup("r1", k)
    net.run()
    assert all(b.manager.lookup("r1", k) is Answer.HIT for k in keys)
    job = load(net, "r1", list(range(n)), keys)
    net.run()
    collect_all(net)
    (result,) = b.results[job]
    assert result.success
    assert not any(a.pin_count.values()), "the pins outlived the Release"
    assert a.manager.protocol_errors == {}
    b.manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_fetch_is_kept_only_until_it_is_sent() -> None:
    """A load's Fetch holds its keys and slots: a load in flight keeps it
    only while the handshake has not ended, never after it is sent."""
    net = make_net(reads=False)
    b = net.engines["b"].manager
    b.on_new_request("d1", net.roles("a", "kv9", probe=False), net.now)
    assert b.lookup("d1", KEYS[0]) is Answer.HIT
    load(net, "d1", SLOTS)  # before any handshake: queued with its Fetch
    (queued,) = list(session(net, "b").loads())
    assert queued.state is State.QUEUED and queued.fetch is not None
    net.run()
    assert queued.state is State.FETCH_POSTED and queued.fetch is None
    probe(net, "r2", "kv1")
    load(net, "r2", [40, 41, 42, 43])  # session ready: sent at once
    posted = [ld for ld in session(net, "b").loads() if ld.req == "kv1"]
    assert [ld.fetch for ld in posted] == [None]


def test_an_expired_offer_falls_back_to_fetch() -> None:
    timeouts = Timeouts(pin_ttl_s=1.0)
    net = make_net(timeouts=timeouts)
    probe(net, "r1", "kv1")
    net.advance(0.8)  # past 0.75 of the pin lifetime: the offer is gone
    net.run(1)
    assert session(net, "b").sizes()["offers"] == 0
    load(net, "r1", SLOTS)
    net.step(deliver=False)
    assert sent(net, "b") == ["Fetch"]


def test_pins_are_held_at_least_as_long_as_the_offer_announces() -> None:
    """Offers announce whole milliseconds, one at least: a pin lifetime
    under 1 ms was announced as 1 ms, and the pins released before it."""
    net = make_net(timeouts=Timeouts(pin_ttl_s=0.0004))
    probe(net, "r1", "kv1")
    (offer,) = [
        g.offer for g in session(net, "b").consumer.lookups.gens.values() if g.offer
    ]
    (serve,) = session(net, "a").serves()
    assert offer.valid_until > net.now  # an offer was made and trusted
    assert serve.deadline >= net.now + 0.001


def test_a_fetch_after_the_pins_lifetime_fails_at_once() -> None:
    # The request was scheduled after the producer's pins ended: only they
    # could have served this Fetch, and the producer says so at once
    # instead of waiting for parked stores that will never come (the
    # consumer sat out its 2 s fetch deadline before).
    timeouts = Timeouts(pin_ttl_s=1.0)
    net = make_net(timeouts=timeouts)
    probe(net, "r1", "kv1")
    wait(net, 1.5)  # the producer's pins end with their lifetime
    assert session(net, "a").producer.pinned_blocks == 0
    job = load(net, "r1", SLOTS)
    net.run()
    (result,) = net.engines["b"].collect(net.now)
    assert (result.job_id, result.success) == (job, False)
    assert result.reason == "peer: not pinned"
    assert session(net, "a").link.counters.failures == {"fetch_not_pinned": 1}
    net.engines["b"].manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_read_that_ends_after_its_window_fails_even_with_whole_bytes() -> None:
    timeouts = Timeouts(pin_ttl_s=1.0, fetch_floor_s=10.0)
    net = make_net(timeouts=timeouts)
    probe(net, "r1", "kv1")
    b, a = net.engines["b"], net.engines["a"]
    net.hold_writes = True
    job = load(net, "r1", SLOTS)
    net.step(deliver=False)
    assert load_state(net) is State.READING
    # The consumer stalls in a long step while the producer's pins expire
    # and its engine takes the slots back; then the read completes.
    net.advance(1.2)
    a.manager.tick(net.now)
    a.manager.end_step(net.now)
    a.collect(net.now)
    assert not a.pin_count
    net.complete_writes()
    assert b.block(SLOTS[0]) == POISON  # what a late read can see
    (result,) = b.collect(net.now)
    assert result.job_id == job and not result.success
    assert session(net, "b").link.counters.failures == {"read_late": 1}
    assert b.manager.requests.failed_ids() == {"r1"}  # still live: recompute it


def test_abort_mid_read_keeps_slots_fenced_until_the_read_ends() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    b = net.engines["b"]
    net.hold_writes = True
    job = load(net, "r1", SLOTS)
    net.run(1)
    b.manager.on_request_finished("r1", net.now)
    net.run(3)  # the Abort reaches the producer, which releases its pins
    assert load_state(net) is State.READ_CANCELLING
    assert b.collect(net.now) == []
    assert b.manager.state_report()["fenced_slots"] == 4
    assert net.reads, "the cancelled read is still in flight"
    net.hold_writes = False
    net.run()
    assert [(r.job_id, r.success) for r in b.collect(net.now)] == [(job, False)]
    assert b.manager.requests.failed_ids() == frozenset()
    collect_all(net)
    assert_drained(net)
    assert not net.violations


def test_a_stuck_read_drops_the_peer_before_its_slots_come_back() -> None:
    timeouts = Timeouts(pin_ttl_s=1.0, fetch_floor_s=10.0, abort_ack_s=0.5)
    net = make_net(timeouts=timeouts)
    probe(net, "r1", "kv1")
    b = net.engines["b"]
    net.hold_writes = True
    job = load(net, "r1", SLOTS)
    net.run(1)
    net.advance(0.8)  # the read window closes: cancel, wait for the end
    net.run(1)
    assert load_state(net) is State.READ_CANCELLING
    assert b.collect(net.now) == []
    net.advance(0.6)  # no end in time: the session closes the peer
    net.run(3)
    # The data plane dropped the peer (memnet ends its reads, failed).
    assert net.reads == []
    assert [(r.job_id, r.success) for r in b.collect(net.now)] == [(job, False)]
    assert not net.violations


def test_only_our_data_plane_ends_a_read() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    net.hold_writes = True
    job = load(net, "r1", SLOTS)
    net.run(1)
    s = session(net, "b")
    (ld,) = list(s.loads())
    gen = ld.gen
    s.receive(TransferDone("kv1", gen, job, True), net.now)
    assert load_state(net) is State.READING
    assert s.link.counters.protocol_errors == {"stale_transfer_done": 1}
    net.hold_writes = False
    net.run()
    assert [r.success for r in net.engines["b"].collect(net.now)] == [True]


def test_reset_revokes_offered_pins_and_waits_for_the_release() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    a, b = net.engines["a"], net.engines["b"]
    a.manager.release_for_reset(net.now)
    (serve,) = list(session(net, "a").serves())
    assert serve.state is State.REVOKING and a.pin_count  # still held
    net.step(deliver=False)
    assert "Revoke" in sent(net, "a")
    net.run()
    collect_all(net)
    assert list(session(net, "a").serves()) == [] and not a.pin_count
    # The consumer will not wait on pins that are gone: it fails at once.
    job = load(net, "r1", SLOTS)
    net.step(deliver=False)
    assert "Fetch" not in sent(net, "b")
    assert [(r.job_id, r.success) for r in b.collect(net.now)] == [(job, False)]
    b.manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_read_in_flight_survives_a_revoke_and_releases_after() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    a, b = net.engines["a"], net.engines["b"]
    net.hold_writes = True
    job = load(net, "r1", SLOTS)
    net.run(1)
    a.manager.release_for_reset(net.now)
    net.run(3)  # Revoke delivered; the read still runs, so no Release yet
    assert a.pin_count
    net.hold_writes = False
    net.run()
    assert [(r.job_id, r.success) for r in b.collect(net.now)] == [(job, True)]
    assert [b.block(s) for s in SLOTS] == [payload(k) for k in KEYS]
    collect_all(net)
    assert not a.pin_count
    b.manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_offer_outside_the_peer_region_is_ignored() -> None:
    net = make_net()
    probe(net, "r0", "kv0", [key(50)])  # the handshake
    b = net.engines["b"].manager
    b.on_new_request("r1", net.roles("a", "kv1"), net.now)
    b.lookup("r1", KEYS[0])
    net.step()  # the Lookup reaches the producer
    net.serve()
    net.step(deliver=False)  # its answer is queued
    # Rewrite the producer's answer to point past its region.
    (item,) = [i for i in net.queue if isinstance(decode(i[2]), LookupResp)]
    resp = decode(item[2])
    assert isinstance(resp, LookupResp) and resp.slots
    bad = LookupResp(resp.req, resp.gen, resp.seq, resp.hits, [10**6], resp.ttl_ms)
    net.queue[net.queue.index(item)] = (item[0], item[1], encode(bad))
    net.deliver_all()
    s_b = session(net, "b")
    assert s_b.link.counters.protocol_errors == {"offer_out_of_range": 1}
    assert s_b.sizes()["offers"] == 0
    load(net, "r1", [3], [KEYS[0]])
    net.step(deliver=False)
    assert sent(net, "b") == ["Fetch"]  # the producer checks its own range


def test_release_and_revoke_from_a_stranger_change_nothing() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    a = session(net, "a")
    (serve,) = list(a.serves())
    a.receive(Release("kv1", serve.gen + 1, 4), net.now)  # another generation
    a.receive(Release("other", serve.gen, 4), net.now)  # another request
    assert list(a.serves()) == [serve] and serve.state is State.PINNED
    b = session(net, "b")
    b.receive(Revoke("kv1", serve.gen + 7), net.now)
    assert b.sizes()["revoked"] == 0 and b.sizes()["offers"] == 1
    # A Release in the middle of a write is refused, the write goes on.
    net2 = make_net(reads=False)
    probe(net2, "r1", "kv1")
    net2.hold_writes = True
    load(net2, "r1", SLOTS)
    net2.run(2)
    a2 = session(net2, "a")
    (serve2,) = list(a2.serves())
    assert serve2.state is State.WRITING
    a2.receive(Release("kv1", serve2.gen, 4), net2.now)
    assert serve2.state is State.WRITING
    assert a2.link.counters.protocol_errors == {"illegal": 1}


def test_a_second_load_of_one_request_fails_at_once() -> None:
    """One load per generation: its end releases every pin of the request,
    so a second job could only read (or be written) from slots that are no
    longer held. It fails at once; the first job's bytes are right."""
    for reads in (True, False):
        net = make_net(reads=reads)
        probe(net, "r1", "kv1")
        b = net.engines["b"]
        net.hold_writes = True
        j1 = load(net, "r1", [5, 6], KEYS[:2])
        b.expect[j1] = (KEYS[:2], [5, 6])
        net.step()
        j2 = load(net, "r1", [7, 30], KEYS[2:])
        b.expect[j2] = (KEYS[2:], [7, 30])
        assert [(r.job_id, r.success, r.reason) for r in b.collect(net.now)] == [
            (j2, False, "second_load")  # the reason the runtime logs
        ]
        net.hold_writes = False
        net.run()
        assert [(r.job_id, r.success, r.reason) for r in b.collect(net.now)] == [
            (j1, True, "")
        ]
        assert not b.wrong_bytes and not net.violations
        b.manager.on_request_finished("r1", net.now)
        net.run()
        collect_all(net)
        assert_drained(net)


def test_a_late_answer_after_our_release_offers_nothing() -> None:
    """A second lookup batch answered after our READ released the request's
    pins must not become an offer: those pins go with the Release."""
    net = make_net()
    b = net.engines["b"]
    bm = b.manager
    bm.on_new_request("r1", net.roles("a", "kv1"), net.now)
    for k in KEYS[:2]:
        bm.lookup("r1", k)
    net.run()
    for k in KEYS[2:]:
        bm.lookup("r1", k)  # a second batch, still unanswered
    net.hold_writes = True
    load(net, "r1", [5, 6], KEYS[:2])
    net.step(deliver=False)  # the second Lookup and the READ leave
    net.complete_writes()  # the READ ends: Release, no offer kept
    net.deliver_all()
    net.serve()
    net.run()
    s = session(net, "b")
    assert s.sizes()["offers"] == 0
    b.collect(net.now)
    bm.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


@pytest.mark.parametrize("how", ["abort", "timeout"])
def test_a_read_given_up_before_it_was_posted_fails_at_once(how: str) -> None:
    """READ_QUEUED: the data plane has not seen the READ, so nothing can
    land; giving it up fails the load at once, drops its order and
    releases the peer's pins (no Abort round trip)."""
    net = make_net(timeouts=Timeouts(pin_ttl_s=1.0, fetch_floor_s=10.0))
    probe(net, "r1", "kv1")
    b = net.engines["b"]
    job = load(net, "r1", SLOTS)
    assert load_state(net) is State.READ_QUEUED
    if how == "abort":  # vLLM finishes the request before the post
        b.manager.on_request_finished("r1", net.now)
    else:  # the engine stalls past the read window before the post
        net.advance(0.8)
        b.manager.tick(net.now)
    results = b.collect(net.now)
    assert [(r.job_id, r.success, r.reason) for r in results] == [(job, False, how)]
    assert session(net, "b").sizes()["loads"] == 0
    # Counted once, as an abort in flight is (an unposted abort was not).
    assert session(net, "b").link.counters.failures == {how: 1}
    net.step(deliver=False)
    assert net.reads == [], "a given-up READ reached the data plane"
    assert sent(net, "b") == ["Release"]
    net.run()
    if how == "timeout":  # still live: recomputed, then finished
        assert b.manager.requests.failed_ids() == {"r1"}
        b.manager.on_request_finished("r1", net.now)
    assert b.manager.requests.failed_ids() == frozenset()
    collect_all(net)
    assert_drained(net)


def test_a_release_answers_lookups_still_queued() -> None:
    """The consumer's Release reaches a serve with a lookup queued for the
    serve window: the lookup is answered (all miss), not dropped."""
    net = make_net()
    probe(net, "r1", "kv1")
    (serve,) = list(session(net, "a").serves())
    sa = session(net, "a")
    sa.receive(Lookup("kv1", serve.gen, 99, [key(77)]), net.now)
    assert serve.state is State.LOOKUP_QUEUED
    sa.receive(Release("kv1", serve.gen, 0), net.now)
    assert list(sa.serves()) == []
    answers = [m for m in sa.take_outbox(net.now) if isinstance(m, LookupResp)]
    assert [(m.seq, m.hits) for m in answers] == [(99, [False])]


def test_pins_alone_ask_for_no_engine_steps() -> None:
    """A producer holding pins (or orphaned ones) needs no engine steps:
    their end comes from a message or a deadline that the poll handles."""
    net = make_net()
    probe(net, "r1", "kv1")
    a = net.engines["a"].manager
    assert session(net, "a").producer.pinned_blocks == 4
    assert not a.has_pending_work()
