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
from dataclasses import dataclass, field

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


@dataclass(slots=True, eq=False)
class MemberBlocks:
    """What one member said it holds: its fingerprints in arrival order and
    sorted, at most ``cap`` of them."""

    cap: int
    order: Fingerprints = field(default_factory=lambda: np.empty(0, np.uint64))
    ordered: Fingerprints = field(default_factory=lambda: np.empty(0, np.uint64))

    def __len__(self) -> int:
        return len(self.ordered)

    def holds(self, fp: int) -> bool:
        arr = self.ordered
        i = int(np.searchsorted(arr, np.uint64(fp)))
        return i < len(arr) and int(arr[i]) == fp

    def add(self, fps: Fingerprints) -> None:
        """Fingerprints the member stored; past ``cap`` its oldest go."""
        _, first = np.unique(fps, return_index=True)
        new = fps[np.sort(first)]  # once each, in the order they came
        new = new[~_contains(self.ordered, new)]
        if not len(new):
            return
        self.order = np.concatenate((self.order, new))
        up = np.sort(new)
        self.ordered = np.insert(self.ordered, np.searchsorted(self.ordered, up), up)
        excess = len(self.order) - self.cap
        if excess > 0:
            old, self.order = self.order[:excess], self.order[excess:]
            self.ordered = _without(self.ordered, old)

    def drop(self, fps: Fingerprints) -> None:
        """Fingerprints the member no longer holds (it said so, or its
        lookup missed them). The arrival order keeps them until they age
        out, or until they are most of it: only the sorted array answers
        lookups."""
        if len(fps):
            self.ordered = _without(self.ordered, fps)
        if len(self.order) > 2 * max(len(self.ordered), 1024):
            self.order = self.order[_contains(self.ordered, self.order)]

    @property
    def nbytes(self) -> int:
        return int(self.order.nbytes + self.ordered.nbytes)


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
        new = new[~_contains(self.blocks.ordered, new)]
        self.blocks.add(new)
        return new

    def snapshot(self) -> Fingerprints:
        order = self.blocks.order
        return order[_contains(self.blocks.ordered, order)]
