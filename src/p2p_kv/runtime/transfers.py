"""The data-plane side of the tier: whose NIXL agent serves each peer, and
which of our transfers are in flight.

Sessions name a transfer by :class:`~p2p_kv.peer.events.TransferRef`
(direction and their own id); the data plane names it by a handle of its
own. :class:`Transfers` is the one place that maps between the two, and the
one place that knows which agent a session's peer is, because a transfer is
posted to an agent and a closed session's agent decides how its transfers
are fenced. The runtime's pump hands it the events that concern the data
plane (``RegionKnown``, ``PostRead``, ``PostWrite``, ``Cancel``, a closed
session) and it
reports every end back to the manager; it reads no socket and owns no
thread, so it runs under the runtime's lock like the rest of the pump.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from p2p_kv.control.transport import ControlTransport
from p2p_kv.data import NixlDataTransport, RegionInfo
from p2p_kv.node.manager import LoadManager
from p2p_kv.peer import is_inbound
from p2p_kv.peer.events import Direction, TransferRef
from p2p_kv.ratelog import PeerLog


class Transfers:
    """Peers' data-plane agents and our transfers in flight, keyed by the
    data plane's transfer id. ``data`` and ``control`` are reassigned by
    the runtime when a caller swaps its transports (fault injectors wrap
    them before anything is posted)."""

    def __init__(
        self,
        manager: LoadManager,
        data: NixlDataTransport,
        control: ControlTransport,
        peer_log: PeerLog,
        clock: Callable[[], float],
    ) -> None:
        self.manager = manager
        self.data = data
        #: read for a connection's socket inode only (a same-host proof)
        self.control = control
        self._peer_log = peer_log
        self._clock = clock
        self._agents: dict[str, str] = {}  # session peer -> NIXL agent name
        #: outbound peers added before our connection's socket was known:
        #: their same-host offer is proved on their next frame
        self._unproven: set[str] = set()
        #: data-plane transfer id -> (peer, the session's name for it)
        self._xfers: dict[int, tuple[str, TransferRef]] = {}

    def __len__(self) -> int:
        """Posted reads and writes whose completion is not handled yet."""
        return len(self._xfers)

    def agent_of(self, peer: str) -> str | None:
        """The NIXL agent name of a session's peer, once its region is
        known."""
        return self._agents.get(peer)

    def awaited(self) -> bool:
        """A transfer in flight whose end someone waits for. Not one given
        up on (an aborted request's READ, a WRITE past its serve's
        deadline): it ends when UCX ends it or at its drain bound, and its
        result helps nobody sooner."""
        return any(not self.data.given_up(x) for x in self._xfers)

    def writes_awaited(self) -> bool:
        """A WRITE of ours in flight that a waiting peer's serve still
        counts on (its TransferDone leaves on the step that sees it end)."""
        return any(
            ref.direction is Direction.WRITE and not self.data.given_up(x)
            for x, (_, ref) in self._xfers.items()
        )

    # -- what the pump's events ask -------------------------------------------

    def post(
        self,
        peer: str,
        ref: TransferRef,
        src: list[int],
        dst: list[int],
        notif: bytes = b"",
    ) -> bool:
        """Hand one transfer ``src`` -> ``dst`` to the data plane: a read
        (their blocks into our slots) or a write (ours into theirs); True
        if it is in flight. A refusal ends it failed at once."""
        agent = self._agents.get(peer)
        read = ref.direction is Direction.READ
        kind = ref.direction.value
        try:
            if agent is None and not read and is_inbound(peer):
                raise ValueError(
                    "no WRITEs to a peer that dialled us without the shared "
                    "secret (its NIXL metadata is not loaded): set a secret on "
                    "both engines, or read_path: true on the consumer"
                )
            if agent is None:
                raise ValueError("peer has no data-plane agent")
            if read:
                xfer = self.data.post_read(agent, src, dst)
            else:
                xfer = self.data.post_write(agent, src, dst, notif)
        except Exception as exc:  # refused before any byte moved
            self._peer_log.warning(f"{kind}_refused", peer, "%s refused: %s", kind, exc)
            self._ended(peer, ref, False)
            return False
        self._xfers[xfer] = (peer, ref)
        return True

    def cancel(self, peer: str, ref: TransferRef) -> None:
        """Give up on one transfer of a session; its end still comes back
        through :meth:`take_completions`."""
        mine = (peer, ref)
        self.data.cancel(*(x for x, w in self._xfers.items() if w == mine))

    def take_completions(self) -> None:
        """Report every transfer the data plane has ended to the manager."""
        done = self.data.poll_completions()
        unstopped = self.data.take_unstopped()
        for xfer_id, ok in done:
            what = self._xfers.pop(xfer_id, None)
            if what is None:
                continue
            peer, ref = what
            if xfer_id in unstopped and ref.direction is Direction.WRITE:
                self.manager.on_write_unstoppable(peer, ref.ident)
            else:
                self._ended(peer, ref, ok)

    def _ended(self, peer: str, ref: TransferRef, ok: bool) -> None:
        now = self._clock()
        if ref.direction is Direction.READ:
            self.manager.on_read_done(peer, ref.ident, ok, now)
        else:
            self.manager.on_write_done(peer, ref.ident, ok, now)

    # -- peers' agents ----------------------------------------------------------

    def add_agent(self, peer: str, region: bytes) -> None:
        """Load a peer's data-plane region (:class:`RegionKnown`: its
        session is ready, and the node let it through). A bad region ends
        the session. Our outbound connection's same-host peer proves its
        pid holds the far end before we open its region; if our
        connection's socket is not known yet, it proves itself on its next
        frame (:meth:`prove_pending`)."""
        conn = self.control.connection_inode(peer)
        try:
            info = msgspec.msgpack.decode(region, type=RegionInfo)
            self.data.add_peer(info, conn_inode=conn)
        except (ValueError, msgspec.DecodeError) as exc:
            self._peer_log.warning(
                "bad_region", peer, "refused: bad data-plane region: %s", exc
            )
            self.manager.refuse_region(peer, str(exc))
            return
        self._agents[peer] = info.agent_name
        if conn is None and not is_inbound(peer):
            # Whatever it offers (a shared file, a CUDA IPC handle, or
            # nothing), the data plane decides once the proof can be made.
            self._unproven.add(peer)

    def prove_pending(self, peer: str) -> None:
        """Our connection's CONNECTED event came after the peer's region: a
        same-host peer proves itself once our socket is known."""
        if peer not in self._unproven:
            return
        conn = self.control.connection_inode(peer)
        if conn is not None:
            self._unproven.discard(peer)
            self.data.prove_peer(self._agents[peer], conn)

    def faulted_peers(self) -> list[str]:
        """Peers whose agent the data plane has found broken since the last
        call (a READ failed with or stranded on its endpoint, or its name
        was taken): their sessions must close."""
        return [
            peer
            for broken in self.data.take_faulted()
            for peer, agent in self._agents.items()
            if agent == broken
        ]

    def fence(self, closed: Iterable[str]) -> None:
        """Nothing of a closed session's lands after this: its transfers
        are cancelled and forgotten, and its peer's agent dropped, before
        the manager frees the session's slots.

        One give-up bound for all of them: fenced one session after
        another, each transfer stuck on a stalled peer waited out a bound
        of its own, so k such peers held the engine's thread k bounds (at
        shutdown, or a partition that drops several at once)."""
        closed = list(closed)
        going = set(closed)
        self.data.cancel(*[x for x, (p, _) in self._xfers.items() if p in going])
        for peer in closed:
            agent = self._agents.pop(peer, None)
            self._unproven.discard(peer)
            if agent is None:
                continue
            mine = [x for x, (p, _) in self._xfers.items() if p == peer]
            if agent in self._agents.values():
                # The same engine, other direction (its inbound and our
                # outbound session share one NIXL agent): end only this
                # session's transfers, waited for (the session's slots are
                # freed after this); the agent stays, so one still running
                # at the drain bound is not fenced (docs: Known limits).
                self.data.cancel(*mine, wait=True)
            else:
                self.data.remove_peer(agent)  # fences: nothing lands after
            for xfer_id in mine:
                del self._xfers[xfer_id]
