"""The manager's state is a few indexes, and its residue report sees them all.

Residue checks (the soak, the stateful fleet, the drain asserts) read
``state_report()``; it is derived from the containers the manager's
sub-objects hold, so these tests pin down the two properties that make it
trustworthy: each holder keeps few containers, and a container or record
nobody declared at rest shows up as residue.
"""

from __future__ import annotations

from p2p_kv.node.indexes import containers_of, holders_of
from p2p_kv.node.manager import Answer, LoadManager
from p2p_kv.node.requests import Request
from p2p_kv.node.roles import Roles

from .memnet import Net, key

KEYS = [key(i) for i in range(4)]


def drained_net() -> Net:
    """Two engines that served one lookup and a parked store, then drained."""
    net = Net()
    a, b = net.engines["a"], net.engines["b"]
    for i, k in enumerate(KEYS):
        a.put(k, 10 + i)
    b.manager.on_new_request("r1", net.roles("a", "kv1"), net.now)
    assert [b.manager.lookup("r1", k) for k in KEYS] == [Answer.RETRY] * 4
    net.run()
    assert [b.manager.lookup("r1", k) for k in KEYS] == [Answer.HIT] * 4
    b.manager.on_request_finished("r1", net.now)
    dec = Roles.parse({"remote_decoder": {"kv_request_id": "kv9"}})
    a.manager.on_new_request("p1", dec, net.now)
    a.manager.on_request_finished("p1", net.now)
    net.settle(3.0, 0.1)
    for eng in net.engines.values():
        eng.collect(net.now)
    return net


def residue(m: LoadManager) -> dict[str, int]:
    return {k: v for k, v in m.state_report().items() if v}


def test_the_manager_and_each_holder_keep_at_most_six_containers() -> None:
    m = drained_net().engines["a"].manager
    assert len(containers_of(m)) <= 6, containers_of(m)
    holders = holders_of(m)
    assert {"requests", "jobs", "peers", "work", "parked"} <= set(holders)
    for name, holder in holders.items():
        assert len(containers_of(holder)) <= 6, (name, sorted(containers_of(holder)))


#: The session work's containers that hold peers, not requests: sessions
#: touched, peers with lookups to serve, events for the runtime's pump.
PER_PEER_WORK = {"dirty", "to_serve", "out"}


def test_the_node_layer_keeps_at_most_eight_per_request_containers() -> None:
    """Requests by id and generation, lookups to send, jobs, results,
    parked entries, finished producers, the timer heap: each one more
    index to keep in step when a request ends (``docs/architecture.md``,
    "Where a request's state lives")."""
    m = drained_net().engines["a"].manager
    per_request = {
        f"{name}.{c}"
        for name in ("requests", "jobs", "parked", "timers", "work")
        for c in containers_of(getattr(m, name))
        if not (name == "work" and c in PER_PEER_WORK)
    }
    assert len(per_request) <= 8, sorted(per_request)
    assert not containers_of(m), "the manager holds no container of its own"


def test_a_drained_manager_has_no_residue() -> None:
    net = drained_net()
    for eng in net.engines.values():
        assert not residue(eng.manager)


def test_a_leaked_record_is_residue_in_every_index_it_stays_in() -> None:
    m = drained_net().engines["b"].manager
    ghost = Request("ghost")
    m.requests.by_id["ghost"] = ghost
    m.requests.by_gen[999] = ghost
    assert residue(m) == {"requests_by_id": 1, "requests_by_gen": 1}
    ghost.failed = True
    assert residue(m)["failed_ids"] == 1


def test_a_container_added_later_is_residue_unless_declared() -> None:
    """Nobody lists it: a new index on any holder (or on the manager
    itself) is reported as soon as it holds something."""
    m = drained_net().engines["a"].manager
    m.parked.lost = {"kv": 1}  # type: ignore[attr-defined]
    m.work.extra = [1, 2]  # type: ignore[attr-defined]
    m.stray = {3}  # type: ignore[attr-defined]
    assert residue(m) == {"parked_lost": 1, "extra": 2, "stray": 1}


def test_a_timer_that_should_have_fired_is_residue() -> None:
    """Timers not yet due are not residue (a finished producer is kept for
    a late Fetch until its TTL); one past due at the last tick is."""
    net = drained_net()
    m = net.engines["a"].manager
    m.parked.finished["kv-old"] = net.now + 30.0
    assert not residue(m)
    m.parked.finished["kv-stale"] = net.now - 1.0
    assert residue(m) == {"parked_finished": 1}
