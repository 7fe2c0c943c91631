"""Sessions by peer, as requests see them: ``max_peers``, sessions lost or
refused, a source of another layout (pure core, in memory)."""

from __future__ import annotations

import pytest

from p2p_kv.node.manager import Answer, LoadManager
from p2p_kv.node.roles import Roles

from .memnet import FAST_TIMEOUTS, Net, key
from .scenarios import (
    KEYS,
    assert_drained,
    collect_all,
    load,
    make_net,
    probe,
    two_held_loads,
    wait,
)


def test_a_request_refused_a_dial_at_max_peers_is_counted_once() -> None:
    """Its session lost and the engine at max_peers, a request's every
    lookup batch dialled again and counted another refusal (the runtime
    logs ``dials_refused`` as requests)."""
    net = make_net(names=("a", "b", "c"), timeouts=FAST_TIMEOUTS)
    b = net.engines["b"].manager
    probe(net, "r1", "kv1")  # a session to a, named by a live request
    b.on_new_request("r2", net.roles("c", "kv2"), net.now)
    net.run()
    net.cut("b", "c")
    wait(net, 2.0)  # c's session gone, the backoff over
    b.settings.max_peers = 1
    answers = []
    for i in range(5):
        answers.append(b.lookup("r2", key(100 + i)))
        net.run(1)
    assert answers == [Answer.RETRY] + [Answer.MISS] * 4
    assert b.refusals == {("other", "too_many_peers"): 1}
    assert b.dials_refused == 1
    for req in ("r1", "r2"):
        b.on_request_finished(req, net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_session_close_fails_loads_but_not_finished_ids() -> None:
    net = make_net()
    j1, j2 = two_held_loads(net)
    b = net.engines["b"]
    b.manager.on_request_finished("r1", net.now)
    b.manager.close_all("shutdown")
    net.run()
    collect_all(net)
    assert not b.results[j1][0].success and not b.results[j2][0].success
    # r2 is live and failed: it must recompute. r1 finished: never recorded.
    assert b.manager.requests.failed_ids() == frozenset({"r2"})
    assert b.manager.lookup("r2", KEYS[0]) is Answer.MISS
    b.manager.on_request_finished("r2", net.now)
    assert b.manager.requests.failed_ids() == frozenset()


@pytest.mark.parametrize("answered", [False, True], ids=["unasked", "answered"])
def test_a_request_that_outlives_its_session_asks_again_through_a_new_one(
    answered: bool,
) -> None:
    """A request waiting in vLLM's queue when its peer's session drops asks
    nothing until it runs. Its lookups answered MISS for as long as no
    other request dialled that peer again: its remote hits were lost for
    good (and so were those of an id reused after a late failure closed
    the session). They ask through a new session now. *answered*: its hits
    came through the session that ended; they stayed hits, and vLLM loaded
    them through the next session, whose producer holds no pins for them
    (``not pinned``): asked again too."""
    net = make_net(timeouts=FAST_TIMEOUTS)
    b = net.engines["b"].manager
    assert probe(net, "warm", "w") == [Answer.HIT] * 4
    if answered:
        assert probe(net, "old", "kv-old") == [Answer.HIT] * 4
    else:
        b.on_new_request("old", net.roles("a", "kv-old"), net.now)
    net.cut("a", "b")
    wait(net, 2.0)  # the session ends, and the reconnect backoff passes
    assert not list(b.sessions())
    assert [b.lookup("old", k) for k in KEYS] == [Answer.RETRY] * 4
    net.run()
    assert [b.lookup("old", k) for k in KEYS] == [Answer.HIT] * 4
    job = load(net, "old", [5, 6, 7, 8])
    net.run()
    collect_all(net)
    assert net.engines["b"].results[job][0].success
    for req in ("warm", "old"):
        b.on_request_finished(req, net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_lost_session_keeps_none_of_what_it_had_armed() -> None:
    """A session that ends is kept for its last counts (up to 1,024 of them,
    until metrics collect them); its timer heap kept every probe, load and
    serve it had armed with it: 5 MB for 2,000 lookups of 256 keys; and the
    peer's region, up to 1 MiB that anyone who completes a handshake sends
    (1 GiB for the 1,024 kept)."""
    net = make_net()
    b = net.engines["b"].manager
    for i in range(50):
        b.on_new_request(f"r{i}", net.roles("a", f"kv{i}"), net.now)
        assert [b.lookup(f"r{i}", k) for k in KEYS] == [Answer.RETRY] * 4
    net.run(1)
    (session,) = b.sessions()
    assert len(session.link._timers) >= 50
    net.run(3)
    assert session.link.ready and session.link.peer_region is not None
    net.cut("a", "b")
    net.run()
    assert session in b.retired_sessions
    assert session.link._timers == []
    assert session.link.peer_region is None


def test_a_result_the_engine_has_not_collected_keeps_its_session_ticking() -> None:
    """A long engine step leaves a finished load's result uncollected while
    the waker keeps pumping. The session must keep its heartbeats and
    deadlines meanwhile: it was re-armed only once its results were taken,
    so past ``liveness_s`` its peer dropped it as dead, with every other
    load on it."""
    net = make_net()
    assert probe(net, "r1", "kv1") == [Answer.HIT] * 4
    job = load(net, "r1", [5, 6, 7, 30])
    net.run(2)
    b, a = net.engines["b"], net.engines["a"]
    (sb,) = b.manager.sessions()
    (sa,) = a.manager.sessions()
    assert b.manager.results_ready()  # done, and buffered for b's engine
    for _ in range(round(2 * sb.link.timeouts.liveness_s / 0.1)):
        net.advance(0.1)
        net.step()  # b's runtime pumps; b's engine does not collect
        a.collect(net.now)
    assert not sa.link.closed, sa.link.close_reason
    assert not sb.link.closed, sb.link.close_reason
    (result,) = b.collect(net.now)
    assert result.job_id == job and result.success
    b.manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_refused_peer_is_counted_once_however_much_it_says() -> None:
    """A session's refusal was tallied again for every frame the refused
    peer sent after it (they are ignored): the refusals metric grew with
    the peer's chatter, not with refusals."""
    from p2p_kv.peer.handshake import make_hello
    from p2p_kv.protocol import Heartbeat, Lookup, encode
    from p2p_kv.runtime.tier_runtime import fresh_nonce

    from .memnet import identity

    a = Net().engines["a"].manager
    peer = a.peers.on_inbound(0.0, "in:stranger")
    hello = make_hello(identity("x", hash_seed="other"), fresh_nonce())
    a.receive_frame(peer, encode(hello), 0.0)
    for msg in (Heartbeat(seq=1), Lookup("r", 1, 1, [key(1)]), Heartbeat(seq=2)):
        a.receive_frame(peer, encode(msg), 0.0)
    assert a.refusals == {(peer, "hash_seed"): 1}


def test_a_lookup_to_a_peer_that_never_answers_the_handshake_ends_at_its_deadline() -> (
    None
):
    """A peer that is down when we dial answers no Hello: the lookup's own
    deadline (``lookup_s``, 2 s) ends it, where it used to wait out the
    handshake's (5 s), a request at a time."""
    import os

    from p2p_kv.node.manager import LoadManager
    from p2p_kv.node.roles import Source

    from .memnet import identity

    m = LoadManager(identity("a"), nonces=lambda: os.urandom(16))
    assert m.settings.timeouts.lookup_s < m.settings.timeouts.handshake_s
    m.on_new_request("r1", Roles(Source("kv1", "10.0.0.9:5800", True)), 0.0)
    k = key(1)
    assert m.lookup("r1", k) is Answer.RETRY
    m.loads.flush(0.0)
    m.end_step(0.0)
    assert m.timers.next_deadline() == m.settings.timeouts.lookup_s
    m.tick(m.settings.timeouts.lookup_s)
    m.end_step(m.settings.timeouts.lookup_s)
    assert m.lookup("r1", k) is Answer.MISS
    (session,) = m.sessions()
    assert session.link.counters.failures == {"lookup_timeout": 1}


def one_idle_session_at_max_peers() -> tuple[Net, LoadManager]:
    """b (``max_peers`` 1) has dialled a for a request that finished: a's
    session idles. c holds the same blocks."""
    net = make_net(names=("a", "b", "c"))
    for i, k in enumerate(KEYS):
        net.engines["c"].put(k, 30 + i)
    b = net.engines["b"].manager
    b.settings.max_peers = 1
    assert probe(net, "r1", "kv1") == [Answer.HIT] * 4
    b.on_request_finished("r1", net.now)
    net.run()
    return net, b


def test_a_new_peer_past_max_peers_takes_the_place_of_an_idle_one() -> None:
    """Sessions are never closed for idling, so ``max_peers`` capped the
    distinct peers an engine ever talked to while they lived: past it,
    every new peer lost the tier for good. A session nothing needs (no
    live request names it, nothing in flight) makes room now: the one used
    longest ago closes, and the new peer is dialled."""
    net, b = one_idle_session_at_max_peers()
    (idle,) = b.sessions()
    b.on_new_request("r2", net.roles("c", "kv2"), net.now)
    assert idle.link.closed and b.dials_refused == 0
    assert [b.lookup("r2", k) for k in KEYS] == [Answer.RETRY] * 4
    net.run()
    assert [b.lookup("r2", k) for k in KEYS] == [Answer.HIT] * 4
    assert [s.peer for s in b.sessions()] == ["c:1"]
    b.on_request_finished("r2", net.now)
    net.run()
    # The peer closed for room was healthy: no reconnect backoff for it
    # (peers used in turn slightly past max_peers missed a second each).
    b.on_new_request("r3", net.roles("a", "kv3"), net.now)
    assert [b.lookup("r3", k) for k in KEYS] == [Answer.RETRY] * 4
    net.run()
    assert [b.lookup("r3", k) for k in KEYS] == [Answer.HIT] * 4
    assert b.dials_refused == 0
    b.on_request_finished("r3", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_request_begun_while_its_peers_session_closes_asks_later() -> None:
    """Only a request refused at ``max_peers`` recomputes at once. One that
    began while its peer's session was closing (here: closed for room)
    with the engine at the bound was taken for refused too, and missed
    for its whole life though it could have dialled a moment later."""
    net, b = one_idle_session_at_max_peers()
    b.on_new_request("r2", net.roles("c", "kv2"), net.now)  # a closes for room
    b.on_new_request("r3", net.roles("a", "kv3"), net.now)  # a still closing
    assert b.dials_refused == 0
    assert [b.lookup("r2", k) for k in KEYS] == [Answer.RETRY] * 4
    net.run()
    assert [b.lookup("r2", k) for k in KEYS] == [Answer.HIT] * 4
    b.on_request_finished("r2", net.now)
    net.run()
    assert [b.lookup("r3", k) for k in KEYS] == [Answer.RETRY] * 4
    net.run()
    assert [b.lookup("r3", k) for k in KEYS] == [Answer.HIT] * 4
    b.on_request_finished("r3", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_request_naming_a_peer_past_max_peers_recomputes_and_is_counted() -> None:
    """Clients choose the peers a request names; each dial holds sockets, so
    past ``max_peers`` the request recomputes instead of dialling, counted,
    and the peers already dialled keep serving."""
    net = make_net(names=("a", "b", "c"))
    b = net.engines["b"].manager
    b.settings.max_peers = 1
    assert probe(net, "r1", "kv1") == [Answer.HIT] * 4
    b.on_new_request("r2", net.roles("c", "kv2"), net.now)
    assert [b.lookup("r2", k) for k in KEYS] == [Answer.MISS] * 4
    assert b.session("c:1") is None
    assert b.dials_refused == 1
    assert b.refusals == {("other", "too_many_peers"): 1}
    job = load(net, "r1", [5, 6, 7, 8])
    net.run()
    (result,) = net.engines["b"].collect(net.now)
    assert result.job_id == job and result.success
    for req in ("r1", "r2"):
        b.on_request_finished(req, net.now)
    net.run()
    collect_all(net)
    assert_drained(net)
    # Inbound sessions are the peers' dials, not ours: they do not count.
    a = net.engines["a"].manager
    a.settings.max_peers = 1
    assert len([p for p in a.sessions() if p.peer.startswith("in:")]) == 1
    a.on_new_request("r3", net.roles("c", "kv3"), net.now)
    assert a.session("c:1") is not None and a.dials_refused == 0
    a.on_request_finished("r3", net.now)


def layout_net(theirs: str) -> Net:
    """a holds KEYS under the tier's layout of a one-worker engine; b
    states ``theirs``."""
    from .memnet import identity

    ours = "tiny-llama|torch.float32|[(16, 2)]|4096|1|1|1"
    return make_net(
        identities={
            "a": identity("a", layout=ours),
            "b": identity("b", layout=theirs),
        }
    )


@pytest.mark.parametrize(
    ("theirs", "reason"),
    [
        ("tiny-llama|torch.float32|[(16, 2)]|2048|1|2|1", "layout_tp"),
        ("tiny-llama|torch.float32|[(32, 2)]|8192|1|1|1", "layout_block_size"),
    ],
    ids=["tp", "block_size"],
)
def test_a_request_naming_a_source_of_another_layout_recomputes_at_once(
    theirs: str, reason: str
) -> None:
    """A pair that cannot share says so at first contact, by the field,
    and the request naming the source misses at once: no
    deadline passes (the clock never moves here), the next request too
    (the reconnect backoff answers it), and a prefiller's blocks, taken for
    there before the handshake ended, fail their load at once."""
    net = layout_net(theirs)
    b = net.engines["b"].manager
    assert probe(net, "r1", "kv1") == [Answer.MISS] * 4
    assert net.now == 0.0
    # (Here a's refusal ends the link before its Hello reaches b; over TCP
    # b reads it and refuses too: tests/integration/test_layout_refusal.py.)
    assert [r for _, r in net.engines["a"].manager.refusals] == [reason]
    b.on_new_request("r2", net.roles("a", "kv2"), net.now)
    assert [b.lookup("r2", k) for k in KEYS] in ([Answer.MISS] * 4, [Answer.RETRY] * 4)
    net.run()
    assert [b.lookup("r2", k) for k in KEYS] == [Answer.MISS] * 4
    for req in ("r1", "r2"):
        b.on_request_finished(req, net.now)
    net.run()
    # A prefiller leg (every block is there) before the handshake is over.
    net.advance(b.settings.reconnect_backoff_s)
    b.tick(net.now)
    b.on_new_request("r3", net.roles("a", "kv3", probe=False), net.now)
    assert [b.lookup("r3", k) for k in KEYS] == [Answer.HIT] * 4
    job = load(net, "r3", [5, 6, 7, 8])
    started = net.now
    net.run()
    (result,) = net.engines["b"].collect(net.now)
    assert result.job_id == job and not result.success
    assert net.now == started
    b.on_request_finished("r3", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)
