"""Disaggregated prefill: parked stores, the decoder's Fetch, their
deadlines, and cache resets while they wait (pure core, in memory)."""

from __future__ import annotations

import msgspec
import pytest

from p2p_kv.node.manager import Answer
from p2p_kv.node.roles import Roles
from p2p_kv.node.timers import LateFetchDue
from p2p_kv.peer import Timeouts
from p2p_kv.protocol import Fetch, FetchOffer, decode, encode

from .memnet import Net, key, payload
from .scenarios import (
    KEYS,
    assert_drained,
    collect_all,
    load,
    make_net,
    pd_load,
    probe,
    until_read_posted,
    wait,
)


def test_disaggregated_prefill_in_both_orders() -> None:
    for producer_finishes_first in (True, False):
        net = Net()
        a, b = net.engines["a"], net.engines["b"]
        a.manager.on_new_request(
            "p1", Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}}), net.now
        )
        store_job = a.new_job()
        a.store(store_job, "p1", KEYS, [20, 21, 22, 23], net.now)
        for k, s in zip(KEYS, [20, 21, 22, 23], strict=True):
            a.region[s * 16 : (s + 1) * 16] = payload(k)
        if producer_finishes_first:
            a.manager.on_request_finished("p1", net.now)
        b.manager.on_new_request("d1", net.roles("a", "kv9", probe=False), net.now)
        assert b.manager.lookup("d1", KEYS[0]) is Answer.HIT
        job = load(net, "d1", [40, 41, 42, 43])
        net.run()
        if not producer_finishes_first:
            a.manager.on_request_finished("p1", net.now)
        net.run()
        collect_all(net)
        assert b.results[job][0].success
        assert [b.block(s) for s in (40, 41, 42, 43)] == [payload(k) for k in KEYS]
        assert a.results[store_job][0].success
        b.manager.on_request_finished("d1", net.now)
        net.run()
        collect_all(net)
        assert_drained(net)


def test_parked_store_expires_when_nobody_fetches() -> None:
    net = Net()
    a = net.engines["a"]
    a.manager.settings.parked_ttl_s = 1.0
    a.manager.on_new_request(
        "p1", Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}}), net.now
    )
    job = a.new_job()
    a.store(job, "p1", KEYS, [1, 2, 3, 4], net.now)
    a.manager.on_request_finished("p1", net.now)
    wait(net, 1.2)
    collect_all(net)
    assert a.results[job][0].success is False
    assert_drained(net)


def test_a_fetch_after_its_producer_ended_with_nothing_parked_fails_at_once() -> None:
    """vLLM ends a request at the tier after its last store, so a
    ``remote_decoder`` request that ended with nothing parked will never
    park anything. Its entry went with it, and the decoder's Fetch arriving
    then waited for stores until its deadline (2 s and more), keeping the
    idle producer stepping meanwhile; it fails after a short grace now. A
    new producer request for the same id within the grace (a retry whose
    decoder was quicker) still serves it."""
    net = make_net()
    a, b = net.engines["a"], net.engines["b"]
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kvW"}})
    a.manager.on_new_request("p1", dec, net.now)
    a.manager.on_request_finished("p1", net.now)  # nothing was stored
    result = pd_load(net, "d1", "kvW", [1, 2, 3, 4])
    assert not result.success and net.now < 1.5, (result, net.now)
    b.manager.on_request_finished("d1", net.now)
    # A retry under the same id whose decoder is quicker than its producer.
    b.manager.on_new_request("d2", net.roles("a", "kvW", probe=False), net.now)
    job = load(net, "d2", [1, 2, 3, 4])
    net.run()
    wait(net, 0.5)
    a.manager.on_new_request("p2", dec, net.now)
    wait(net, 1.0)  # past the grace: waiting on the live producer now
    collect_all(net)
    assert job not in b.results
    store = a.new_job()
    a.store(store, "p2", KEYS, [20, 21, 22, 23], net.now)
    a.manager.on_request_finished("p2", net.now)
    net.run()
    collect_all(net)
    assert b.results[job][0].success
    b.manager.on_request_finished("d2", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_each_fetch_after_its_producer_ended_gets_its_own_grace() -> None:
    """A first Fetch, aborted inside its grace, left its timer behind; when
    it fired it ended the grace of a later Fetch of the same id, whose
    retried producer, coming inside that later grace, found it refused."""
    net = make_net(timeouts=Timeouts(fetch_floor_s=5.0))
    a, b = net.engines["a"], net.engines["b"]
    probe(net, "r0", "kv0")  # the session is up: each Fetch reaches a at once
    b.manager.on_request_finished("r0", net.now)
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kvW"}})
    a.manager.on_new_request("p1", dec, net.now)
    a.manager.on_request_finished("p1", net.now)  # nothing was stored
    b.manager.on_new_request("d1", net.roles("a", "kvW", probe=False), net.now)
    load(net, "d1", [1, 2, 3, 4])
    net.run(2)
    late = [t for _, t in a.manager.timers.pending() if isinstance(t, LateFetchDue)]
    assert len(late) == 1  # d1's Fetch waits at a
    start = net.now
    b.manager.on_request_finished("d1", net.now)
    net.run()
    wait(net, 0.6)
    b.manager.on_new_request("d2", net.roles("a", "kvW", probe=False), net.now)
    job = load(net, "d2", [5, 6, 7, 8])
    net.run(2)
    wait(net, 1.2 - (net.now - start))  # past d1's grace, inside d2's
    collect_all(net)
    assert job not in b.results, b.results[job]
    a.manager.on_new_request("p2", dec, net.now)  # the retried producer
    park_then_load(net, "p2", "d2", job)


def test_a_fetch_naming_none_of_the_parked_blocks_leaves_them_to_the_decoder() -> None:
    """Another peer's parked Fetch under the same kv id, for a block never
    stored: it took every store, failed them when the producer ended, and
    the decoder they were parked for recomputed."""
    net = make_net(names=("a", "b", "c"))
    a, b, c = (net.engines[n] for n in "abc")
    c.manager.on_new_request("c0", net.roles("a", "kvC"), net.now)
    net.run()  # c's session to a is up
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}})
    a.manager.on_new_request("p1", dec, net.now)
    a.store(a.new_job(), "p1", KEYS, [20, 21, 22, 23], net.now)
    (cs,) = c.manager.sessions()
    stranger = Fetch("kv9", 999, 1, [key(77)], [1], parked=True, read=True)
    cs.link.send(stranger)
    c.manager._touch(cs)
    net.run(1)
    a.manager.on_request_finished("p1", net.now)
    net.run()
    collect_all(net)  # the stranger's Fetch failed: "blocks not stored"
    assert a.manager.parked_store_count() == 1
    result = pd_load(net, "d1", "kv9", [1, 2, 3, 4])
    assert result.success, result
    for m, req in ((b.manager, "d1"), (c.manager, "c0")):
        m.on_request_finished(req, net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_producer_id_reused_live_keeps_the_decoders_fetch_waiting() -> None:
    """vLLM reuses a live prefill's id for the same kv id: ending the old
    request left no live producer for a moment, and the decoder's waiting
    Fetch was refused just before the new request parked its stores."""
    net = make_net()
    a, b = net.engines["a"], net.engines["b"]
    probe(net, "r0", "kv0")  # the session is up: the Fetch waits at a now
    b.manager.on_request_finished("r0", net.now)
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}})
    a.manager.on_new_request("p1", dec, net.now)
    b.manager.on_new_request("d1", net.roles("a", "kv9", probe=False), net.now)
    job = load(net, "d1", [1, 2, 3, 4])
    net.run(2)
    assert a.manager.on_new_request("p1", dec, net.now) is True
    net.run(1)
    park_then_load(net, "p1", "d1", job)


def test_a_retry_after_a_decoder_took_the_stores_fails_after_the_grace() -> None:
    """A producer that ended with its stores parked, read by a first
    decoder: a second Fetch under that id (a decoder's retry) waited out
    its own deadline (2 s and the bytes' share) for stores no producer
    would park; it fails after the short grace now."""
    net = make_net()
    a, b = net.engines["a"], net.engines["b"]
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kvW"}})
    a.manager.on_new_request("p1", dec, net.now)
    a.store(a.new_job(), "p1", KEYS, [20, 21, 22, 23], net.now)
    a.manager.on_request_finished("p1", net.now)
    assert pd_load(net, "d1", "kvW", [1, 2, 3, 4]).success
    b.manager.on_request_finished("d1", net.now)
    net.run()
    start = net.now
    assert not pd_load(net, "d2", "kvW", [5, 6, 7, 8]).success
    assert net.now - start < 1.5, net.now - start
    b.manager.on_request_finished("d2", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def parked_fetch(net: Net, kv_id: str = "kv9") -> int:
    """A finished ``remote_decoder`` request on a with its four blocks
    parked, and a decoder request on b whose load of them is submitted."""
    a, b = net.engines["a"], net.engines["b"]
    dec = Roles.parse({"remote_decoder": {"kv_request_id": kv_id}})
    a.manager.on_new_request("p1", dec, net.now)
    a.store(a.new_job(), "p1", KEYS, [20, 21, 22, 23], net.now)
    a.manager.on_request_finished("p1", net.now)
    b.manager.on_new_request("d1", net.roles("a", kv_id, probe=False), net.now)
    assert b.manager.lookup("d1", KEYS[0]) is Answer.HIT
    return load(net, "d1", [40, 41, 42, 43])


def park_then_load(net: Net, producer: str, decoder: str, job: int) -> None:
    """a's ``producer`` request parks the four blocks and ends; b's
    ``decoder`` request's waiting load ``job`` then succeeds, the decoder
    ends, and nothing is left on either side."""
    a, b = net.engines["a"], net.engines["b"]
    a.store(a.new_job(), producer, KEYS, [20, 21, 22, 23], net.now)
    a.manager.on_request_finished(producer, net.now)
    net.run()
    collect_all(net)
    assert [r.success for r in b.results[job]] == [True]
    b.manager.on_request_finished(decoder, net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def finish_and_drain(net: Net, req: str = "d1") -> None:
    net.engines["b"].manager.on_request_finished(req, net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


@pytest.mark.parametrize(
    ("reads", "producer_reads"), [(True, True), (False, False), (True, False)]
)
def test_a_decoder_reads_parked_stores_so_no_producer_write_reaches_its_slots(
    reads: bool, producer_reads: bool
) -> None:
    """The write path's fence is the producer's word or its death: a
    producer that stalled past the ack deadline and resumed could still
    write slots the decoder had given back (CMA writes from the producer's
    own process). A decoder that reads asks for an offer instead, and
    nothing of the producer's is ever posted toward its slots. A producer
    with ``read_path: false`` offers nothing: it writes, as before."""
    net = Net(reads=reads)
    a, b = net.engines["a"], net.engines["b"]
    a.manager.settings.reads = producer_reads
    reads = reads and producer_reads
    job = parked_fetch(net)
    net.hold_writes = True
    posted: list[str] = []
    for _ in range(8):
        net.run(1)
        posted += [f"write {o.ref.ident}" for _, _, o in net.writes]
        posted += [f"read {o.ref.ident}" for _, _, o in net.reads]
    assert posted and all(p.startswith("read" if reads else "write") for p in posted)
    net.hold_writes = False
    net.run()
    collect_all(net)
    assert b.results[job][0].success
    assert [b.block(s) for s in (40, 41, 42, 43)] == [payload(k) for k in KEYS]
    (store,) = [r for rs in a.results.values() for r in rs]
    assert store.success  # served: by the decoder's READ or our WRITE
    (session,) = b.manager.sessions()
    assert session.link.counters.loads_fetched == 1
    assert session.link.counters.loads_written == (0 if reads else 1)
    finish_and_drain(net)


def test_an_offer_with_no_time_left_to_read_recomputes_and_frees_the_stores() -> None:
    """The decoder trusts an offer for the producer's hold counted from
    when its Fetch left (the hold starts later). Stores parked so late that
    the window cannot fit the READ: the load fails at once (nothing was
    posted) and the Release frees the stores, not their TTL."""
    net = Net(timeouts=Timeouts(pin_ttl_s=1.0))
    a, b = net.engines["a"], net.engines["b"]
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}})
    a.manager.on_new_request("p1", dec, net.now)
    b.manager.on_new_request("d1", net.roles("a", "kv9", probe=False), net.now)
    job = load(net, "d1", [40, 41, 42, 43])
    net.run()
    wait(net, 0.8)  # past 0.75 x 1 s since the Fetch left
    store = a.new_job()
    a.store(store, "p1", KEYS, [20, 21, 22, 23], net.now)
    a.manager.on_request_finished("p1", net.now)
    net.run(3)
    collect_all(net)
    (result,) = b.results[job]
    assert (result.success, result.reason) == (False, "offer_too_late")
    assert a.results[store][0].success is False  # released, not expired
    assert net.now < 1.5
    finish_and_drain(net)


def test_an_abort_crossing_the_offer_is_acked_and_nothing_is_read() -> None:
    net = Net()
    b = net.engines["b"]
    job = parked_fetch(net)
    for _ in range(10):  # up to the Fetch leaving b
        net.step(deliver=False)
        if any(isinstance(decode(f), Fetch) for _, _, f in net.queue):
            break
        net.deliver_all()
        net.serve()
    net.deliver_all()  # a binds the stores: its offer leaves at its next step
    b.manager.on_request_finished("d1", net.now)  # the Abort crosses it
    net.run()
    collect_all(net)
    (result,) = b.results[job]
    assert (result.success, result.reason) == (False, "abort")
    (session,) = b.manager.sessions()
    assert session.link.counters.protocol_errors == {"stale_fetch_offer": 1}
    assert not net.reads and not b.manager.state_report()["fenced_slots"]
    assert_drained(net)


def test_a_bad_fetch_offer_fails_its_load_as_such_not_as_an_abort() -> None:
    """An offer of 2 slots for 4 keys: the load ends through the peer's
    AbortAck (the fence), and was counted and reported as ``abort``."""
    net = Net()
    b = net.engines["b"]
    job = parked_fetch(net)
    for _ in range(10):
        net.step(deliver=False)
        frames = [(e, p, decode(f)) for e, p, f in net.queue]
        offers = [m for _, _, m in frames if isinstance(m, FetchOffer)]
        if offers:
            break
        net.deliver_all()
        net.serve()
    (offer,) = offers
    net.queue = [
        (
            e,
            p,
            encode(msgspec.structs.replace(m, slots=m.slots[:2]) if m is offer else m),
        )
        for e, p, m in frames
    ]
    net.run()
    collect_all(net)
    assert [(r.success, r.reason) for r in b.results[job]] == [
        (False, "bad_fetch_offer")
    ]
    (session,) = b.manager.sessions()
    assert session.link.counters.failures == {"bad_fetch_offer": 1}
    assert session.link.counters.protocol_errors == {"bad_fetch_offer": 1}
    assert not net.reads and b.manager.requests.failed_ids() == {"d1"}  # recomputes
    b.manager.on_request_finished("d1", net.now)
    net.run()
    assert_drained(net)


def test_a_finished_producer_is_forgotten_at_its_ttl_without_another() -> None:
    """Finished producers (for a retry's Fetch) were purged only when
    another producer finished: an engine whose last one finished kept
    them past their TTL for as long as it ran."""
    net = Net()
    a = net.engines["a"].manager
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}})
    a.on_new_request("p1", dec, net.now)
    a.on_request_finished("p1", net.now)
    assert list(a.parked.finished) == ["kv9"]
    wait(net, a.settings.parked_ttl_s + 0.5, dt=0.5)
    assert a.parked.finished == {}


def test_offered_parked_stores_outlive_a_lost_session_to_their_deadline() -> None:
    """As offered pins: the decoder may still be READing when the session
    drops, so the stores stay held (orphaned) until the hold's end."""
    net = Net(timeouts=Timeouts(pin_ttl_s=2.0))
    a = net.engines["a"]
    parked_fetch(net)
    until_read_posted(net)
    net.cut("a", "b")
    net.run(1)
    collect_all(net)
    assert a.manager.state_report()["orphaned_blocks"] == 4
    assert not a.results  # the store is still held
    net.hold_writes = False
    wait(net, 2.2)
    collect_all(net)
    (store,) = [r for rs in a.results.values() for r in rs]
    assert not store.success  # not known to be served
    assert a.manager.state_report()["orphaned_blocks"] == 0
    finish_and_drain(net)


def test_a_second_fetch_cannot_hold_offered_stores_longer() -> None:
    """One Fetch per serve: a second read Fetch for the same request used
    to offer the stores again, re-arming their hold, so a peer repeating
    it held parked stores for good (they do not count against the pinned
    blocks bound); or, had its first READ released them meanwhile, read
    them after their release. It is refused as a duplicate now."""
    net = Net(timeouts=Timeouts(pin_ttl_s=2.0))
    a = net.engines["a"]
    parked_fetch(net)
    until_read_posted(net)
    (sa,) = a.manager.sessions()
    ((req, gen), serve) = next(iter(sa.producer._serves.items()))
    held_until = serve.deadline
    net.advance(1.0)
    again = Fetch(req, gen, 999, KEYS, [60, 61, 62, 63], read=True)
    a.manager.receive_frame(sa.peer, encode(again), net.now)
    assert sa.link.counters.protocol_errors == {"duplicate_fetch": 1}
    assert serve.deadline == held_until
    net.hold_writes = False
    net.run()
    collect_all(net)
    finish_and_drain(net)


@pytest.mark.parametrize("pd", [True, False])
def test_a_load_too_large_for_the_bare_pin_lifetime_is_still_read(pd: bool) -> None:
    """An offer's hold grows with the READ it is for: held for the bare pin
    lifetime, a load whose READ takes longer than the reader's share of it
    (0.75 x 1.2 s here, a 1 s READ) could never be read, where the write
    path used to load it."""
    slow = Timeouts(pin_ttl_s=1.2, fetch_bytes_per_s=64.0)  # 4 blocks: 1 s
    if pd:
        net = Net(timeouts=slow)
        job = parked_fetch(net)
    else:
        net = make_net(timeouts=slow)
        assert probe(net, "r1", "kv1") == [Answer.HIT] * 4
        job = load(net, "r1", [5, 6, 7, 8])
    until_read_posted(net)
    net.advance(1.0)  # the READ takes its time
    net.hold_writes = False
    net.run()
    b = net.engines["b"]
    collect_all(net)
    (result,) = b.results[job]
    assert result.success, result
    b.manager.on_request_finished("d1" if pd else "r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_cache_resets_drain_outlasts_a_dead_readers_large_offer() -> None:
    """An offer's hold grows with the READ's bytes (the pin lifetime plus
    the READ's time over the reader's share). A reader that dies mid-READ
    leaves the stores held to the hold's end, and a cache reset on the
    producer drains until then: its fixed 30 s bound gave up first, and
    vLLM's reset asserted that no job was left."""
    net = Net(timeouts=Timeouts(fetch_bytes_per_s=1.0))  # 64 bytes: 64 s
    a = net.engines["a"]
    parked_fetch(net)
    until_read_posted(net)
    net.cut("a", "b")  # the decoder dies mid-READ: the offer is orphaned
    net.run(1)
    a.manager.release_for_reset(net.now)
    reset_at = net.now
    give_up = a.manager.drain_deadline(reset_at)
    hold = 15.0 + 64 / 0.75
    assert hold - 1.0 < give_up - reset_at < hold + 2.0 + 5.0 + 1.0  # + a cancel
    while a.manager.jobs_unended(net.now) and net.now < give_up:
        net.advance(0.5)
        net.step()
        a.collect(net.now)
    assert a.manager.jobs_unended(net.now) == 0, net.now - reset_at
    (store,) = [r for rs in a.results.values() for r in rs]
    assert not store.success
    assert net.now - reset_at > 30.0  # where the old bound gave up


def test_a_cache_resets_drain_waits_for_no_store_it_released() -> None:
    """Stores a reset ends leave their expiry behind in the parked heap;
    counted, each stretched the drain's bound to its TTL (and an endless
    TTL to forever) though no job was left."""
    net = Net()
    a = net.engines["a"]
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}})
    a.manager.on_new_request("p1", dec, net.now)
    a.store(a.new_job(), "p1", KEYS, [20, 21, 22, 23], net.now)
    a.manager.on_request_finished("p1", net.now)
    ttl = a.manager.settings.parked_ttl_s  # 60 s: parked, the store is a job till then
    assert a.manager.drain_deadline(net.now) > net.now + ttl
    a.manager.release_for_reset(net.now)
    assert a.manager.jobs_unended(net.now) == 0
    assert a.manager.drain_deadline(net.now) == net.now + 30.0


def test_a_cache_reset_during_a_decoders_read_holds_the_stores_until_it_ends() -> None:
    """Offered parked stores are revoked, not released, by a reset: the
    decoder may be READing them. Released at once, they went back to the
    engine under the running READ (wrong bytes in a successful load)."""
    net = Net()
    a, b = net.engines["a"], net.engines["b"]
    job = parked_fetch(net)
    until_read_posted(net)
    a.manager.release_for_reset(net.now)
    net.run(1)
    collect_all(net)
    assert not a.results  # the store is held while the READ may run
    # (memnet READs poison from a slot the engine holds no job for.)
    net.hold_writes = False
    net.run()
    collect_all(net)
    assert b.results[job][0].success
    assert [b.block(s) for s in (40, 41, 42, 43)] == [payload(k) for k in KEYS]
    finish_and_drain(net)


def _decoder_first(prefill_s: float, live: bool) -> tuple[Net, int, int]:
    """b's decoder asks a for kv9's parked blocks first; a's prefill
    request for kv9 starts (``live``) and parks its stores ``prefill_s``
    later. Returns the net, the decoder's load job and the store job."""
    net = Net(timeouts=Timeouts(heartbeat_interval_s=0.5, parked_wait_s=30.0))
    a, b = net.engines["a"], net.engines["b"]
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}})
    b.manager.on_new_request("d1", net.roles("a", "kv9", probe=False), net.now)
    job = load(net, "d1", [40, 41, 42, 43])
    net.run()
    if live:
        a.manager.on_new_request("p1", dec, net.now)  # the prefill runs
    wait(net, prefill_s)
    if not live:
        a.manager.on_new_request("p1", dec, net.now)
    store_job = a.new_job()
    a.store(store_job, "p1", KEYS, [20, 21, 22, 23], net.now)
    for k, s in zip(KEYS, [20, 21, 22, 23], strict=True):
        a.region[s * 16 : (s + 1) * 16] = payload(k)
    a.manager.on_request_finished("p1", net.now)
    wait(net, 1.0)
    collect_all(net)
    return net, job, store_job


@pytest.mark.parametrize("live", [True, False])
def test_a_decoder_that_asked_first_loads_its_prefill(live: bool) -> None:
    """The Fetch arrives before the prefill parks anything, while the
    prefill's request is live at the producer (``live``) or before it was
    admitted there (a router sent the decode with the prefill, or the
    prefiller queued it): FetchWait moves the decoder's deadline (2 s) on,
    so a prefill that parks 10 s later is loaded, the right bytes, not
    recomputed; and nothing is left on either side."""
    net, job, store_job = _decoder_first(10.0, live=live)
    a, b = net.engines["a"], net.engines["b"]
    assert b.results[job][0].success, b.results[job]
    assert [b.block(s) for s in (40, 41, 42, 43)] == [payload(k) for k in KEYS]
    assert a.results[store_job][0].success
    b.manager.on_request_finished("d1", net.now)
    wait(net, 1.0)
    collect_all(net)
    assert_drained(net)


def test_a_decoder_waits_no_longer_than_its_parked_ttl_for_a_prefill_never_sent() -> (
    None
):
    """The prefill never comes to the producer (routed elsewhere, or the
    id is a guess): the decoder waits past its fetch deadline for it, but
    not past parked_ttl_s (5 s here), then recomputes; both sides drain."""
    net = Net(timeouts=Timeouts(heartbeat_interval_s=0.5, parked_wait_s=5.0))
    b = net.engines["b"]
    b.manager.on_new_request("d1", net.roles("a", "kv9", probe=False), net.now)
    job = load(net, "d1", [40, 41, 42, 43])
    start = net.now
    while job not in b.results and net.now - start < 20:
        wait(net, 0.5)
        collect_all(net)
    assert not b.results[job][0].success
    assert 4.5 <= net.now - start <= 6.5, net.now - start
    b.manager.on_request_finished("d1", net.now)
    wait(net, 1.0)
    collect_all(net)
    assert_drained(net)


@pytest.mark.parametrize("posted", [True, False])
def test_a_cache_reset_ends_a_fetch_held_for_a_prefill_at_a_fetch_deadline(
    posted: bool,
) -> None:
    """A decoder's Fetch held at the producer (FetchWait) for a prefill
    that may come within parked_ttl_s: at a cache reset it waits at most a
    fetch deadline more (vLLM's drain waits for every load), and FetchWait
    no longer extends it; the load fails, both sides drain. Also for a
    Fetch still queued behind the handshake at the reset (posted after it)."""
    net = Net(timeouts=Timeouts(heartbeat_interval_s=0.5, parked_wait_s=30.0))
    b = net.engines["b"]
    b.manager.on_new_request("d1", net.roles("a", "kv9", probe=False), net.now)
    job = load(net, "d1", [40, 41, 42, 43])
    if posted:
        wait(net, 4.0)  # past its fetch deadline: held there
        collect_all(net)
        assert job not in b.results
    reset = net.now
    b.manager.release_for_reset(net.now)
    while job not in b.results and net.now - reset < 30:
        wait(net, 0.25)
        collect_all(net)
    assert not b.results[job][0].success
    assert (
        net.now - reset <= b.manager.settings.timeouts.fetch_deadline(0.0, 4 * 16) + 0.5
    )
    b.manager.on_request_finished("d1", net.now)
    wait(net, 1.0)
    collect_all(net)
    assert_drained(net)


def test_a_decoder_waits_no_longer_than_its_parked_ttl() -> None:
    """A prefill alive past the decoder's parked_ttl_s: the decoder stops
    waiting at that bound (measured from its load's start)."""
    net = Net(timeouts=Timeouts(heartbeat_interval_s=0.5, parked_wait_s=5.0))
    a, b = net.engines["a"], net.engines["b"]
    b.manager.on_new_request("d1", net.roles("a", "kv9", probe=False), net.now)
    job = load(net, "d1", [40, 41, 42, 43])
    net.run()
    a.manager.on_new_request(
        "p1", Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}}), net.now
    )
    start = net.now
    while job not in b.results and net.now - start < 20:
        wait(net, 0.5)
        collect_all(net)
    assert not b.results[job][0].success
    assert 4.5 <= net.now - start <= 6.5, net.now - start
