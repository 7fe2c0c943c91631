"""Block mappings: validation and coalescing (pure; no NIXL, no I/O)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from p2p_kv.data.plan import _plan_np, _plan_py, coalesce, plan_write

# -- coalescing ---------------------------------------------------------------


def test_adjacent_pairs_become_one_run() -> None:
    assert coalesce([4, 5, 6, 7], [10, 11, 12, 13]) == [(4, 10, 4)]


def test_single_block() -> None:
    assert coalesce([3], [9]) == [(3, 9, 1)]


def test_non_adjacent_pairs_stay_separate() -> None:
    assert coalesce([0, 2, 4], [1, 3, 5]) == [(0, 1, 1), (2, 3, 1), (4, 5, 1)]


def test_run_breaks_when_only_one_side_is_consecutive() -> None:
    # src consecutive, dst not
    assert coalesce([0, 1, 2], [5, 6, 9]) == [(0, 5, 2), (2, 9, 1)]
    # dst consecutive, src not
    assert coalesce([0, 1, 3], [5, 6, 7]) == [(0, 5, 2), (3, 7, 1)]


def test_mixed_runs_and_gaps() -> None:
    src = [0, 1, 2, 10, 11, 20]
    dst = [7, 8, 9, 3, 4, 50]
    assert coalesce(src, dst) == [(0, 7, 3), (10, 3, 2), (20, 50, 1)]


def test_reversed_mapping_still_coalesces() -> None:
    # Pairs given back to front: ordering by source recovers the run.
    assert coalesce([3, 2, 1], [7, 6, 5]) == [(1, 5, 3)]


def test_opposite_directions_do_not_coalesce() -> None:
    assert coalesce([1, 2, 3], [7, 6, 5]) == [(1, 7, 1), (2, 6, 1), (3, 5, 1)]


def test_shuffled_input_gives_same_runs_as_sorted() -> None:
    rng = random.Random(1)
    pairs = [(i, 100 + i) for i in range(10)] + [(20 + i, 3 + i) for i in range(5)]
    rng.shuffle(pairs)
    src, dst = zip(*pairs, strict=True)
    assert coalesce(list(src), list(dst)) == [(0, 100, 10), (20, 3, 5)]


@pytest.mark.parametrize(
    ("src", "dst", "bad"),
    [
        ([1, 1], [2, 3], "src block index 1 appears more than once"),
        ([1, 2], [3, 3], "dst block index 3 appears more than once"),
        ([5, 6, 5], [0, 1, 2], "src block index 5"),
    ],
)
def test_duplicates_rejected(src: list[int], dst: list[int], bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        coalesce(src, dst)


def test_length_mismatch_rejected() -> None:
    with pytest.raises(ValueError, match="2 entries but dst_blocks has 1"):
        coalesce([1, 2], [3])


def test_empty_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        coalesce([], [])


def test_negative_index_rejected() -> None:
    with pytest.raises(ValueError, match="src block index -1"):
        coalesce([-1], [0])


def test_non_integer_indices_rejected() -> None:
    with pytest.raises(ValueError, match="integers"):
        coalesce([1.5], [0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="integers"):
        coalesce([True], [0])


def test_numpy_indices_accepted() -> None:
    src = np.array([0, 1], dtype=np.int32)
    dst = np.array([4, 5], dtype=np.uint16)
    assert coalesce(src, dst) == [(0, 4, 2)]


@pytest.mark.parametrize("seed", range(25))
def test_runs_cover_mapping_exactly(seed: int) -> None:
    """Expanding the runs gives back exactly the input pairs, and runs are maximal."""
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    src = rng.sample(range(200), n)
    dst = rng.sample(range(200), n)
    if seed % 3 == 0:  # make long runs likely
        src.sort()
        dst.sort()
    runs = coalesce(src, dst)
    expanded = {(s + k, d + k) for s, d, c in runs for k in range(c)}
    assert expanded == set(zip(src, dst, strict=True))
    assert sum(c for _, _, c in runs) == n
    ends = {(s + c, d + c) for s, d, c in runs}
    starts = {(s, d) for s, d, _ in runs}
    assert not (ends & starts), "two runs could have been merged"


# -- range checks -----------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 200], ids=["python", "numpy"])
def test_range_check_names_bad_dst_index(n: int) -> None:
    src = list(range(n))
    dst = list(range(n))
    dst[1] = 8 * n
    with pytest.raises(
        ValueError,
        match=rf"dst block index {8 * n} \(position 1\).*remote region of {8 * n}",
    ):
        plan_write(src, dst, local_blocks=n, remote_blocks=8 * n)


@pytest.mark.parametrize("n", [1, 200], ids=["python", "numpy"])
def test_range_check_names_bad_src_index(n: int) -> None:
    src = list(range(n))
    src[-1] = n
    with pytest.raises(ValueError, match=rf"src block index {n} .*local region of {n}"):
        plan_write(src, list(range(n)), local_blocks=n, remote_blocks=8 * n)


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize(
    "wrapping",
    [
        [0, 5, -(2**63), -3],  # rises by its int64 diffs, all inside "bounds"
        [5, 5 + 2**62, -(2**63) + 5, -(2**62) + 5, 5],  # a duplicate, rising
        [2**63 - 1, -(2**63)],  # "adjacent": one run of two far-off blocks
    ],
)
def test_indices_that_wrap_int64_are_refused(side: str, wrapping: list[int]) -> None:
    """The numpy planner (128 blocks and more) took a side that rose by its
    int64 differences as sorted and free of duplicates, and checked only its
    first and last index: wrapped differences passed indices far outside the
    region (a negative one became a block counted from the region's end) and
    duplicates, even merged into one run."""
    n, region = 200, 1000
    bad = wrapping + list(range(10, 10 + n - len(wrapping)))
    good = list(range(n))
    src, dst = (bad, good) if side == "src" else (good, bad)
    with pytest.raises(ValueError, match=rf"{side} block index"):
        plan_write(src, dst, local_blocks=region, remote_blocks=region)
    args = (src, dst, region, region)
    assert _outcome(_plan_np, *args) == _outcome(_plan_py, *args)


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("n", [8, 200])  # the Python and numpy planners
def test_an_index_past_int64_is_a_range_error(side: str, n: int) -> None:
    """The numpy planner raised OverflowError, not the ValueError both
    planners promise for a bad index."""
    bad, good = list(range(n)), list(range(n))
    bad[5] = 2**63
    src, dst = (bad, good) if side == "src" else (good, bad)
    with pytest.raises(ValueError, match=rf"{side} block index"):
        plan_write(src, dst, local_blocks=1000, remote_blocks=1000)


def test_range_check_accepts_edges() -> None:
    plan = plan_write([0, 3], [7, 0], local_blocks=4, remote_blocks=8)
    assert plan.runs() == [(0, 7, 1), (3, 0, 1)]


def _random_case(rng: random.Random) -> tuple[list[int], list[int], int, int]:
    n = rng.choice([1, 2, 5, 127, 128, 129, 300])
    nl = n + rng.randint(0, 50)
    nr = n + rng.randint(0, 50)
    src = rng.sample(range(nl), n)
    dst = rng.sample(range(nr), n)
    if rng.random() < 0.5:  # long runs
        src.sort()
        dst.sort()
    fault = rng.randint(0, 5)
    if fault == 1:
        src[rng.randrange(n)] = nl + rng.randint(0, 3)
    elif fault == 2:
        dst[rng.randrange(n)] = -1 - rng.randint(0, 3)
    elif fault == 3 and n > 1:
        dst[-1] = dst[0]
    elif fault == 4 and n > 1:
        src[-1] = src[0]
    return src, dst, nl, nr


def _outcome(f: Any, *args: Any) -> Any:
    try:
        return f(*args).runs()
    except ValueError as exc:
        return ("ValueError", str(exc))


@pytest.mark.parametrize("seed", range(200))
def test_python_and_numpy_planners_agree(seed: int) -> None:
    """Two implementations (each the fast one at its size) must be indistinguishable."""
    rng = random.Random(seed)
    src, dst, nl, nr = _random_case(rng)
    py = _outcome(_plan_py, src, dst, nl, nr)
    vec = _outcome(_plan_np, src, dst, nl, nr)
    assert py == vec
