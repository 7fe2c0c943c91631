"""Finding a source for requests that name none, from the directory.

With the ``peers`` key set, every engine keeps a session with each member
it can reach and subscribes to what its primary tier holds
(:mod:`p2p_kv.node.directory`). A request whose ``kv_transfer_params`` name no
source is then looked up there, key by key as vLLM asks: a key is a hit
while at least one member holds every key asked so far (the longest
prefix one member holds), answered at once, from memory. At load time the
request takes the least loaded of those members as its source and asks it
for pins, as a ``remote_kv_source`` request would; if that member no longer
holds a block (a stale entry) or fails, the load moves to the next member
said to hold all of it, within the request's lookup deadline, and only
then recomputes.

:class:`Finder` holds the directory, what this engine tells its
subscribers, who subscribed, and per live request the members still
holding its prefix. It is sans-IO, like the manager that owns it: the
manager hands it what sessions heard and takes what to send.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from p2p_kv.node.directory import Directory, OwnHoldings, fingerprint, pack, unpack
from p2p_kv.node.indexes import residue_of
from p2p_kv.peer.records import LoadResult
from p2p_kv.protocol import MAX_FINGERPRINTS, Holdings

#: How often the members are checked for one without a session (each
#: member's reconnect backoff applies too).
MEMBER_CHECK_S = 1.0


@dataclass(slots=True, eq=False)
class Prefix:
    """What a request that names no source found so far: the members that
    hold every key asked (empty: none does, every later key misses) and
    those keys' fingerprints, in order."""

    holders: list[str]
    fps: list[int] = field(default_factory=list)
    #: a key missed: the prefix ends there (vLLM asks no further)
    ended: bool = False


class Finder:
    """The directory and the requests it answers. See the module docstring."""

    def __init__(self) -> None:
        self.directory = Directory()
        #: made at the first store, when the engine's size is known
        self.own: OwnHoldings | None = None
        #: inbound sessions that asked for our holdings
        self.subscribers: set[str] = set()
        #: requests that named no source, by id: what their lookups found
        self.prefixes: dict[str, Prefix] = {}
        #: members that turned out to be this engine (never dialled again)
        self.myself: set[str] = set()
        self._next_check = 0.0
        #: generations of found legs whose lookup was answered, and failed
        #: loads of found legs: taken at the next tick (the load starts, or
        #: moves to another holder)
        self.answered: set[int] = set()
        self.retry: list[LoadResult] = []
        #: loads that moved to another member
        self.failovers = 0

    # -- vLLM's lookups ------------------------------------------------------

    def lookup(self, req_id: str, key: bytes) -> bool:
        """Whether one member holds ``key`` and every key of the request
        asked before it (vLLM asks in prefix order and stops at a miss)."""
        fp = fingerprint(key)
        prefix = self.prefixes.get(req_id)
        if prefix is None:
            prefix = self.prefixes[req_id] = Prefix(self.directory.holders(fp))
            holders = prefix.holders
        elif fp in prefix.fps:
            return True  # asked again (a later step): still in the prefix
        elif prefix.ended:
            return False
        else:
            holders = self.directory.holders(fp, prefix.holders)
        if not holders:
            prefix.ended = True  # the holders of the keys before it stay
            return False
        prefix.holders = holders
        prefix.fps.append(fp)
        return True

    def choose(self, req_id: str, fps: Iterable[int], load: Mapping[str, int]) -> str:
        """The member to load ``fps`` of ``req_id`` from: of those said to
        hold all of them, the one with the fewest loads in flight (``load``);
        "" if none is left."""
        prefix = self.prefixes.get(req_id)
        if prefix is None:
            return ""
        wanted = list(fps)
        holders = [
            m
            for m in prefix.holders
            if all(self.directory.holders(fp, (m,)) for fp in wanted)
        ]
        prefix.holders = holders
        return min(holders, key=lambda m: load.get(m, 0), default="")

    def failed(self, req_id: str, member: str, stale: Iterable[int] = ()) -> None:
        """``member`` could not serve ``req_id``'s load: it drops out of the
        request's holders, and the blocks it no longer holds (``stale``)
        out of the directory."""
        stale = list(stale)
        if stale:
            self.directory.stale(member, stale)
        prefix = self.prefixes.get(req_id)
        if prefix is not None and member in prefix.holders:
            prefix.holders.remove(member)

    def forget(self, req_id: str) -> None:
        self.prefixes.pop(req_id, None)

    # -- what we hold, to our subscribers -------------------------------------

    def stored(self, keys: Iterable[bytes], num_blocks: int) -> None:
        """Our primary tier (``num_blocks`` large) stored ``keys``: vLLM
        cascades every new block of it to each secondary tier as a store
        job."""
        if self.own is None:
            self.own = OwnHoldings(num_blocks)
        self.own.stored(keys)

    def updates(self) -> list[Holdings]:
        """This step's news for every subscriber (empty if none)."""
        if self.own is None:
            return []
        new = self.own.take()
        return _messages(new) if self.subscribers else []

    def snapshot(self) -> list[Holdings]:
        """Everything we hold, for a new subscriber."""
        return [] if self.own is None else _messages(self.own.snapshot())

    # -- members -------------------------------------------------------------

    def member_check_due(self, now: float) -> bool:
        """Whether the members are due a check for one without a session
        (once per :data:`MEMBER_CHECK_S`: an idle engine's step costs its
        active work, not its fleet)."""
        if now < self._next_check:
            return False
        self._next_check = now + MEMBER_CHECK_S
        return True

    def to_dial(
        self, targets: Iterable[str], sessions: Mapping[str, object]
    ) -> Iterator[str]:
        """The members of ``targets`` without a session (never this engine)."""
        for member in targets:
            if member not in sessions and member not in self.myself:
                yield member

    def heard(self, member: str, add: bytes, drop: bytes) -> None:
        self.directory.update(member, unpack(add), unpack(drop))

    def left(self, peer: str) -> None:
        """``peer``'s session ended: as a member, nothing of it is looked up
        any more; as a subscriber, it hears nothing more."""
        self.directory.leave(peer)
        self.subscribers.discard(peer)

    def residue(self) -> dict[str, int]:
        """Per-request state only (members, holdings and subscribers are
        per-peer state at rest)."""
        return residue_of(self, at_rest=("subscribers", "myself"))


def _messages(fps: np.ndarray) -> list[Holdings]:
    return [
        Holdings(add=pack(fps[i : i + MAX_FINGERPRINTS].tolist()))
        for i in range(0, len(fps), MAX_FINGERPRINTS)
    ]
