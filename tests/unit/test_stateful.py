"""Hypothesis drives three managers through random interleavings.

Rules: new request (symmetric or disaggregated, ids drawn from a small pool
so they get reused; with the directory on, requests that name no source,
primary-tier stores that feed it and evictions that make it stale), lookups, lookup responses (delivery), submit load and
store, fetch/transfer completion or failure, held writes, aborts (request
finished mid-flight), deadlines (clock advances), peer death (link cut),
session close, drain. After every step the invariants below are checked;
teardown finishes everything, lets every deadline pass and checks that no
structure anywhere holds anything.

Examples x steps: ``SETTINGS`` (1,000 examples of up to 60 steps, about
60,000 rule applications); CI runs them all on every ``make test``. The test
was checked against planted bugs (failed-ID leak, unfenced abort, a
directory prefix kept past its request's end): each makes it fail. It
found a found leg's load left without a result when its request finished
before the member answered its lookup.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from p2p_kv.lifecycle import State
from p2p_kv.node.manager import Answer
from p2p_kv.node.roles import Roles

from .memnet import FAST_TIMEOUTS, NBLOCKS, Net, key

KEYS = [key(i) for i in range(6)]
TIMEOUTS = FAST_TIMEOUTS
ENGINES = ("a", "b", "c")

SETTINGS = settings(
    max_examples=1000,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class Fleet(RuleBasedStateMachine):
    @initialize(reads=st.booleans(), fleet=st.booleans())
    def start(self, reads: bool, fleet: bool = False) -> None:
        # Both load paths: one-sided READs of offered pins, and Fetch/WRITE;
        # with ``fleet``, a peers key lists every engine: the directory is
        # on, and requests that name no source load what it finds.
        self.net = Net(ENGINES, timeouts=TIMEOUTS, reads=reads, fleet=fleet)
        # Writes land only when a rule says so, so that finishes, aborts,
        # deadlines and cuts regularly hit a write in flight.
        self.net.hold_writes = True
        for eng in self.net.engines.values():
            eng.manager.settings.parked_ttl_s = 2.0
            for i, k in enumerate(KEYS[:4]):
                eng.put(k, 50 + 2 * i)
        # engine -> req_id -> kv_id, for live consumer requests
        self.live: dict[str, dict[str, str]] = {n: {} for n in ENGINES}
        self.producers: dict[str, set[str]] = {n: set() for n in ENGINES}
        self.counter = 0
        if fleet:
            self.net.hold_writes = False
            self.net.run(6)  # each dials the others and subscribes
            self.net.hold_writes = True

    # -- requests ---------------------------------------------------------

    @rule(
        me=st.sampled_from(ENGINES),
        src=st.sampled_from(ENGINES),
        kv=st.sampled_from(["k1", "k2", "k3"]),
        req=st.sampled_from(["r1", "r2", "r3", "r4"]),
        probe=st.booleans(),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
    )
    def new_request(
        self, me: str, src: str, kv: str, req: str, probe: bool, keys: list[bytes]
    ) -> None:
        if me == src or req in self.live[me] or req in self.producers[me]:
            return
        m = self.net.engines[me].manager
        m.on_new_request(req, self.net.roles(src, kv, probe), self.net.now)
        self.live[me][req] = kv
        for k in keys:
            m.lookup(req, k)

    @rule(
        me=st.sampled_from(ENGINES),
        kv=st.sampled_from(["k1", "k2"]),
        req=st.sampled_from(["p1", "p2"]),
        n=st.integers(1, 4),
    )
    def new_producer_with_store(self, me: str, kv: str, req: str, n: int) -> None:
        if req in self.producers[me] or req in self.live[me]:
            return
        eng = self.net.engines[me]
        roles = Roles.parse({"remote_decoder": {"kv_request_id": kv}})
        eng.manager.on_new_request(req, roles, self.net.now)
        self.producers[me].add(req)
        job = eng.new_job()
        eng.store(job, req, KEYS[:n], [50 + 2 * i for i in range(n)], self.net.now)

    @rule(
        me=st.sampled_from(ENGINES),
        req=st.sampled_from(["n1", "n2", "n3"]),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
    )
    def request_naming_no_source(self, me: str, req: str, keys: list[bytes]) -> None:
        """What a router that knows nothing of KV sends: the directory (if
        on) answers its lookups."""
        if req in self.live[me] or req in self.producers[me]:
            return
        m = self.net.engines[me].manager
        m.on_new_request(req, Roles(), self.net.now)
        self.live[me][req] = ""
        for k in keys:
            m.lookup(req, k)

    @rule(me=st.sampled_from(ENGINES), n=st.integers(1, 4))
    def primary_stores(self, me: str, n: int) -> None:
        """The engine's primary tier stored blocks it holds: vLLM cascades
        them to the tier as a store job (the directory's feed)."""
        eng = self.net.engines[me]
        self.counter += 1
        job = eng.new_job()
        eng.store(
            job,
            f"s{self.counter}",
            KEYS[:n],
            [50 + 2 * i for i in range(n)],
            self.net.now,
        )

    @rule(
        data=st.data(),
        me=st.sampled_from(ENGINES),
        src=st.sampled_from(ENGINES),
        req=st.sampled_from(["n1", "n2", "n3"]),
    )
    def found_request_then_load(
        self, data: st.DataObject, me: str, src: str, req: str
    ) -> None:
        """The directory's common path in one rule: a member stores, the
        news spreads, a request naming no source looks up and loads."""
        if me == src or req in self.live[me] or req in self.producers[me]:
            return
        self.primary_stores(src, 4)
        self.step(3)
        self.request_naming_no_source(me, req, KEYS[:4])
        self.submit_load(data, me, req)

    @rule(me=st.sampled_from(ENGINES), n=st.integers(0, 4))
    def primary_evicts(self, me: str, n: int) -> None:
        """The engine's primary tier evicts blocks without telling anyone:
        directory entries naming them go stale."""
        eng = self.net.engines[me]
        for k in KEYS[n:4]:
            eng.primary.pop(k, None)

    @rule(data=st.data(), me=st.sampled_from(ENGINES))
    def lookup_again(self, data: st.DataObject, me: str) -> None:
        if not self.live[me]:
            return
        req = data.draw(st.sampled_from(sorted(self.live[me])))
        k = data.draw(st.sampled_from(KEYS))
        self.net.engines[me].manager.lookup(req, k)

    @rule(
        data=st.data(),
        me=st.sampled_from(ENGINES),
        src=st.sampled_from(ENGINES),
        kv=st.sampled_from(["k1", "k2", "k3"]),
        req=st.sampled_from(["r1", "r2", "r3", "r4"]),
        probe=st.booleans(),
    )
    def request_then_load(
        self, data: st.DataObject, me: str, src: str, kv: str, req: str, probe: bool
    ) -> None:
        """The common path in one rule, so that most runs get loads in flight
        for the other rules to interfere with."""
        if me == src or req in self.live[me] or req in self.producers[me]:
            return
        self.new_request(me, src, kv, req, probe, KEYS[:4])
        self.step(4)
        self.submit_load(data, me, req)

    @rule(data=st.data(), me=st.sampled_from(ENGINES))
    def submit_load(self, data: st.DataObject, me: str, req: str | None = None) -> None:
        if not self.live[me]:
            return
        eng = self.net.engines[me]
        if req is None:
            req = data.draw(st.sampled_from(sorted(self.live[me])))
        hits = [k for k in KEYS if eng.manager.lookup(req, k) is Answer.HIT]
        free = [s for s in range(NBLOCKS // 2) if s not in eng.slot_owner]
        if not hits or len(free) < len(hits):
            return
        slots = data.draw(st.permutations(free).map(lambda p: p[: len(hits)]))
        job = eng.new_job()
        for s in slots:
            eng.slot_owner[s] = job
        eng.expect[job] = (hits, slots)
        eng.manager.submit_load(job, req, hits, slots, self.net.now)

    @rule(data=st.data(), me=st.sampled_from(ENGINES))
    def finish(self, data: st.DataObject, me: str) -> None:
        reqs = sorted(set(self.live[me]) | self.producers[me])
        if not reqs:
            return
        req = data.draw(st.sampled_from(reqs))
        self.net.engines[me].manager.on_request_finished(req, self.net.now)
        self.live[me].pop(req, None)
        self.producers[me].discard(req)

    # -- the network and the clock ----------------------------------------

    @rule(rounds=st.integers(1, 4))
    def step(self, rounds: int) -> None:
        """Engine steps: flush, deliver, serve, and poll results (vLLM polls
        get_finished_jobs every step, so slots come back as soon as allowed)."""
        for _ in range(rounds):
            self.net.step()
            self.net.serve()
            for eng in self.net.engines.values():
                eng.collect(self.net.now)

    @rule(n=st.integers(1, 3))
    def deliver_some(self, n: int) -> None:
        queue, self.net.queue = self.net.queue[:n], self.net.queue[n:]
        for item in queue:
            self.net.deliver(item)

    @precondition(lambda self: bool(self.net.queue))
    @rule(i=st.integers(0, 50))
    def drop_one(self, i: int) -> None:
        self.net.queue.pop(i % len(self.net.queue))

    @rule(hold=st.booleans())
    def hold_writes(self, hold: bool) -> None:
        self.net.hold_writes = hold

    @rule(ok=st.booleans())
    def complete_writes(self, ok: bool) -> None:
        self.net.complete_writes(ok)

    @rule(dt=st.sampled_from([0.05, 0.2, 0.5]))
    def advance(self, dt: float) -> None:
        self.net.advance(dt)
        self.net.step()

    @rule(me=st.sampled_from(ENGINES), dt=st.sampled_from([0.5, 1.0]))
    def stall_others(self, me: str, dt: float) -> None:
        """Only ``me`` runs for ``dt`` (the others are in a long step): its
        deadlines fire and its engine takes back what it released, while
        the others' transfers are still in flight, unticked."""
        self.net.advance(dt)
        eng = self.net.engines[me]
        eng.manager.tick(self.net.now)
        eng.manager.end_step(self.net.now)
        eng.collect(self.net.now)

    @rule(a=st.sampled_from(ENGINES), b=st.sampled_from(ENGINES))
    def cut(self, a: str, b: str) -> None:
        self.net.cut(a, b)

    @rule(me=st.sampled_from(ENGINES))
    def close_sessions(self, me: str) -> None:
        self.net.engines[me].manager.close_all("test close")

    @rule(me=st.sampled_from(ENGINES))
    def reset(self, me: str) -> None:
        """A cache reset: unwritten pins go back, offered ones are revoked."""
        self.net.engines[me].manager.release_for_reset(self.net.now)

    @rule(me=st.sampled_from(ENGINES))
    def collect(self, me: str) -> None:
        self.net.engines[me].collect(self.net.now)

    # -- invariants ---------------------------------------------------------

    @invariant()
    def failed_ids_are_live_unfinished_requests(self) -> None:
        for name, eng in self.net.engines.items():
            assert eng.manager.requests.failed_ids() <= set(self.live[name]), name

    @invariant()
    def no_write_lands_in_a_released_slot(self) -> None:
        assert not self.net.violations, self.net.violations

    @invariant()
    def a_successful_load_holds_its_blocks(self) -> None:
        for eng in self.net.engines.values():
            assert not eng.wrong_bytes, eng.wrong_bytes

    @invariant()
    def at_most_one_result_per_job(self) -> None:
        for eng in self.net.engines.values():
            assert all(len(r) == 1 for r in eng.results.values())
            assert set(eng.results) <= eng.submitted
            assert eng.manager.double_results == 0

    @invariant()
    def key_counts_are_exact(self) -> None:
        """The counts the engine-wide bounds read, kept as things change:
        each session's waiting-fetch keys (by the serves as they leave
        FETCH_WAITING) against a scan of its serves, and the engine's
        queued lookup keys against the sum of its sessions'."""
        for eng in self.net.engines.values():
            for s in eng.manager.sessions():
                scan = sum(
                    len(sv.fetch.keys)
                    for sv in s.serves()
                    if sv.state is State.FETCH_WAITING and sv.fetch is not None
                )
                assert s.waiting_fetch_keys() == scan
            m = eng.manager
            queued = sum(s.pending_lookup_keys() for s in m.sessions())
            assert m.pending_lookup_keys() == queued
            waiting = sum(s.waiting_fetch_keys() for s in m.sessions())
            assert m.waiting_fetch_keys() == waiting

    def teardown(self) -> None:
        if not hasattr(self, "net"):
            return
        net = self.net
        for name, eng in net.engines.items():
            for req in sorted(set(self.live[name]) | self.producers[name]):
                eng.manager.on_request_finished(req, net.now)
        net.settle(8.0, 0.1)  # every deadline (TTLs <= 2 s) has passed
        assert not net.violations, net.violations
        for name, eng in net.engines.items():
            assert not eng.wrong_bytes, eng.wrong_bytes
            residue = {k: v for k, v in eng.manager.state_report().items() if v}
            assert not residue, f"{name}: {residue}"
            assert not eng.pin_count, f"{name}: pinned {eng.pin_count}"
            missing = eng.submitted - set(eng.results)
            assert not missing, f"{name}: jobs without a result {missing}"
            assert eng.manager.requests.failed_ids() == frozenset()


Fleet.TestCase.settings = SETTINGS
test_fleet = Fleet.TestCase


class _Draws:
    """Stands in for hypothesis' data object: the draws of a found case."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object, label: object = None) -> object:
        return self.values.pop(0)


def test_fleet_a_write_that_ends_its_session_at_a_tick() -> None:
    """A case the fleet found: a producer's write past its deadline, then
    the data plane's report overdue, ends the session inside ``tick``; the
    tick went on firing the timers of serves the session had just handed
    to the manager as orphans, which the manager later timed out again
    (IllegalTransition). Replayed as found, with every invariant checked."""
    f = Fleet()

    def check() -> None:
        f.a_successful_load_holds_its_blocks()
        f.at_most_one_result_per_job()
        f.failed_ids_are_live_unfinished_requests()
        f.no_write_lands_in_a_released_slot()

    f.start(reads=True)
    steps = [
        lambda: f.request_then_load(_Draws(), "a", "b", "k1", "r2", True),  # type: ignore[arg-type]
        *[lambda: f.advance(0.05)] * 13,
        lambda: f.stall_others("a", 0.5),
        lambda: f.step(1),
        lambda: f.submit_load(_Draws("r2", [0, 1, 2, 3]), "a"),  # type: ignore[arg-type]
        *[lambda: f.advance(0.05)] * 4,
        lambda: f.request_then_load(_Draws([4, 5, 6, 7]), "a", "b", "k1", "r1", True),  # type: ignore[arg-type]
        lambda: f.advance(0.5),
        lambda: f.stall_others("b", 1.0),
        lambda: f.advance(0.05),
    ]
    for run in steps:
        run()
        check()
    f.teardown()
