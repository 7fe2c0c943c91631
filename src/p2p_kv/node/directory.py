"""The directory: which member of the fleet holds which blocks.

A request that names no source (a router that knows nothing of KV: round
robin, a Kubernetes Service, nginx) still finds its prefix if a member
holds it. Each member tells the members that subscribed to it what its
primary tier stored, batched per engine step (``Holdings`` messages of
8-byte block fingerprints); the directory keeps that per member and
answers vLLM's per-block lookups locally, with no round trip and no engine
step of its own: the longest prefix any one member holds is a hit.

It is a hint. A member evicts blocks without saying so, and may die. The
pin that makes a READ safe still comes from the holder, asked at load
time: a stale entry costs the blocks it covered a recompute (counted),
never a wrong byte, a stall or memory past the bounds below.

Memory: a member's entries are two arrays of 8-byte fingerprints, one in
the order they arrived (the oldest go first past the member's bound: its
primary tier's size, as its Hello says, at most
:data:`MAX_BLOCKS_PER_MEMBER`) and one sorted (looked up by bisection),
16 bytes per (block, member) entry. Fingerprints are 64 bits of a
BLAKE2b digest of the key: two keys sharing one (about 1 in 10^9 at 100,000
blocks a member) cost a recompute, as a stale entry does.

Pure: no socket, thread or clock; numpy for the arrays.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

#: A member's entries at most, whatever its Hello says (32 MiB of arrays).
MAX_BLOCKS_PER_MEMBER = 1 << 21
#: Bytes one fingerprint takes on the wire and in each array.
FINGERPRINT_BYTES = 8

Fingerprints = npt.NDArray[np.uint64]


def fingerprint(key: bytes) -> int:
    """The 64-bit fingerprint of a block key, the same in every process
    (Python's own ``hash`` of bytes is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def pack(fps: Iterable[int]) -> bytes:
    """Fingerprints as they go on the wire: little-endian 8-byte words."""
    return np.fromiter(fps, dtype="<u8").tobytes()


def unpack(blob: bytes) -> Fingerprints:
    """The fingerprints of a wire blob (its length a multiple of 8: the
    protocol checks it)."""
    return np.frombuffer(blob, dtype="<u8").astype(np.uint64)


def _contains(arr: Fingerprints, values: Fingerprints) -> npt.NDArray[np.bool_]:
    """Which of ``values`` the sorted ``arr`` holds: a bisection each,
    not a sort of both (``np.isin``), so a step's few new blocks cost
    O(m log n) against a member's 100,000."""
    if not len(arr):
        return np.zeros(len(values), dtype=bool)
    idx = np.searchsorted(arr, values)
    idx[idx == len(arr)] = 0
    return np.asarray(arr[idx] == values)


def _without(arr: Fingerprints, values: Fingerprints) -> Fingerprints:
    """The sorted ``arr`` (no duplicates) without ``values``: one copy."""
    if not len(arr) or not len(values):
        return arr
    values = values[_contains(arr, values)]
    return (
        np.delete(arr, np.searchsorted(arr, np.unique(values))) if len(values) else arr
    )


#: Entries a member's small sorted arrays (new ones, removed ones) hold
#: before they are merged into its large one: a step's few blocks cost a
#: copy of a few thousand entries, not of the member's 100,000.
MERGE_AT = 4096


def _merge(arr: Fingerprints, values: Fingerprints) -> Fingerprints:
    """The sorted ``arr`` with the sorted ``values`` (none in it): one copy."""
    return np.insert(arr, np.searchsorted(arr, values), values) if len(values) else arr


class MemberBlocks:
    """What one member said it holds, at most ``cap`` fingerprints.

    Looked up in a large sorted array, plus two small sorted ones that
    absorb each step's change: ``fresh`` (added since the last merge) and
    ``gone`` (removed since: tombstones). A ring keeps the arrival order, so
    past ``cap`` the oldest go; an entry dropped before it ages out stays in
    the ring as a ghost until then (or until ghosts are most of it)."""

    __slots__ = ("_base", "_count", "_fresh", "_gone", "_ring", "_start", "cap")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._base: Fingerprints = np.empty(0, np.uint64)
        self._fresh: Fingerprints = np.empty(0, np.uint64)
        self._gone: Fingerprints = np.empty(0, np.uint64)
        self._ring: Fingerprints = np.empty(min(cap, 1024), np.uint64)
        self._start = 0
        self._count = 0

    def __len__(self) -> int:
        return len(self._base) + len(self._fresh) - len(self._gone)

    def _held(self, fps: Fingerprints) -> npt.NDArray[np.bool_]:
        inside = _contains(self._base, fps) | _contains(self._fresh, fps)
        return np.asarray(inside & ~_contains(self._gone, fps))

    def holds(self, fp: int) -> bool:
        """One fingerprint, as vLLM asks per block: three bisections, no
        array built (a lookup checks every member)."""
        f = np.uint64(fp)
        gone = self._gone
        if len(gone):
            i = gone.searchsorted(f)
            if i < len(gone) and gone[i] == f:
                return False
        for arr in (self._fresh, self._base):
            i = arr.searchsorted(f)
            if i < len(arr) and arr[i] == f:
                return True
        return False

    @property
    def order(self) -> Fingerprints:
        """Every fingerprint in the ring, oldest first (ghosts included)."""
        n = len(self._ring)
        idx = (self._start + np.arange(self._count)) % n if n else np.arange(0)
        return np.asarray(self._ring[idx], dtype=np.uint64)

    def held_in_order(self) -> Fingerprints:
        """What the member holds, oldest first."""
        order = self.order
        return order[self._held(order)]

    def add(self, fps: Fingerprints) -> None:
        """Fingerprints the member stored; past ``cap`` its oldest go."""
        _, first = np.unique(fps, return_index=True)
        new = fps[np.sort(first)]  # once each, in the order they came
        new = new[~self._held(new)]
        if not len(new):
            return
        up = np.sort(new)
        revived = _contains(self._gone, up)
        self._gone = _without(self._gone, up[revived])
        back = _contains(self._base, up) | _contains(self._fresh, up)
        self._fresh = _merge(self._fresh, up[~back])
        self._append(new)
        self._compact()

    def drop(self, fps: Fingerprints) -> None:
        """Fingerprints the member no longer holds (it said so, or its
        lookup missed them)."""
        gone = np.unique(fps)
        gone = gone[self._held(gone)]
        self._gone = _merge(self._gone, gone)
        self._compact()

    def _append(self, new: Fingerprints) -> None:
        need = self._count + len(new)
        if need > len(self._ring) and len(self._ring) < self.cap:
            grown = np.empty(min(self.cap, max(need, 2 * len(self._ring))), np.uint64)
            grown[: self._count] = self.order
            self._ring, self._start = grown, 0
        n = len(self._ring)
        if len(new) >= n:  # more than the member can hold: the newest stay
            self.drop(self.order)
            new = new[-n:]
            self._start, self._count = 0, 0
        excess = self._count + len(new) - n
        if excess > 0:
            idx = (self._start + np.arange(excess)) % n
            old = self._ring[idx]
            self._start = (self._start + excess) % n
            self._count -= excess
            self.drop(old)
        at = (self._start + self._count + np.arange(len(new))) % n
        self._ring[at] = new
        self._count += len(new)

    def _compact(self) -> None:
        """Merge the small arrays into the large one once either is large,
        and rebuild the ring once ghosts are most of it."""
        if len(self._fresh) > MERGE_AT or len(self._gone) > MERGE_AT:
            self._fresh = _without(self._fresh, self._gone)
            self._base = _merge(_without(self._base, self._gone), self._fresh)
            self._fresh = np.empty(0, np.uint64)
            self._gone = np.empty(0, np.uint64)
        if self._count > 2 * len(self) + MERGE_AT:
            kept = self.held_in_order()
            self._ring = np.empty(max(len(kept), min(self.cap, 1024)), np.uint64)
            self._ring[: len(kept)] = kept
            self._start, self._count = 0, len(kept)

    @property
    def nbytes(self) -> int:
        arrays = (self._base, self._fresh, self._gone, self._ring)
        return int(sum(a.nbytes for a in arrays))


class Directory:
    """Members' holdings, by the address we dial each at."""

    def __init__(self) -> None:
        self.members: dict[str, MemberBlocks] = {}
        #: stale entries found (a holder's lookup missed what it was said
        #: to hold), in blocks: each cost a recompute
        self.stale_blocks = 0

    def join(self, member: str, num_blocks: int) -> None:
        """``member``'s session is up: it holds at most ``num_blocks``
        (its primary tier, as its Hello says)."""
        cap = max(1, min(num_blocks, MAX_BLOCKS_PER_MEMBER))
        known = self.members.get(member)
        if known is None or known.cap != cap:
            self.members[member] = MemberBlocks(cap)

    def leave(self, member: str) -> None:
        """``member``'s session ended: nothing of it is looked up again
        until it says anew what it holds."""
        self.members.pop(member, None)

    def update(self, member: str, add: Fingerprints, drop: Fingerprints) -> None:
        blocks = self.members.get(member)
        if blocks is None:
            return  # not joined (its session ended meanwhile)
        if len(drop):
            blocks.drop(drop)
        if len(add):
            blocks.add(add)

    def stale(self, member: str, fps: Sequence[int]) -> None:
        """``member`` was asked for blocks it was said to hold and does not
        hold ``fps``: they go, and are counted."""
        self.stale_blocks += len(fps)
        blocks = self.members.get(member)
        if blocks is not None:
            blocks.drop(np.asarray(fps, dtype=np.uint64))

    def holders(self, fp: int, among: Iterable[str] | None = None) -> list[str]:
        """The members (of ``among``, if given) said to hold ``fp``."""
        members = self.members
        names = members if among is None else among
        return [m for m in names if (b := members.get(m)) is not None and b.holds(fp)]

    def entries(self) -> int:
        return sum(len(b) for b in self.members.values())

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.members.values())


class OwnHoldings:
    """What this engine tells its subscribers it holds: the fingerprints of
    what its primary tier stored, at most its size (the oldest go, as the
    tier's own eviction would take them), and what is new since the last
    step's update."""

    def __init__(self, cap: int) -> None:
        self.blocks = MemberBlocks(max(1, min(cap, MAX_BLOCKS_PER_MEMBER)))
        self._pending: list[int] = []

    def stored(self, keys: Iterable[bytes]) -> None:
        self._pending.extend(fingerprint(k) for k in keys)

    def take(self) -> Fingerprints:
        """What is new since the last call (sent to every subscriber once
        per step), now part of the snapshot a new subscriber gets."""
        if not self._pending:
            return np.empty(0, np.uint64)
        new = np.asarray(self._pending, dtype=np.uint64)
        self._pending = []
        _, first = np.unique(new, return_index=True)
        new = new[np.sort(first)]
        new = new[~self.blocks._held(new)]
        self.blocks.add(new)
        return new

    def snapshot(self) -> Fingerprints:
        return self.blocks.held_in_order()
