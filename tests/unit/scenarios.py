"""Scenario helpers over :mod:`tests.unit.memnet`, shared by the manager's
scenario files: engine ``a`` holds :data:`KEYS` at scattered slots, ``b``
asks for them; probing, loading, collecting and checking that nothing is
left."""

from __future__ import annotations

from p2p_kv.node.manager import Answer, JobResult

from .memnet import Net, key

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


def until_read_posted(net: Net, rounds: int = 10) -> None:
    """Steps, transfers held, until b's READ is posted; no WRITE may be."""
    net.hold_writes = True
    for _ in range(rounds):
        net.run(1)
        assert not net.writes, net.writes
        if net.reads:
            return
    raise AssertionError(f"no READ posted in {rounds} steps")
