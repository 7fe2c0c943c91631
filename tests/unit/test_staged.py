"""The staging pool and the copy out of staging, on the caller's thread or
the copy threads (the READs that use them are tested between real NIXL
agents in test_nixl_transfer)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from p2p_kv.data import staged
from p2p_kv.data.copy_out import INLINE_COPY_BYTES, CopyThreads
from p2p_kv.data.staged import StagingMemory, StagingPool


def test_blocks_go_lowest_first_and_only_what_is_free() -> None:
    pool = StagingPool(5)
    a = pool.take(2)
    assert a.tolist() == [0, 1] and pool.free == 3
    b = pool.take(9)  # more than is free: what is free
    assert b.tolist() == [2, 3, 4] and pool.free == 0
    assert pool.take(1).size == 0
    pool.give(np.array([1, 3], dtype=np.int64))
    assert pool.take(5).tolist() == [1, 3]
    assert pool.take(0).size == 0 and pool.size == 5


def test_giving_back_a_block_not_taken_is_refused_and_changes_nothing() -> None:
    pool = StagingPool(3)
    pool.take(1)
    with pytest.raises(ValueError, match=r"\[0, 1\] were not taken"):
        pool.give(np.array([0, 1], dtype=np.int64))
    assert pool.free == 2
    with pytest.raises(ValueError, match="needs blocks"):
        StagingPool(0)


def test_copy_out_puts_each_staging_block_in_its_slot() -> None:
    bs, n = 64, 8
    region = np.zeros(n * bs, dtype=np.uint8)
    mem = StagingMemory(3, bs, region.ctypes.data, region.nbytes)
    assert mem.nbytes == 3 * bs and mem.device_id == 0
    stage = np.frombuffer(
        (
            np.ctypeslib.as_array(
                (np.ctypeslib.ctypes.c_uint8 * mem.nbytes).from_address(mem.addr)
            )
        ),
        dtype=np.uint8,
    ).reshape(3, bs)
    stage[:] = np.arange(1, 4, dtype=np.uint8)[:, None]
    mem.copy_out(np.array([2, 0], dtype=np.int64), np.array([5, 1], dtype=np.int64))
    rows = region.reshape(n, bs)
    assert (rows[5] == 3).all() and (rows[1] == 1).all()
    assert not rows[[0, 2, 3, 4, 6, 7]].any()


@pytest.mark.parametrize("n", [5, 100])
def test_copy_out_by_runs_matches_row_by_row(n: int) -> None:
    """Runs merge only where both sides are consecutive (short loads in one
    pass, long ones through the planner): any mapping lands row by row."""
    bs, rows = 16, 2 * n + 4
    rng = np.random.default_rng(n)
    region = np.zeros(rows * bs, dtype=np.uint8)
    mem = StagingMemory(n, bs, region.ctypes.data, region.nbytes)
    buf = np.ctypeslib.as_array(
        (np.ctypeslib.ctypes.c_uint8 * mem.nbytes).from_address(mem.addr)
    ).reshape(n, bs)
    buf[:] = rng.integers(1, 256, (n, bs), dtype=np.uint8)
    stage = np.arange(n, dtype=np.int64)
    slots = np.concatenate(
        [
            np.arange(3, 3 + n // 2),
            rng.permutation(np.arange(n + 4, 2 * n + 4))[: n - n // 2],
        ]
    ).astype(np.int64)
    mem.copy_out(stage, slots)
    got = region.reshape(rows, bs)
    for s, d in zip(stage.tolist(), slots.tolist(), strict=True):
        assert np.array_equal(got[d], buf[s]), (s, d)
    untouched = sorted(set(range(rows)) - set(slots.tolist()))
    assert not got[untouched].any()


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_stripes_cover_every_segment_once_in_about_equal_parts(k: int) -> None:
    segments = [  # 12 blocks
        (0, np.array([10, 12, 14, 16, 18])),
        (7, np.array([30])),
        (9, np.array([40, 41, 42, 43, 44, 45])),
    ]
    parts = staged._stripes(segments, k)
    assert len(parts) <= k
    sizes = [sum(int(slots.size) for _, slots in p) for p in parts]
    assert sum(sizes) == 12 and max(sizes) - min(sizes) <= -(-12 // k)
    got = sorted(
        (s + i, int(d)) for p in parts for s, sl in p for i, d in enumerate(sl)
    )
    want = sorted((s + i, int(d)) for s, sl in segments for i, d in enumerate(sl))
    assert got == want


@pytest.mark.parametrize(
    ("stage", "cut"),
    [
        ([4, 5, 6, 7], [4]),  # one run, whatever the slots
        ([3], [3]),
        ([0, 1, 5, 6, 2], [0, 5, 2]),  # cut where the run breaks
        ([7, 6, 5], [7, 6, 5]),  # descending: a segment a block
        ([2, 0, 1, 3], [2, 0, 3]),  # same span as a run, not in order: not one
    ],
)
def test_segments_are_the_runs_of_staging_blocks(
    stage: list[int], cut: list[int]
) -> None:
    slots = np.arange(100, 100 + len(stage), dtype=np.int64)[::-1].copy()
    segments = staged._segments(np.array(stage, dtype=np.int64), slots)
    assert [start for start, _ in segments] == cut
    pairs = [(s + i, int(d)) for s, sl in segments for i, d in enumerate(sl)]
    assert pairs == list(zip(stage, slots.tolist(), strict=True))


def test_a_large_piece_is_copied_on_the_threads_and_lands_row_by_row() -> None:
    """A piece of INLINE_COPY_BYTES or more is copied in stripes off the
    caller's thread; every staging block still lands in its slot, and the
    owner's wake is called once the copy has ended."""
    bs = 64 * 1024
    n = 2 * INLINE_COPY_BYTES // bs
    region = np.zeros((3 * n) * bs, dtype=np.uint8)
    mem = StagingMemory(n, bs, region.ctypes.data, region.nbytes)
    stage_rows = np.frombuffer(
        (np.ctypeslib.ctypes.c_uint8 * mem.nbytes).from_address(mem.addr),
        dtype=np.uint8,
    ).reshape(n, bs)
    stage_rows[:] = (np.arange(n, dtype=np.uint8) + 1)[:, None]
    threads = CopyThreads(3)
    woke = threading.Event()
    threads.wake = woke.set
    stage = np.arange(n, dtype=np.int64)[::-1].copy()
    slots = np.arange(0, 2 * n, 2, dtype=np.int64)  # nothing coalesces
    try:
        copying = mem.copy_out(stage, slots, threads)
        assert copying is not None  # went to the threads
        assert copying.wait() is None and copying.done()
        assert woke.wait(5)
        rows = region.reshape(3 * n, bs)
        for s, d in zip(stage.tolist(), slots.tolist(), strict=True):
            assert (rows[d] == s + 1).all()
        assert not rows[1::2].any()
        # A small piece is copied on the caller's thread: nothing to wait for.
        assert mem.copy_out(stage[:1], np.array([1], dtype=np.int64), threads) is None
        assert (rows[1] == stage[0] + 1).all()
    finally:
        threads.close()
    assert not any(t.name.startswith("p2p_kv-copy") for t in threading.enumerate())


def test_a_stripe_that_fails_is_the_copys_error_and_the_threads_go_on() -> None:
    threads = CopyThreads(2)
    try:

        def boom() -> None:
            raise OSError("bad address")

        done: list[int] = []
        failed = threads.run([boom, lambda: done.append(1)])
        err = failed.wait()
        assert isinstance(err, OSError) and "bad address" in str(err)
        ok = threads.run([lambda: done.append(2), lambda: done.append(3)])
        assert ok.wait() is None and sorted(done) == [1, 2, 3]
    finally:
        threads.close()


def test_a_caller_that_waits_copies_the_stripes_no_thread_has_taken() -> None:
    """The last piece of a load overlaps nothing: the engine's thread, which
    would only wait, copies what is still queued instead of waiting for a
    copy thread to wake (or, as here, to come free)."""
    threads = CopyThreads(1)
    taken, release = threading.Event(), threading.Event()
    ran_on: list[str] = []
    try:
        busy = threads.run([lambda: taken.set() or release.wait(5) or None])
        assert taken.wait(5)  # the only thread is busy with that one
        queued = threads.run(
            [lambda: (ran_on.append(threading.current_thread().name), release.set())]
        )
        assert queued.wait() is None and queued.done()
        assert ran_on[-1] == threading.current_thread().name  # the caller copied it
        assert busy.wait() is None
    finally:
        threads.close()


def test_an_engine_pinned_to_one_core_copies_on_its_own_thread() -> None:
    """Copy threads that share the engine's one core with the READ overlap
    nothing and cost a wake-up a piece: a caller whose affinity is one core
    gets none, and a large piece is copied before copy_out returns."""
    bs = 64 * 1024
    n = 2 * INLINE_COPY_BYTES // bs
    region = np.zeros(2 * n * bs, dtype=np.uint8)
    mem = StagingMemory(n, bs, region.ctypes.data, region.nbytes)
    seen: dict[str, object] = {}

    def pinned() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        threads = CopyThreads()
        seen["usable"] = threads.usable()
        seen["copying"] = mem.copy_out(
            np.arange(n, dtype=np.int64),
            np.arange(0, 2 * n, 2, dtype=np.int64),
            threads,
        )
        threads.close()

    t = threading.Thread(target=pinned)
    t.start()
    t.join(10)
    assert seen == {"usable": 0, "copying": None}
    cores = len(os.sched_getaffinity(0))
    assert CopyThreads().usable() == (min(4, cores) if cores > 1 else 0)
