"""The peers a transport knows: their NIXL agents, loaded and dropped.

A peer's region is checked whole before NIXL reads its metadata
(:func:`~p2p_kv.data.regions.check_peer_metadata`), since NIXL trusts what
it loads and cleans up after itself only in part; whatever is refused
leaves nothing loaded. A peer removed while a staged READ from it still
runs *retires*: its agent stays loaded until UCX ends that READ, since a
READ's state cannot be read once its agent is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

from p2p_kv.data.agent import Lists
from p2p_kv.data.local import LocalReads
from p2p_kv.data.regions import (
    Peer,
    RegionInfo,
    RegionSpan,
    check_peer_metadata,
    shown,
)
from p2p_kv.data.staged import Staging
from p2p_kv.data.transfer import release_quietly
from p2p_kv.ratelog import PeerLog

__all__ = ["PREP_MAX_BLOCKS", "RemoteAgents"]

logger = logging.getLogger("vllm.p2p_kv.data")

#: Regions of up to this many blocks (each side) get one prepared per-block
#: descriptor list, made once: a transfer then names blocks by index and
#: NIXL skips re-validating descriptors, which halves a one-block transfer's
#: cost (23 -> 11 us here). NIXL merges adjacent blocks itself. Larger
#: regions build coalesced descriptors per transfer instead.
PREP_MAX_BLOCKS: Final = 1 << 17


class RemoteAgents:
    """Known and retiring peers, by agent name.

    Not thread-safe: the transport's lock covers it. ``fence`` gives up a
    peer's transfers and waits for them (before it is removed); ``fault``
    is told of a peer whose session must end."""

    def __init__(
        self,
        *,
        name: str,
        lists: Lists,
        span: RegionSpan,
        backends: Sequence[str],
        plog: PeerLog,
        local: LocalReads,
        staging: Staging,
        fence: Callable[[str], None],
        fault: Callable[[str], None],
    ) -> None:
        self._name = name
        self._lists = lists
        self._span = span
        self._num_blocks = span.nbytes // lists.block_bytes
        self._backends = tuple(backends)
        self._plog = plog
        self._local = local
        self._staging = staging
        self._fence = fence
        self._fault = fault
        self.known: dict[str, Peer] = {}
        #: Peers removed while zombies of theirs run: their agent stays
        #: loaded (a zombie's state cannot be read once it is invalidated).
        self.retiring: dict[str, Peer] = {}
        self._local_prepped: Any = None

    def add(self, info: RegionInfo, conn_inode: str | None) -> None:
        """See ``NixlDataTransport.add_peer`` (``info``'s geometry checked)."""
        back = self.retiring.get(info.agent_name)
        if back is not None and back.info == info:
            # Removed while a READ of ours from it still ran (a stalled
            # peer that came back): its agent never left.
            del self.retiring[info.agent_name]
            self.known[info.agent_name] = back
            back.map_tried = False
        known = self.known.get(info.agent_name) or back
        if known is not None:
            if known.info == info:
                self._local.maybe_map(known, conn_inode)
                return
            raise ValueError(
                f"agent {shown(info.agent_name)} is known here with another "
                "region: refusing the second"
            )
        check_peer_metadata(info, self._backends)
        self._load(info)
        peer = self.known[info.agent_name] = Peer(info)
        try:
            self._local.maybe_map(peer, conn_inode)
        except BaseException:
            # Nothing of a peer we do not keep stays loaded.
            del self.known[info.agent_name]
            self._local.unmap(peer)
            self.invalidate(info.agent_name)
            raise
        if info.mem_kind != self._span.mem_kind and peer.mapping is None:
            self._plog.warning(
                "mixed_memory",
                info.agent_name,
                "holds %s and we hold %s: UCX moves host<->GPU data "
                "between processes through a slow software path",
                info.mem_kind,
                self._span.mem_kind,
            )

    def _load(self, info: RegionInfo) -> None:
        """Load a peer's checked metadata into NIXL; when it raises
        (ValueError), nothing of the metadata stays loaded."""
        name = info.agent_name
        try:
            loaded = self._lists.agent.add_remote_agent(info.agent_metadata)
        except Exception as exc:
            # NIXL keeps the connections it made before failing, under the
            # name in the metadata (checked to be ``name``, unknown here).
            self.invalidate(name)
            raise ValueError(
                f"NIXL refused the metadata of agent {shown(name)}: {exc}"
            ) from exc
        raw = loaded if isinstance(loaded, bytes) else str(loaded).encode()
        try:
            loaded_name = raw.decode()
        except UnicodeDecodeError:
            self.invalidate(raw)
            raise ValueError(
                f"NIXL loaded peer metadata as agent {shown(raw)}: not UTF-8"
            ) from None
        if loaded_name == name:
            return
        # NIXL read another name than check_peer_metadata did (a format it
        # does not know): whatever that name held here is the sender's now.
        gone = self.retiring.pop(loaded_name, None)
        if gone is not None:
            # Its zombies' states are unreadable from now on.
            self._staging.lose(loaded_name)
            self.drop(loaded_name, gone)
        elif loaded_name in self.known:
            # Its metadata may now be the sender's: fence the known peer's
            # transfers and drop it (its session's loads fail and
            # recompute) rather than trust it. Its session must end too: a
            # new one loads its agent again.
            self.remove(loaded_name)
            self._fault(loaded_name)
        elif loaded_name != self._name:
            self.invalidate(loaded_name)
        raise ValueError(
            f"peer metadata names agent {shown(loaded_name)}, "
            f"but RegionInfo says {shown(name)}"
        )

    def prove(self, agent_name: str, conn_inode: str) -> None:
        peer = self.known.get(agent_name)
        if peer is not None:
            self._local.maybe_map(peer, conn_inode)

    def remove(self, agent_name: str) -> None:
        """Fence the peer's transfers, then forget it (or retire it while
        zombies of its run)."""
        self._fence(agent_name)
        peer = self.known.pop(agent_name, None)
        if peer is not None:
            self._local.unmap(peer)
            if self._staging.busy(agent_name):
                self.retiring[agent_name] = peer  # until its zombies end
            else:
                self.drop(agent_name, peer)

    def settle(self, busy: set[str]) -> None:
        """Drop the agents of retiring peers no longer ``busy``."""
        for name in [n for n in self.retiring if n not in busy]:
            self.drop(name, self.retiring.pop(name))

    def drop(self, name: str, peer: Peer) -> None:
        if peer.prepped is not None:
            release_quietly(peer.prepped, name, self._plog)
            peer.prepped = None
        self.invalidate(name)
        self._staging.dropped(name)

    def invalidate(self, agent_name: str | bytes) -> None:
        """Drop whatever NIXL holds under ``agent_name`` (bytes: a name that
        is not UTF-8); nothing held is no error."""
        try:
            self._lists.agent.remove_remote_agent(agent_name)
        except Exception as exc:
            self._plog.warning(
                "invalidate", str(agent_name), "invalidating its agent failed: %s", exc
            )

    def prepare(self, peer: Peer) -> tuple[Any, Any] | None:
        """Both sides' prepared per-block lists, made once; None where the
        regions are too large or NIXL would not prepare them."""
        info = peer.info
        if peer.prep_failed or max(self._num_blocks, info.num_blocks) > PREP_MAX_BLOCKS:
            return None
        if peer.prepped is not None and self._local_prepped is not None:
            return self._local_prepped, peer.prepped
        span = self._span
        try:
            if self._local_prepped is None:
                self._local_prepped = self._lists.blocks(
                    "NIXL_INIT_AGENT",
                    span.addr,
                    self._num_blocks,
                    span.device_id,
                    span.mem_kind,
                )
            peer.prepped = self._lists.blocks(
                info.agent_name,
                info.base_addr,
                info.num_blocks,
                info.device_id,
                info.mem_kind,
            )
        except Exception as exc:
            if self._plog.warning(
                "prepare",
                info.agent_name,
                "preparing descriptors failed (%s); building them per transfer instead",
                exc,
            ):
                logger.debug("prepare failure detail", exc_info=True)
            peer.prep_failed = True
            return None
        return self._local_prepped, peer.prepped

    def close(self) -> None:
        """Unmap and drop every peer (their transfers released already)."""
        for name, peer in [*self.known.items(), *self.retiring.items()]:
            self._local.unmap(peer)
            self.drop(name, peer)
        self.known.clear()
        self.retiring.clear()
        if self._local_prepped is not None:
            release_quietly(self._local_prepped, None, self._plog)
            self._local_prepped = None
