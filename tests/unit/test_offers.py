"""Offers and lookups: when a consumer reads what a peer offered, fetches
instead, or recomputes (pure core, in memory)."""

from __future__ import annotations

import pytest

from p2p_kv.lifecycle import State
from p2p_kv.node.manager import Answer
from p2p_kv.peer import Timeouts

from .memnet import FAST_TIMEOUTS, Net, key, payload
from .scenarios import (
    KEYS,
    assert_drained,
    collect_all,
    load,
    make_net,
    probe,
    until_read_posted,
    wait,
)


def test_a_load_too_late_in_its_offer_to_read_is_fetched() -> None:
    """A one-sided READ was chosen however little of the offer's trust
    window was left, and failed at its end (``read_late`` / abort) though
    the producer still held the pins; with no time to READ it all at the
    rate the deadlines assume, the load is a Fetch. The producer answers
    it with a new offer of the pins it still holds, which the consumer
    READs: no WRITE into the consumer's slots."""
    slow = Timeouts(pin_ttl_s=4.0, fetch_bytes_per_s=64.0)  # 4 blocks: 1 s
    for wait_s, path in ((0.5, "read"), (2.5, "fetch")):
        net = make_net(timeouts=slow)
        assert probe(net, "r1", "kv1") == [Answer.HIT] * 4
        wait(net, wait_s)  # the window ends 3 s (75% of 4) after the lookup
        job = load(net, "r1", [5, 6, 7, 8])
        until_read_posted(net)
        net.hold_writes = False
        net.run()
        (result,) = net.engines["b"].collect(net.now)
        assert result.job_id == job and result.success
        (s,) = net.engines["b"].manager.sessions()
        assert (s.link.counters.loads_read, s.link.counters.loads_fetched) == (
            (1, 0) if path == "read" else (0, 1)
        ), path
        net.engines["b"].manager.on_request_finished("r1", net.now)
        net.run()
        collect_all(net)
        assert_drained(net)


def test_a_lookup_sent_after_a_read_fetch_leaves_the_offers_hold_alone() -> None:
    """A key asked in the step of a load leaves in a Lookup after the
    load's Fetch. Served, it took the offered serve back to its lookup
    window, re-armed to the bare pin lifetime: shorter than the offer's
    hold (pin lifetime plus the READ's time), so the producer let the
    blocks go under a READ its consumer still trusted (wrong bytes in a
    successful load). It is answered all-miss and changes nothing."""
    slow = Timeouts(pin_ttl_s=1.2, fetch_floor_s=0.6, fetch_bytes_per_s=64.0)
    net = make_net(timeouts=slow)  # the 4-block READ: 1 s at the deadlines' rate
    a, b = net.engines["a"], net.engines["b"]
    assert probe(net, "r1", "kv1") == [Answer.HIT] * 4
    wait(net, 1.0)  # the lookup's offer window (0.9 s) closed: the load Fetches
    late = key(50)
    assert b.manager.lookup("r1", late) is Answer.RETRY  # asked, not yet sent
    t0 = net.now
    job = load(net, "r1", [5, 6, 7, 8])
    until_read_posted(net)
    (serve,) = next(iter(a.manager.sessions())).serves()
    # Its own state, with no LOOKUP row (PINNED's took it back to the
    # lookup window): the late Lookup is answered all-miss.
    assert serve.state is State.FETCH_OFFERED
    while net.now < t0 + 1.45:  # the READ takes its time
        net.advance(0.05)
        net.run(1)
        a.collect(net.now)
        assert serve.deadline > t0 + 1.6, "the offer's hold was cut short"
    net.hold_writes = False
    net.run()
    collect_all(net)
    (result,) = b.results[job]
    assert result.success and not b.wrong_bytes, (result, b.wrong_bytes)
    assert [b.block(s) for s in (5, 6, 7, 8)] == [payload(k) for k in KEYS]
    assert b.manager.lookup("r1", late) is Answer.MISS
    b.manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_lookup_of_more_keys_than_a_frame_lists_goes_in_several(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Lookup lists at most MAX_KEYS keys (the peer refuses more): one
    step's keys past that went out in one frame, the peer dropped it, and
    the request waited for its lookup deadline to recompute."""
    import p2p_kv.node.consumer_legs as consumer_module
    import p2p_kv.peer.consumer as session_module

    monkeypatch.setattr(consumer_module, "MAX_KEYS", 3)
    monkeypatch.setattr(session_module, "MAX_KEYS", 3)
    net = make_net(reads=False)
    assert probe(net, "r1", "kv1") == [Answer.HIT] * 4
    (session,) = list(net.engines["b"].manager.sessions())
    assert session.link.counters.lookups == 2
    # A Fetch could not list the four: the load fails at once.
    fails_at_once_and_drains(net, load(net, "r1", [5, 6, 7, 8]))


def fails_at_once_and_drains(net: Net, job: int) -> None:
    """``job`` (of request r1 on b) ended failed without a step, and once r1
    finishes nothing is left anywhere."""
    b = net.engines["b"]
    (result,) = b.collect(net.now)
    assert result.job_id == job and not result.success
    b.manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_load_repeating_a_key_recomputes_at_once() -> None:
    """A peer refuses a Fetch that repeats a key (the protocol asks for each
    block once): such a load must not wait for its deadline."""
    net = make_net(reads=False)
    probe(net, "r1", "kv1")
    fails_at_once_and_drains(net, load(net, "r1", [5, 6], [KEYS[0], KEYS[0]]))


def test_an_answer_from_a_new_serve_does_not_revive_an_expired_offer() -> None:
    """The consumer's offer window for a lookup ended (no tick purged it:
    a long engine step), and its next Lookup reached the producer after the
    first serve had let its pins go, so a new serve answered, pinning only
    the new key. Merged into the old offer, that answer re-trusted the
    released slots: the READ took them and the load reported success with
    another request's bytes."""
    net = Net(timeouts=FAST_TIMEOUTS)  # pins 1.5 s, the offer trusted 1.125 s
    a, b = net.engines["a"], net.engines["b"]
    keys = [key(i) for i in range(3)]
    for i, k in enumerate(keys):
        a.put(k, 10 + 3 * i)
    b.manager.on_new_request("r1", net.roles("a", "kv1"), net.now)
    b.manager.lookup("r1", keys[0])
    b.manager.lookup("r1", keys[1])
    net.run()
    net.now = 1.0
    b.manager.lookup("r1", keys[2])  # a later batch
    net.step(deliver=False)  # its Lookup leaves b, not yet delivered
    net.now = 1.55  # b ticks no more from here
    a.manager.tick(net.now)  # the first serve's pins expire
    a.manager.end_step(net.now)
    a.collect(net.now)
    net.deliver_all()  # the Lookup reaches a: a new serve
    net.serve()
    for peer, frames in a.manager.take_frames(net.now):
        net.queue += [("a", peer, f) for f in frames]
    net.deliver_all()  # its answer reaches b before any tick of b's
    assert [b.manager.lookup("r1", k) for k in keys] == [Answer.HIT] * 3
    job = load(net, "r1", [1, 2, 3], keys)
    net.run()
    collect_all(net)
    (result,) = b.results[job]
    assert not b.wrong_bytes, b.wrong_bytes
    if result.success:
        assert [b.block(s) for s in (1, 2, 3)] == [payload(k) for k in keys]
    b.manager.on_request_finished("r1", net.now)
    net.settle(3.0, 0.1)
    assert_drained(net)


# ---------------------------------------------------------------------------
# disaggregated prefill: the decoder READs the parked stores
# ---------------------------------------------------------------------------
