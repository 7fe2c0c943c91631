"""The manager's lifecycle rules, scenario by scenario (pure core, in memory)."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_kv.lifecycle import State
from p2p_kv.node.manager import Answer, JobResult, LoadManager
from p2p_kv.node.roles import Roles
from p2p_kv.peer import Timeouts, is_inbound
from p2p_kv.protocol import Fetch, FetchOffer, decode, encode

from .memnet import FAST_TIMEOUTS, Net, key, payload

KEYS = [key(i) for i in range(4)]


def make_net(**kw: object) -> Net:
    net = Net(**kw)  # type: ignore[arg-type]
    a = net.engines["a"]
    for i, k in enumerate(KEYS):
        a.put(k, 10 + 3 * i)  # non-contiguous producer slots
    return net


def wait(net: Net, seconds: float, dt: float = 0.1) -> None:
    for _ in range(round(seconds / dt)):
        net.advance(dt)
        net.run(1)


def probe(net: Net, req: str, kv_id: str, keys: list[bytes] = KEYS) -> list[Answer]:
    """Register a consumer request on b and run its lookup to an answer."""
    b = net.engines["b"].manager
    b.on_new_request(req, net.roles("a", kv_id), net.now)
    first = [b.lookup(req, k) for k in keys]
    assert first == [Answer.RETRY] * len(keys)
    net.run()
    return [b.lookup(req, k) for k in keys]


def load(net: Net, req: str, slots: list[int], keys: list[bytes] = KEYS) -> int:
    eng = net.engines["b"]
    job = eng.new_job()
    for s in slots:
        eng.slot_owner[s] = job
    eng.expect[job] = (list(keys), list(slots))  # a success must hold them
    eng.manager.submit_load(job, req, keys, slots, net.now)
    return job


def pd_load(net: Net, req: str, kv_id: str, slots: list[int]) -> JobResult:
    """Decoder request ``req`` on b loads ``kv_id``'s parked blocks from a
    into ``slots`` (a Fetch, no lookup); the result, once its job ends."""
    b = net.engines["b"]
    b.manager.on_new_request(req, net.roles("a", kv_id, probe=False), net.now)
    job = load(net, req, slots)
    net.run()
    while job not in b.results:
        wait(net, 0.1)
        collect_all(net)
    (result,) = b.results[job]
    return result


def assert_drained(net: Net) -> None:
    for name, eng in net.engines.items():
        report = eng.manager.state_report()
        residue = {k: v for k, v in report.items() if v}
        assert not residue, f"{name} left {residue}"
        assert not eng.pin_count, f"{name} still has pinned slots {eng.pin_count}"
        assert not eng.wrong_bytes, f"{name}: {eng.wrong_bytes}"
        assert eng.submitted == set(eng.results), f"{name}: jobs without a result"
        assert all(len(r) == 1 for r in eng.results.values()), "a job got two results"


def collect_all(net: Net) -> None:
    for eng in net.engines.values():
        eng.collect(net.now)


def two_held_loads(net: Net) -> tuple[int, int]:
    """Requests r1 and r2 on b, each with a load held in flight."""
    probe(net, "r1", "kv1")
    probe(net, "r2", "kv2")
    net.hold_writes = True
    j1 = load(net, "r1", [1, 2, 3, 4])
    j2 = load(net, "r2", [11, 12, 13, 14])
    net.run(2)
    return j1, j2


def held_load(net: Net, req: str = "r1", kv_id: str = "kv1") -> int:
    """A remote hit on b whose load is in flight and stays so (the
    producer's writes are held)."""
    probe(net, req, kv_id)
    net.hold_writes = True
    job = load(net, req, [1, 2, 3, 4])
    net.run(2)
    return job


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
    assert s.counters.failures == {"timeout": 1}
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
    assert not any(s.close_reason for s in b.manager.sessions())
    assert b.manager.requests.failed_ids() == frozenset()
    b.manager.on_request_finished("r2", net.now)
    net.run()
    assert_drained(net)


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
    b.max_peers = 1
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
    assert session.ready and session.peer_region is not None
    net.cut("a", "b")
    net.run()
    assert session in b.retired_sessions
    assert session.link._timers == []
    assert session.peer_region is None


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
        s.counters.lookups for s in b.manager.sessions() if not s.peer.startswith("in:")
    )
    # Same kv_request_id, same engine request id, different prompt.
    answers = probe(net, "r1", "kv1", [KEYS[0], key(50)])
    assert answers == [Answer.HIT, Answer.MISS]
    lookups_after = sum(
        s.counters.lookups for s in b.manager.sessions() if not s.peer.startswith("in:")
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
    a.manager.parked_ttl_s = 1.0
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


def test_roles_parse_rejects_incomplete_legs() -> None:
    with pytest.raises(ValueError, match="remote_kv_source needs"):
        Roles.parse({"remote_kv_source": {"kv_request_id": "x"}})
    roles = Roles.parse(
        {
            "remote_prefiller": {
                "kv_request_id": "x",
                "remote_host": "::1",
                "remote_port": 7,
            }
        }
    )
    assert roles.source is not None and roles.source.peer == "[::1]:7"
    assert not roles.source.probe
    assert Roles.parse({"remote_decoder": {}}).dest_kv_id == ""


@pytest.mark.parametrize(
    ("host", "port", "field"),
    [
        ("h", [1], "remote_port"),
        ("h", {"a": 1}, "remote_port"),
        ("h", True, "remote_port"),
        ("h", -1, "remote_port"),
        ("h", 65536, "remote_port"),
        ("h", "80x", "remote_port"),
        ("bad host", 80, "remote_host"),
        ("h/x", 80, "remote_host"),
        ("h;eth0", 80, "remote_host"),
        (5, 80, "remote_host"),
        ("[]", 80, "remote_host"),
        ("h\ud800", 80, "remote_host"),
        ("in", 80, "remote_host"),  # would read as an inbound connection
        ("[in]", 80, "remote_host"),  # so would this, once unbracketed
        ("[[in]", 80, "remote_host"),
    ],
)
def test_roles_parse_refuses_a_clients_bad_address(
    host: object, port: object, field: str
) -> None:
    """An API client's ``kv_transfer_params`` reach the tier as they came:
    a bad port raised TypeError past the adapter (which refuses only
    ValueError) out of vLLM's add_request, and a bad host was accepted and
    raised from the socket layer inside the engine's step."""
    with pytest.raises(ValueError, match=f"remote_kv_source.{field} must be"):
        Roles.parse(
            {
                "remote_kv_source": {
                    "kv_request_id": "x",
                    "remote_host": host,
                    "remote_port": port,
                }
            }
        )


@pytest.mark.parametrize("leg", ["remote_kv_source", "remote_decoder"])
@pytest.mark.parametrize("kv_id", ["x" * 257, ["a"], {"a": 1}, True, 2.5, "x\ud800"])
def test_roles_parse_refuses_a_kv_id_the_protocol_cannot_carry(
    leg: str, kv_id: object
) -> None:
    """Taken as it came, such an id made every Lookup and Fetch one the
    peer drops (or one that does not encode): the request waited out its
    lookup timeout, a decoder's parked stores their TTL."""
    params = {"kv_request_id": kv_id, "remote_host": "h", "remote_port": 1}
    with pytest.raises(ValueError, match=f"{leg}.kv_request_id must be"):
        Roles.parse({leg: params})
    params["kv_request_id"] = 7
    assert Roles.parse({leg: params}) != Roles()


_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["kv_request_id", "remote_host", "remote_port", "remote_kv_source"]
            )
            | st.integers()
            | st.text(max_size=4),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)
_LEG = st.dictionaries(
    st.sampled_from(["kv_request_id", "remote_host", "remote_port"])
    | st.integers()
    | st.none(),
    _JUNK,
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["remote_kv_source", "remote_prefiller", "remote_decoder"]),
        _LEG | _JUNK,
    )
    | _JUNK
)
def test_roles_parse_raises_nothing_but_value_error(params: Any) -> None:
    """vLLM hands the tier whatever its caller put in
    ``kv_transfer_params`` (the offline API takes any Python object), and
    the adapter refuses only ValueError: anything else escaped into
    vLLM's add_request and took the engine down. A leg with an int key
    did (TypeError from sorting its keys for the message). What it takes
    never names one of our inbound connections: ``"[in]"`` did, and its
    sends and close raised inside the engine's step."""
    with contextlib.suppress(ValueError):
        roles = Roles.parse(params)
        assert roles.source is None or not is_inbound(roles.source.peer)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="[]in:", max_size=8), st.integers(1, 65535))
def test_no_client_host_names_an_inbound_connection(host: str, port: int) -> None:
    leg = {"kv_request_id": "x", "remote_host": host, "remote_port": port}
    with contextlib.suppress(ValueError):
        roles = Roles.parse({"remote_kv_source": leg})
        assert roles.source is not None and not is_inbound(roles.source.peer), host


def test_roles_parse_takes_a_port_as_a_decimal_string_and_brackets() -> None:
    leg = {"kv_request_id": "x", "remote_host": "[::1]", "remote_port": "5800"}
    roles = Roles.parse({"remote_kv_source": leg})
    assert roles.source is not None and roles.source.peer == "[::1]:5800"


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
    assert len(a.manager.parked.late_fetches) == 1  # d1's Fetch waits at a
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
    for _ in range(round(2 * sb.timeouts.liveness_s / 0.1)):
        net.advance(0.1)
        net.step()  # b's runtime pumps; b's engine does not collect
        a.collect(net.now)
    assert not sa.closed, sa.close_reason
    assert not sb.closed, sb.close_reason
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
    from p2p_kv.protocol import Heartbeat, Lookup
    from p2p_kv.runtime.tier_runtime import fresh_nonce

    from .memnet import identity

    a = Net().engines["a"].manager
    peer = a.peers.on_inbound(0.0, "in:stranger")
    a.on_message(peer, make_hello(identity("x", hash_seed="other"), fresh_nonce()), 0.0)
    for msg in (Heartbeat(seq=1), Lookup("r", 1, 1, [key(1)]), Heartbeat(seq=2)):
        a.on_message(peer, msg, 0.0)
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
    assert m.timeouts.lookup_s < m.timeouts.handshake_s
    m.on_new_request("r1", Roles(Source("kv1", "10.0.0.9:5800", True)), 0.0)
    k = key(1)
    assert m.lookup("r1", k) is Answer.RETRY
    m.loads.flush(0.0)
    m.end_step(0.0)
    assert m.next_deadline() == m.timeouts.lookup_s
    m.tick(m.timeouts.lookup_s)
    m.end_step(m.timeouts.lookup_s)
    assert m.lookup("r1", k) is Answer.MISS
    (session,) = m.sessions()
    assert session.counters.failures == {"lookup_timeout": 1}


def one_idle_session_at_max_peers() -> tuple[Net, LoadManager]:
    """b (``max_peers`` 1) has dialled a for a request that finished: a's
    session idles. c holds the same blocks."""
    net = make_net(names=("a", "b", "c"))
    for i, k in enumerate(KEYS):
        net.engines["c"].put(k, 30 + i)
    b = net.engines["b"].manager
    b.max_peers = 1
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
    assert idle.closed and b.dials_refused == 0
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
    b.max_peers = 1
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
    a.max_peers = 1
    assert len([p for p in a.sessions() if p.peer.startswith("in:")]) == 1
    a.on_new_request("r3", net.roles("c", "kv3"), net.now)
    assert a.session("c:1") is not None and a.dials_refused == 0
    a.on_request_finished("r3", net.now)


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
        assert (s.counters.loads_read, s.counters.loads_fetched) == (
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
    assert session.counters.lookups == 2
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
    for peer, msgs in a.manager.take_outgoing(net.now):
        net.queue += [("a", peer, encode(m)) for m in msgs]
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


def until_read_posted(net: Net, rounds: int = 10) -> None:
    """Steps, transfers held, until b's READ is posted; no WRITE may be."""
    net.hold_writes = True
    for _ in range(rounds):
        net.run(1)
        assert not net.writes, net.writes
        if net.reads:
            return
    raise AssertionError(f"no READ posted in {rounds} steps")


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
    a.manager.reads = producer_reads
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
    assert session.counters.loads_fetched == 1
    assert session.counters.loads_written == (0 if reads else 1)
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
    assert session.counters.protocol_errors == {"stale_fetch_offer": 1}
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
    assert session.counters.failures == {"bad_fetch_offer": 1}
    assert session.counters.protocol_errors == {"bad_fetch_offer": 1}
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
    wait(net, a.parked_ttl_s + 0.5, dt=0.5)
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
    a.manager.on_message(sa.peer, again, net.now)
    assert sa.counters.protocol_errors == {"duplicate_fetch": 1}
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
    ttl = a.manager.parked_ttl_s  # 60 s: parked, the store is a job till then
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
    assert net.now - reset <= b.manager.timeouts.fetch_deadline(0.0, 4 * 16) + 0.5
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
    net.advance(b.reconnect_backoff_s)
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
