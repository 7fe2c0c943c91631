"""The directory and the requests it finds a source for.

The arrays first (:mod:`p2p_kv.node.directory`: bounds, stale entries, 16 bytes
an entry), then three managers wired in memory (:mod:`tests.unit.memnet`)
with a ``peers`` key naming them all: a request that names no source is
answered from the directory with no round trip, loads the right bytes from
the member holding its prefix, moves to the next holder when the first no
longer holds it, and leaves nothing behind.
"""

from __future__ import annotations

import numpy as np
import pytest

from p2p_kv.node.consumer_legs import Answer
from p2p_kv.node.directory import (
    Directory,
    MemberBlocks,
    OwnHoldings,
    fingerprint,
    pack,
    unpack,
)
from p2p_kv.node.roles import Roles
from p2p_kv.protocol import Holdings, ProtocolError, decode, encode
from tests.unit.memnet import NBLOCKS, Net, key


def fps(*ns: int) -> np.ndarray:
    return np.asarray([fingerprint(key(n)) for n in ns], dtype=np.uint64)


def test_a_member_holds_at_most_its_size_the_oldest_going_first() -> None:
    blocks = MemberBlocks(cap=3)
    blocks.add(fps(1, 2))
    blocks.add(fps(2, 3, 4))  # 2 again: no second entry
    assert [blocks.holds(int(f)) for f in fps(1, 2, 3, 4)] == [False, True, True, True]
    assert len(blocks) == 3


def test_dropped_entries_are_not_found_and_their_memory_comes_back() -> None:
    blocks = MemberBlocks(cap=10_000)
    blocks.add(fps(*range(5000)))
    blocks.drop(fps(*range(4000)))
    assert not blocks.holds(int(fps(10)[0])) and blocks.holds(int(fps(4500)[0]))
    assert len(blocks) == 1000
    assert len(blocks.order) <= 2 * len(blocks) + 4096


def test_a_block_dropped_then_stored_again_is_held() -> None:
    blocks = MemberBlocks(cap=10_000)
    blocks.add(fps(*range(6000)))  # past the merge: most in the large array
    blocks.drop(fps(1, 5999))
    assert not blocks.holds(int(fps(1)[0])) and not blocks.holds(int(fps(5999)[0]))
    blocks.add(fps(1))
    assert blocks.holds(int(fps(1)[0])) and len(blocks) == 5999
    blocks.drop(fps(*range(6000)))
    assert len(blocks) == 0 and not blocks.holds(int(fps(1)[0]))


def test_sixteen_bytes_an_entry_at_100k_blocks_a_member() -> None:
    d = Directory()
    rng = np.random.default_rng(0)
    for m in ("m1:1", "m2:1"):
        d.join(m, 100_000)
        for _ in range(100):
            d.update(m, rng.integers(0, 2**63, 1000, dtype=np.uint64), fps())
    assert d.entries() == 200_000
    assert d.nbytes() / d.entries() == 16
    d.leave("m1:1")
    assert d.entries() == 100_000


def test_holdings_travel_as_8_byte_words_and_a_ragged_list_is_refused() -> None:
    got = decode(encode(Holdings(add=pack(fps(1, 2).tolist()))))
    assert isinstance(got, Holdings)
    assert unpack(got.add).tolist() == fps(1, 2).tolist()
    with pytest.raises(ProtocolError, match="8-byte words"):
        decode(encode(Holdings(add=b"\0" * 9)))


def test_what_we_hold_goes_out_once_and_a_new_subscriber_gets_it_all() -> None:
    own = OwnHoldings(4)
    own.stored([key(1), key(2)])
    assert sorted(own.take().tolist()) == sorted(fps(1, 2).tolist())
    own.stored([key(2), key(3)])
    assert own.take().tolist() == fps(3).tolist()
    assert sorted(own.snapshot().tolist()) == sorted(fps(1, 2, 3).tolist())


# -- three engines, a peers key naming them all ------------------------------

KEYS = [key(n) for n in range(4)]


def fleet() -> Net:
    net = Net(("a", "b", "c"), fleet=True)
    net.run(8)  # each dials the others and subscribes
    for name in "abc":
        m = net.engines[name].manager
        assert m.finder is not None
        assert sorted(m.finder.directory.members) == sorted(
            f"{o}:1" for o in "abc" if o != name
        ), name
    return net


def compute(net: Net, name: str, keys: list[bytes], first_slot: int = 10) -> None:
    """Engine ``name`` computes a prompt: its primary tier stores the
    blocks, and vLLM cascades them to the tier as a store job."""
    eng = net.engines[name]
    slots = list(range(first_slot, first_slot + len(keys)))
    for k, s in zip(keys, slots, strict=True):
        eng.put(k, s)
    job = eng.new_job()
    eng.manager.submit_store(job, f"{name}-prompt", keys, slots, net.now)
    net.run(3)
    eng.collect(net.now)


def load(net: Net, name: str, req: str, keys: list[bytes]) -> tuple[list[Answer], int]:
    """vLLM's calls for a request that names no source: its lookups, then a
    load of the hits; the answers and the load's job."""
    eng = net.engines[name]
    m = eng.manager
    m.on_new_request(req, Roles(), net.now)
    answers = [m.lookup(req, k) for k in keys]
    hits = [k for k, a in zip(keys, answers, strict=True) if a is Answer.HIT]
    job = eng.new_job()
    slots = list(range(40, 40 + len(hits)))
    for s in slots:
        eng.slot_owner[s] = job
    eng.expect[job] = (hits, slots)
    m.submit_load(job, req, hits, slots, net.now)
    return answers, job


def finish(net: Net, name: str, req: str) -> None:
    net.engines[name].manager.on_request_finished(req, net.now)


def test_a_request_naming_no_source_is_answered_at_once_and_loads_the_right_bytes() -> (
    None
):
    net = fleet()
    compute(net, "a", KEYS)
    answers, job = load(net, "b", "r1", [*KEYS, key(99)])
    # Every answer at once, from memory: no RETRY, no round trip.
    assert answers == [Answer.HIT] * 4 + [Answer.MISS]
    net.run(6)
    b = net.engines["b"]
    b.collect(net.now)
    assert [r.success for r in b.results[job]] == [True]
    assert not b.wrong_bytes and not net.violations
    finish(net, "b", "r1")
    net.settle(3.0, 0.1)
    for eng in net.engines.values():
        report = eng.manager.state_report()
        assert not {k: v for k, v in report.items() if v}, (eng.name, report)


def test_a_stale_entry_moves_the_load_to_the_next_holder() -> None:
    net = fleet()
    compute(net, "a", KEYS)
    compute(net, "c", KEYS, first_slot=20)
    b = net.engines["b"]
    answers, job = load(net, "b", "r1", KEYS)
    assert answers == [Answer.HIT] * 4
    consumer = b.manager.requests.by_id["r1"].consumer
    assert consumer is not None
    first = consumer.source.peer
    # The member asked first evicted them without saying so: its entries in
    # b's directory are stale.
    net.engines[first.split(":")[0]].primary.clear()
    net.run(10)
    b.collect(net.now)
    assert [r.success for r in b.results[job]] == [True]
    assert not b.wrong_bytes and not net.violations
    finder = b.manager.finder
    assert finder is not None
    assert finder.failovers == 1 and finder.directory.stale_blocks >= 1
    finish(net, "b", "r1")
    net.settle(3.0, 0.1)
    assert not {k: v for k, v in b.manager.state_report().items() if v}


def test_with_no_holder_left_the_load_fails_and_the_request_recomputes() -> None:
    net = fleet()
    compute(net, "a", KEYS)
    net.engines["a"].primary.clear()
    b = net.engines["b"]
    _answers, job = load(net, "b", "r1", KEYS)
    net.run(10)
    b.collect(net.now)
    assert [(r.success, r.reason) for r in b.results[job]] == [
        (False, "directory_stale")
    ]
    # The request recomputes: its lookups miss from now on.
    assert b.manager.lookup("r1", KEYS[0]) is Answer.MISS
    finish(net, "b", "r1")
    net.settle(3.0, 0.1)
    assert not {k: v for k, v in b.manager.state_report().items() if v}


def test_a_member_that_leaves_leaves_the_directory() -> None:
    net = fleet()
    compute(net, "a", KEYS)
    b = net.engines["b"].manager
    assert b.finder is not None and "a:1" in b.finder.directory.members
    net.cut("a", "b")
    net.run(4)
    assert "a:1" not in b.finder.directory.members
    b.on_new_request("r1", Roles(), net.now)
    assert b.lookup("r1", KEYS[0]) is Answer.MISS
    finish(net, "b", "r1")


def test_an_engine_never_dials_itself_twice() -> None:
    net = fleet()
    for name in "abc":
        finder = net.engines[name].manager.finder
        assert finder is not None
        assert f"{name}:1" not in finder.directory.members


def test_members_bound_what_they_say_they_hold_by_their_size() -> None:
    net = fleet()
    many = [key(1000 + n) for n in range(NBLOCKS + 8)]
    a = net.engines["a"]
    for i in range(0, len(many), 8):
        job = a.new_job()
        a.manager.submit_store(job, "a-big", many[i : i + 8], list(range(8)), net.now)
        net.run(2)
    a.collect(net.now)
    b = net.engines["b"].manager
    assert b.finder is not None
    assert len(b.finder.directory.members["a:1"]) == NBLOCKS


def test_a_member_lost_mid_load_hands_the_load_to_the_next_holder() -> None:
    net = fleet()
    compute(net, "a", KEYS)
    compute(net, "c", KEYS, first_slot=20)
    b = net.engines["b"]
    _answers, job = load(net, "b", "r1", KEYS)
    consumer = b.manager.requests.by_id["r1"].consumer
    assert consumer is not None
    first = consumer.source.peer.split(":")[0]
    net.hold_writes = True  # the READ stays in flight
    for _ in range(4):
        net.step()
        net.serve()
    assert net.reads, "the READ was not posted"
    net.cut(first, "b")  # the member dies mid-READ
    net.hold_writes = False
    net.run(10)
    b.collect(net.now)
    assert [r.success for r in b.results[job]] == [True]
    assert not b.wrong_bytes and not net.violations
    finder = b.manager.finder
    assert finder is not None and finder.failovers == 1
    assert f"{first}:1" not in finder.directory.members
    finish(net, "b", "r1")
    net.settle(3.0, 0.1)
    assert not {k: v for k, v in b.manager.state_report().items() if v}
