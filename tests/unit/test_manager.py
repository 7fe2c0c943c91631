"""One request's lifecycle through the manager: a remote hit, finishing
and failing, reused ids, aborts (pure core, in memory)."""

from __future__ import annotations

import pytest

from p2p_kv.node.manager import Answer
from p2p_kv.node.roles import Roles
from p2p_kv.peer import Timeouts

from .memnet import key, payload
from .scenarios import (
    KEYS,
    assert_drained,
    collect_all,
    held_load,
    load,
    make_net,
    probe,
    two_held_loads,
    wait,
)


def test_remote_hit_loads_the_right_bytes_and_leaves_nothing() -> None:
    net = make_net()
    assert probe(net, "r1", "kv1", [*KEYS, key(99)]) == [Answer.HIT] * 4 + [Answer.MISS]
    job = load(net, "r1", [5, 6, 7, 30])
    net.run()
    (result,) = net.engines["b"].collect(net.now)
    assert result.job_id == job and result.success
    assert result.transfer_bytes == 4 * 16
    b = net.engines["b"]
    assert [b.block(s) for s in (5, 6, 7, 30)] == [payload(k) for k in KEYS]
    net.engines["b"].manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_a_request_waits_on_us_from_its_first_lookup_to_its_answer() -> None:
    # The engine's idle check (TierRuntime.may_wait) counts these: a request
    # with a key asked and not answered may not be mistaken for idle, and
    # one with every key answered may not keep the engine waiting.
    net = make_net()
    b = net.engines["b"].manager
    b.on_new_request("r1", net.roles("a", "kv1"), net.now)
    assert b.waiting_requests() == 0
    assert b.lookup("r1", KEYS[0]) is Answer.RETRY
    assert b.waiting_requests() == 1  # unsent
    b.loads.flush(net.now)
    assert b.waiting_requests() == 1  # sent, unanswered
    assert b.lookup("r1", KEYS[0]) is Answer.RETRY  # asked once only
    net.run()
    assert b.lookup("r1", KEYS[0]) is Answer.HIT
    assert b.waiting_requests() == 0
    assert b.lookup("r1", key(99)) is Answer.RETRY  # a second batch
    assert b.waiting_requests() == 1
    net.run()
    assert b.lookup("r1", key(99)) is Answer.MISS
    assert b.waiting_requests() == 0


def test_finish_while_load_in_flight_keeps_id_out_of_failed_set() -> None:
    """The regression the project exists for: abort during an in-flight load."""
    net = make_net()
    probe(net, "r1", "kv1")
    net.hold_writes = True
    job = load(net, "r1", [1, 2, 3, 4])
    net.run(2)  # the producer has the fetch and is writing
    b = net.engines["b"]
    b.manager.on_request_finished("r1", net.now)
    net.hold_writes = False
    net.run()
    results = b.collect(net.now)
    assert [r.job_id for r in results] == [job]
    assert b.manager.requests.failed_ids() == frozenset()
    collect_all(net)
    assert_drained(net)


def test_failure_buffered_before_finish_is_not_recorded_after_finish() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    job = load(net, "r1", [1, 2, 3, 4])
    net.cut("a", "b")  # the failure is now buffered in the session
    b = net.engines["b"]
    net.run(1)
    b.manager.on_request_finished("r1", net.now)  # before the engine drains
    results = b.collect(net.now)
    assert [(r.job_id, r.success) for r in results] == [(job, False)]
    assert b.manager.requests.failed_ids() == frozenset()


def test_a_finished_requests_settling_load_keeps_nobody_waiting() -> None:
    # Its abort may take a while to settle; meanwhile the engine computes
    # other requests, one of them under the same id, and must not block on
    # its sockets for them (may_wait compares this with live requests).
    net = make_net()
    b = net.engines["b"].manager
    job = held_load(net)
    assert b.waiting_requests() == 1  # its load is in flight
    b.on_request_finished("r1", net.now)
    assert b.waiting_requests() == 0
    b.on_new_request("r1", net.roles("a", "kv9"), net.now)  # the id, reused
    assert b.waiting_requests() == 0
    net.hold_writes = False
    net.run()
    collect_all(net)
    assert len(net.engines["b"].results[job]) == 1
    b.on_request_finished("r1", net.now)
    net.run()
    assert_drained(net)


def test_a_live_id_started_again_ends_the_old_request_first() -> None:
    # vLLM with its id randomization off may add a request under the id of
    # one it aborted before that one's finish reached the tier. Raising
    # here would take the engine down.
    net = make_net()
    b = net.engines["b"].manager
    job = held_load(net)
    assert b.on_new_request("r1", net.roles("a", "kv2"), net.now) is True
    assert b.protocol_errors == {"reused_live_id": 1}
    assert b.lookup("r1", KEYS[0]) is Answer.RETRY  # a real lookup, anew
    net.hold_writes = False
    net.run()
    assert b.lookup("r1", KEYS[0]) is Answer.HIT
    collect_all(net)
    assert len(net.engines["b"].results[job]) == 1
    assert b.requests.failed_ids() == frozenset()
    b.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_late_failure_after_finish_timeout_path() -> None:
    t = Timeouts(fetch_floor_s=0.5, abort_ack_s=0.5, heartbeat_interval_s=0.2)
    net = make_net(timeouts=t)
    probe(net, "r1", "kv1")
    net.hold_writes = True
    job = load(net, "r1", [1, 2, 3, 4])
    net.run(2)
    b = net.engines["b"]
    b.manager.on_request_finished("r1", net.now)
    wait(net, 1.5)  # the producer's write never completes; deadlines fire
    net.hold_writes = False
    net.run()
    collect_all(net)
    assert [r.success for r in b.results[job]] == [False]
    assert b.manager.requests.failed_ids() == frozenset()


@pytest.mark.parametrize("reads", [True, False], ids=["read", "write"])
def test_a_load_that_timed_out_is_one_failure_however_it_ends(reads: bool) -> None:
    """A timed-out load still ends through the transfer it fences (the
    READ's end, or the producer's TransferDone): that end is the same
    failure, not an ``abort`` on top of the ``timeout``."""
    t = Timeouts(fetch_floor_s=0.5, abort_ack_s=5.0, heartbeat_interval_s=0.2)
    net = make_net(timeouts=t, reads=reads)
    probe(net, "r1", "kv1")
    net.hold_writes = True
    job = load(net, "r1", [1, 2, 3, 4])
    net.run(2)
    wait(net, 1.0)  # past the load's deadline, inside the abort's
    b = net.engines["b"]
    assert b.results.get(job) is None  # fenced: the transfer may still land
    net.hold_writes = False
    net.run()
    collect_all(net)
    assert [(r.success, r.reason) for r in b.results[job]] == [(False, "timeout")]
    (s,) = b.manager.sessions()
    assert s.link.counters.failures == {"timeout": 1}
    assert b.manager.fallbacks == {"timeout": 1}
    b.manager.on_request_finished("r1", net.now)
    net.run()
    assert_drained(net)


def test_aborting_one_request_waits_out_its_write_and_spares_the_others() -> None:
    """The producer acknowledges an Abort once the write it fences has
    settled, which may take as long as the write's own deadline: a shorter
    wait closed the whole session and failed every sibling load."""
    t = Timeouts(fetch_floor_s=3.0, abort_ack_s=0.5, heartbeat_interval_s=0.2)
    net = make_net(timeouts=t)
    j1, j2 = two_held_loads(net)
    b = net.engines["b"]
    b.manager.on_request_finished("r1", net.now)
    wait(net, 1.5)  # past abort_ack_s, well inside the writes' 3 s deadline
    net.hold_writes = False
    net.run()
    collect_all(net)
    assert [r.success for r in b.results[j2]] == [True]
    assert len(b.results[j1]) == 1
    assert not any(s.link.close_reason for s in b.manager.sessions())
    assert b.manager.requests.failed_ids() == frozenset()
    b.manager.on_request_finished("r2", net.now)
    net.run()
    assert_drained(net)


def test_reused_id_gets_a_real_remote_lookup() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    net.hold_writes = True
    load(net, "r1", [1, 2, 3, 4])
    net.run(2)
    b = net.engines["b"]
    b.manager.on_request_finished("r1", net.now)
    net.hold_writes = False
    net.run()
    collect_all(net)
    lookups_before = sum(
        s.link.counters.lookups
        for s in b.manager.sessions()
        if not s.peer.startswith("in:")
    )
    # Same kv_request_id, same engine request id, different prompt.
    answers = probe(net, "r1", "kv1", [KEYS[0], key(50)])
    assert answers == [Answer.HIT, Answer.MISS]
    lookups_after = sum(
        s.link.counters.lookups
        for s in b.manager.sessions()
        if not s.peer.startswith("in:")
    )
    assert lookups_after == lookups_before + 1
    b.manager.on_request_finished("r1", net.now)
    net.run()
    collect_all(net)
    assert_drained(net)


def test_unfinished_failure_makes_lookup_miss() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    job = load(net, "r1", [1, 2, 3, 4])
    net.cut("a", "b")
    net.run()
    b = net.engines["b"]
    results = b.collect(net.now)
    assert [(r.job_id, r.success) for r in results] == [(job, False)]
    assert b.manager.requests.failed_ids() == frozenset({"r1"})
    assert b.manager.lookup("r1", KEYS[0]) is Answer.MISS
    b.manager.on_request_finished("r1", net.now)
    assert b.manager.requests.failed_ids() == frozenset()


def test_fenced_slots_wait_for_abort_ack() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    net.hold_writes = True
    job = load(net, "r1", [1, 2, 3, 4])
    net.run(2)
    b = net.engines["b"]
    b.manager.on_request_finished("r1", net.now)
    net.run(2)
    # The producer is mid-write: no result, the four slots are quarantined.
    assert b.collect(net.now) == []
    assert b.manager.state_report()["fenced_slots"] == 4
    net.hold_writes = False
    net.run()
    assert [r.job_id for r in b.collect(net.now)] == [job]
    assert b.manager.state_report()["fenced_slots"] == 0


def test_request_with_both_legs_is_finished_on_both() -> None:
    net = make_net()
    b = net.engines["b"]
    roles = Roles.parse(
        {
            "remote_kv_source": {
                "kv_request_id": "kv1",
                "remote_host": "a",
                "remote_port": 1,
            },
            "remote_decoder": {"kv_request_id": "kv1-out"},
        }
    )
    b.manager.on_new_request("r1", roles, net.now)
    b.manager.lookup("r1", KEYS[0])
    net.run()
    store = b.new_job()
    b.store(store, "r1", [KEYS[0]], [9], net.now)
    b.manager.on_request_finished("r1", net.now)
    report = b.manager.state_report()
    assert report["requests_by_id"] == 0
    assert report["parked_stores"] == 1  # kept for its decoder, until its TTL


def test_job_submitted_twice_is_a_local_error() -> None:
    net = make_net()
    probe(net, "r1", "kv1")
    load(net, "r1", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="submitted twice"):
        net.engines["b"].manager.submit_load(
            net.engines["b"].job_counter * 100 + 98, "r1", KEYS, [1, 2, 3, 4], 0
        )
