"""NIXL data transport: moves KV blocks between peers, one-sided.

A READ from a peer on the same host that offers its region is a plain
copy instead (:mod:`p2p_kv.data.local`), with the same contract. Any
other READ lands in staging first (:mod:`p2p_kv.data.staged`): NIXL
cannot stop one it has posted.

This module is deliberately thin. The sans-IO session decides *what* to move
(which of our blocks go into which of the peer's slots, and when); this file
only turns that decision into NIXL transfers, posts them, and reports
completions and notifications back. It holds no protocol state.

UCX progresses only inside our calls (no progress thread, see
:mod:`p2p_kv.data.agent`): the initiator progresses it whenever it posts
or checks a transfer (``post_write``/``poll_completions``) and the receiver
whenever it drains notifications (``poll_notifs``). We leave ``UCX_TLS``
alone, so on one host UCX moves data with CMA (``process_vm_writev``) and
uses TCP on ``lo`` only for its own wire-up and notifications; that
measured best on one host. A CMA write is done inside the post call, so
``post_write`` returns only after the bytes have been copied.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from p2p_kv.data.agent import (
    DEFAULT_UCX_ERROR_HANDLING_MODE,
    Lists,
    new_notifs,
    open_agent,
)
from p2p_kv.data.local import LocalReads, plan_copy
from p2p_kv.data.plan import Indices, WritePlan, as_int_list, check_mapping, plan_write
from p2p_kv.data.regions import (
    Peer,
    Region,
    RegionInfo,
    RegionSpan,
    check_geometry,
    describe_region,
)
from p2p_kv.data.remote_agents import RemoteAgents
from p2p_kv.data.staged import DEFAULT_READ_STAGING_BYTES, Staging
from p2p_kv.data.transfer import (
    DEFAULT_DRAIN_TIMEOUT_S,
    Ledger,
    NixlTransfer,
    release_quietly,
)
from p2p_kv.ratelog import PeerLog

__all__ = ["NixlDataTransport"]

# Under vllm.p2p_kv: vLLM's logging setup shows it with the rest of the tier.
logger = logging.getLogger("vllm.p2p_kv.data")


class NixlDataTransport:
    """Registers one region once; WRITEs its blocks into peers' regions and
    READs peers' blocks into it.

    Not a thread: UCX progresses only inside our calls. The initiator learns
    of finished transfers from :meth:`poll_completions`; the receiver reads
    notifications with :meth:`poll_notifs` and must call it regularly (every
    engine step is plenty): with the default ``none`` error-handling mode
    WRITEs complete without the receiver, but only until about 255 of its
    notifications are unread; with ``peer`` every WRITE waits for it.
    Calls are serialised by an internal lock, so the owner may call from
    more than one thread (for example, post from a worker thread so the
    copy does not stall a scheduler step).

    Every transfer id returned by :meth:`post_write` or :meth:`post_read`
    is reported exactly once by :meth:`poll_completions`, whatever happens
    to it (success, NIXL error, :meth:`cancel`, :meth:`remove_peer`), so a
    caller that keys state by transfer id never leaks it. Only :meth:`close`
    drops pending reports.

    The owner calls :meth:`close`. A transport dropped without it is closed
    when it is freed (``__del__``), in the same order: its parts hold no
    reference back to it, so that happens as the last reference goes, and
    when the owner's own objects keep it in a reference cycle, the
    collector runs ``__del__`` before it clears anything in the cycle, so
    the agent, its handles and the memory it registered are all still
    there. Left to the collector's clearing instead, NIXL objects are freed
    in any order, and a NIXL agent is torn down at whatever moment a
    collection runs, on whichever thread triggers it (see
    ``tests/unit/test_transport_teardown.py``).
    """

    def __init__(
        self,
        region: Region,
        block_bytes: int,
        *,
        name: str | None = None,
        backends: Sequence[str] = ("UCX",),
        ucx_error_handling_mode: str = DEFAULT_UCX_ERROR_HANDLING_MODE,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        same_host: bool = True,
        read_staging_bytes: int = DEFAULT_READ_STAGING_BYTES,
    ) -> None:
        span = _checked(region, block_bytes, backends, read_staging_bytes)
        self._backends = tuple(backends)
        # Keep the region object alive as long as NIXL may touch its memory.
        self._region_obj: Region | None = region
        self._span = span
        self._block_bytes = block_bytes
        self._num_blocks = span.nbytes // block_bytes
        # The uuid suffix keeps names unique across restarts: a peer that
        # still holds our previous incarnation's metadata must not mistake
        # the new agent for it.
        self._name = f"{name or 'p2p_kv'}-{uuid.uuid4().hex}"
        self._lock = threading.RLock()
        #: agents whose data plane broke under their session (see
        #: take_faulted)
        self._faulted: set[str] = set()
        fault = self._faulted.add
        self._closed = False
        #: Lines a peer's input or behaviour causes: one per kind per
        #: interval, whoever sends them (held under ``_lock``).
        self._plog = PeerLog(logger=logger)
        self._ledger = Ledger(self._plog)
        self._drain_timeout_s = drain_timeout_s
        self._reg_descs: Any = None
        self._local = LocalReads(
            span, region, block_bytes, self._plog, enabled=same_host
        )
        #: READs done as same-host copies (the rest went through NIXL)
        self.local_reads = 0
        self._agent, xfer_dlist = open_agent(
            self._name, backends, ucx_error_handling_mode
        )
        self._lists = Lists(self._agent, xfer_dlist, block_bytes)
        try:
            self._reg_descs = self._agent.register_memory(
                [(span.addr, span.nbytes, span.device_id, "")], span.mem_kind
            )
            # Metadata must be taken after registration: it carries the keys
            # a peer needs to write into the region.
            self._metadata: bytes = bytes(self._agent.get_agent_metadata())
        except BaseException:
            self._agent = None
            raise
        # No more staging than the region: one peer's READs use half of it
        # at most, and an operator's ``read_staging_mib`` larger than the
        # KV cache (a typo, GiB for MiB) failed every staged READ at its
        # first allocation instead. Its parts call back into it weakly
        # (see the class docstring).
        self._staging = Staging(
            lists=self._lists,
            span=span,
            region=region,
            nbytes=min(read_staging_bytes, span.nbytes),
            plog=self._plog,
            fault=fault,
            prepare=_weakly(self._prepare),
        )
        self._peers = RemoteAgents(
            name=self._name,
            lists=self._lists,
            span=span,
            backends=self._backends,
            plog=self._plog,
            local=self._local,
            staging=self._staging,
            fence=_weakly(self._fence),
            fault=fault,
        )

    # -- introspection ----------------------------------------------------

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def local_region(self) -> RegionInfo:
        return RegionInfo(
            agent_name=self._name,
            agent_metadata=self._metadata,
            base_addr=self._span.addr,
            num_blocks=self._num_blocks,
            block_bytes=self._block_bytes,
            mem_kind=self._span.mem_kind,
            device_id=self._span.device_id,
            shm=self._local.shm,
            cuda_ipc=self._local.cuda_ipc,
        )

    @property
    def same_host_peers(self) -> int:
        """Peers whose region we mapped (their READs skip NIXL)."""
        with self._lock:
            return sum(p.mapping is not None for p in self._peers.known.values())

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers.known)

    def in_flight(self) -> int:
        """Transfers posted whose completion has not been returned yet."""
        with self._lock:
            return self._ledger.owed()

    def given_up(self, transfer_id: int) -> bool:
        """Whether a transfer still running was given up on (:meth:`cancel`):
        its report is owed, but nobody waits for it."""
        with self._lock:
            return self._ledger.given_up(transfer_id)

    def settling(self) -> bool:
        """READs given up on that UCX may still end (their staging, and a
        removed peer's agent, wait for it): :meth:`poll_completions` frees
        what ended, and must be called for them while nothing else is in
        flight. Not part of :meth:`in_flight`: they are no work of the
        engine's, which may sleep meanwhile."""
        with self._lock:
            return self._staging.settling()

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """Called from another thread when a staged READ's copy out of
        staging ends: the owner, waiting on its sockets, polls again then
        instead of at its next data tick."""
        self._staging.copy_threads.wake = wake

    def staging_blocks(self) -> tuple[int, int, int]:
        """Staging blocks: (all, free, held by READs given up on)."""
        with self._lock:
            return self._staging.blocks()

    # -- peers --------------------------------------------------------------

    def add_peer(self, info: RegionInfo, conn_inode: str | None = None) -> None:
        """Load a peer's NIXL metadata so we can write into its region.

        ``conn_inode``: the socket inode of our TCP connection to the peer
        (our outbound session). Only then may a same-host peer's region be
        opened for copies, once the pid it names proves to hold the far end.

        Idempotent per agent name: the same info again is a no-op (but for
        same-host copies, if now we have the connection). A different info
        under a known name is refused: the known one serves a live session,
        and only a peer passing off another's name would send it.

        Any ``info`` refused raises ValueError (a peer's input: its session
        ends, nothing else does), and leaves nothing of it loaded in NIXL.
        Its metadata is checked whole before NIXL reads it
        (:func:`~p2p_kv.data.regions.check_peer_metadata`).
        """
        check_geometry(info, self._name, self._block_bytes)
        with self._lock:
            self._check_open()
            self._peers.add(info, conn_inode)

    def prove_peer(self, agent_name: str, conn_inode: str) -> None:
        """Our connection to a known peer is now named (``conn_inode``):
        open its region for same-host copies if it offers one and the
        proof holds (once per peer)."""
        with self._lock:
            self._peers.prove(agent_name, conn_inode)

    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer; when this returns, no write of ours to it can land.

        In-flight transfers to the peer are drained (bounded wait) or
        cancelled, their handles released, and each is reported as failed
        unless it had already completed; then the peer's agent is
        invalidated, which also drops the UCX endpoints.

        Called by a consumer to drop a producer, it releases the producer's
        metadata and connection on our side. It cannot stop a *live*
        producer's one-sided writes into our memory (with CMA those need no
        cooperation from us); slots are safe to reuse once the producer is
        known dead or has acknowledged. A staged READ of ours still running
        is not stopped either: it keeps its staging, and the peer's agent
        stays loaded until UCX ends it (:mod:`p2p_kv.data.staged`).
        """
        with self._lock:
            if self._closed:
                return
            self._peers.remove(agent_name)

    def _fence(self, agent_name: str) -> None:
        """Give up the peer's transfers and wait for them (bounded)."""
        ledger = self._ledger
        ledger.give_up(ledger.of_peer(agent_name), True, self._drain_timeout_s)

    def _prepare(self, peer: Peer) -> tuple[Any, Any] | None:
        return self._peers.prepare(peer)

    # -- transfers ----------------------------------------------------------

    def post_write(
        self,
        agent_name: str,
        src_blocks: Indices,
        dst_blocks: Indices,
        notif: bytes = b"",
    ) -> int:
        """WRITE our ``src_blocks[i]`` into the peer's ``dst_blocks[i]``.

        Raises only for caller mistakes (unknown peer, bad index, wrong
        notification type), before any NIXL call. A failure inside NIXL is
        not raised: it becomes a ``(tid, False)`` completion, so the caller
        has one failure path (a dead peer shows up this way). ``notif`` is
        delivered to the peer's :meth:`poll_notifs` after the data has
        landed.

        Over CMA (one host, DRAM) UCX copies the bytes inside this call, so
        it returns after about ``bytes / (4-10 GB/s)``: 0.1 s for 512 MiB.
        Callers on a latency-critical thread should post from another one.
        """
        return self._post("WRITE", agent_name, src_blocks, dst_blocks, notif)

    def post_read(
        self, agent_name: str, remote_blocks: Indices, local_blocks: Indices
    ) -> int:
        """READ the peer's ``remote_blocks[i]`` into our ``local_blocks[i]``.

        The consumer's side of a one-sided load: the peer's process does
        nothing, so the load costs no producer step and no round trip.
        Same contract as :meth:`post_write` (caller mistakes raise before
        any NIXL call; everything else is one completion), and the same
        fence: once its completion is reported nothing more lands locally.
        """
        return self._post("READ", agent_name, local_blocks, remote_blocks, b"")

    def _post(
        self,
        op: str,
        agent_name: str,
        local_blocks: Indices,
        remote_blocks: Indices,
        notif: bytes,
    ) -> int:
        """Choose the path: a same-host copy, a staged READ, or NIXL in
        place (every WRITE, and READs when staging is turned off)."""
        if not isinstance(notif, bytes):
            raise TypeError("notif must be bytes")
        with self._lock:
            self._check_open()
            peer = self._peers.known.get(agent_name)
            if peer is None:
                raise KeyError(f"unknown peer {agent_name!r}: add_peer first")
            info = peer.info
            plan: WritePlan | None = None
            local: list[int] = []
            remote: list[int] = []
            mapping = peer.mapping if op == "READ" else None
            if mapping is not None:
                plan, mine = plan_copy(
                    mapping,
                    local_blocks,
                    remote_blocks,
                    self._num_blocks,
                    info.num_blocks,
                )
                if mine:
                    assert plan is not None
                    return self._copy(peer, plan)
            if op == "READ" and self._staging.nbytes and mapping is None:
                return self._post_staged(peer, local_blocks, remote_blocks)
            # Every index is checked (range, duplicates) before any NIXL
            # call; prepared lists need no coalescing plan (NIXL merges),
            # but a plan made already is not made twice.
            prepped = self._peers.prepare(peer) if plan is None else None
            if prepped is not None:
                local = as_int_list("src_blocks", local_blocks)
                remote = as_int_list("dst_blocks", remote_blocks)
                check_mapping(local, remote, self._num_blocks, info.num_blocks)
            elif plan is None:
                plan = plan_write(
                    local_blocks, remote_blocks, self._num_blocks, info.num_blocks
                )
            count = len(local_blocks)
            return self._post_nixl(op, peer, prepped, local, remote, plan, notif, count)

    def _post_nixl(
        self,
        op: str,
        peer: Peer,
        prepped: tuple[Any, Any] | None,
        local: list[int],
        remote: list[int],
        plan: WritePlan | None,
        notif: bytes,
        count: int,
    ) -> int:
        """A transfer in place of ``count`` blocks, by prepared lists
        (``local``/``remote``) or by the plan's coalesced runs."""
        tid = self._ledger.new_id()
        info, agent, span = peer.info, self._agent, self._span
        name = info.agent_name
        handle = None
        try:
            if prepped is not None:
                handle = agent.make_prepped_xfer(
                    op, prepped[0], local, prepped[1], remote, notif
                )
            else:
                assert plan is not None
                handle = self._lists.xfer(op, plan, span, info, notif)
            state = agent.transfer(handle)
        except Exception as exc:
            # A dead or removed peer lands here: an expected event, so
            # one line, with the traceback only at debug level.
            if self._plog.warning(
                "post", name, "%s of %d blocks failed to post: %s", op, count, exc
            ):
                logger.debug("post failure detail", exc_info=True)
            if handle is not None:
                # Maybe posted in part: NIXL cancels the descriptors it
                # posted when one fails, which does not stop them. A
                # WRITE is reported unstopped (its consumer may not
                # reuse the slots on our word), and the session ends.
                release_quietly(handle, name, self._plog)
                self._faulted.add(name)
                if op == "WRITE":
                    self._ledger.unstopped.add(tid)
            return self._ledger.report(tid, False)
        if state == "PROC":
            return self._ledger.track(tid, NixlTransfer(agent, handle), name)
        release_quietly(handle, name, self._plog)
        return self._ledger.report(tid, state == "DONE")

    def _post_staged(
        self, peer: Peer, local_blocks: Indices, remote_blocks: Indices
    ) -> int:
        """A READ through staging (:mod:`p2p_kv.data.staged`); same contract."""
        local = as_int_list("src_blocks", local_blocks)
        remote = as_int_list("dst_blocks", remote_blocks)
        check_mapping(local, remote, self._num_blocks, peer.info.num_blocks)
        tid = self._ledger.new_id()
        read = self._staging.read(peer, local, remote)
        if read is None:
            return self._ledger.report(tid, False)  # no staging: recompute
        name = peer.info.agent_name
        state = self._ledger.state(read, name)
        if state == "PROC":
            return self._ledger.track(tid, read, name)
        read.release()  # what a check that raised left running
        return self._ledger.report(tid, state == "DONE")

    def _copy(self, peer: Peer, plan: WritePlan) -> int:
        """A READ as a same-host copy; the same contract as a NIXL one."""
        tid = self._ledger.new_id()
        self.local_reads += 1
        name = peer.info.agent_name
        try:
            copy = self._local.copy(peer, plan)
        except Exception as exc:
            self._plog.warning("same_host_copy", name, "same-host copy failed: %s", exc)
            return self._ledger.report(tid, False)
        if copy is None:
            return self._ledger.report(tid, True)
        return self._ledger.track(tid, copy, name)

    def poll_completions(self) -> list[tuple[int, bool]]:
        """``(transfer id, ok)`` for every transfer that ended since last call.

        Costs one status check per in-flight transfer (each check also
        progresses UCX); finished handles are released here.
        """
        with self._lock:
            if self._closed:
                return []
            out = self._ledger.poll(self._drain_timeout_s)
            if self._staging.zombies:
                self._peers.settle(self._staging.settle())
            return out

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received, as ``(sender agent name, payload)``.

        Also the receiver's only source of UCX progress (there is no
        progress thread): notifications are read off the wire only here, and
        a sender's WRITEs stall once about 255 of them are unread (in
        ``peer`` error-handling mode, every WRITE waits for this call).
        """
        with self._lock:
            if self._closed:
                return []
            return new_notifs(self._agent, self._plog)

    def take_faulted(self) -> set[str]:
        """Agents whose data plane broke under their session (since the
        last call): a READ of theirs failed with the endpoint, or cannot be
        checked, or cancelled partly posted; or another peer's metadata
        took their name. The session must end: its READs would fail (or
        stall) for as long as it lived, and only a removed agent gives back
        the staging such READs hold. A new session loads the agent again."""
        if not self._faulted:
            return set()  # read without the lock: one added now is seen next call
        with self._lock:
            out = set(self._faulted)
            self._faulted.clear()
            return out

    def take_unstopped(self) -> set[int]:
        """Transfers reported failed (since the last call) that were still
        running when given up on. Releasing a NIXL handle does not stop its
        bytes: over TCP a WRITE to a peer that stalled lands once the peer
        progresses again (measured: all 64 blocks of a cancelled 4 MiB WRITE
        landed). A producer must not tell its consumer that such a WRITE
        is over; only the consumer dropping our agent fences it."""
        with self._lock:
            return self._ledger.take_unstopped()

    def cancel(self, *transfer_ids: int, wait: bool = False) -> None:
        """Give up on these transfers; no-op for one already finished.

        Each is still reported once by :meth:`poll_completions`: as ``ok``
        if it had in fact completed, as failed otherwise. A staged READ
        ends at once: it keeps its staging, not the caller's slots, until
        UCX ends it. Any other is reported when it ends, or failed and
        unstopped (:meth:`take_unstopped`) when the drain bound passes
        while it still runs; releasing it then does not stop it (over TCP
        it lands when a stalled peer resumes).

        The caller's thread does not wait for that unless ``wait`` (a
        fence before the caller reuses the slots at once): waiting, a WRITE
        to a stalled consumer, or an in-place READ from a stalled producer,
        would hold the engine's thread for the whole bound (1 s) whenever a
        request is aborted. Polling meanwhile keeps checking them, which also gives
        UCX the progress that lets most of them end.
        """
        with self._lock:
            running = self._ledger.running
            tids = [t for t in transfer_ids if t in running]
            self._ledger.give_up(tids, wait, self._drain_timeout_s)

    def close(self) -> None:
        """Release every handle, peer and registration; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._agent is None:
                return
            try:
                ledger = self._ledger
                ledger.give_up(list(ledger.running), True, self._drain_timeout_s)
                ledger.done.clear()
                self._staging.close_reads()
                self._peers.close()
                self._local.close()
                if self._reg_descs is not None:
                    try:
                        self._agent.deregister_memory(self._reg_descs)
                    except Exception:
                        logger.warning(
                            "deregistering NIXL memory failed", exc_info=True
                        )
                    self._reg_descs = None
                self._staging.close_memory()
            finally:
                self._agent = self._lists.agent = None
                self._region_obj = None

    def __del__(self) -> None:
        # Dropped without close(): released here, in close()'s order (see
        # the class docstring). Nothing may escape a finalizer; a transport
        # whose __init__ failed part way has nothing more to release.
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()

    def __enter__(self) -> NixlDataTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("NixlDataTransport is closed")


_T = TypeVar("_T")
_R = TypeVar("_R")


def _weakly(method: Callable[[_T], _R]) -> Callable[[_T], _R | None]:
    """A bound ``method`` called through a weak reference to its object
    (None once that is gone): a part of the transport that calls back into
    it must not keep it alive (see :class:`NixlDataTransport`)."""
    ref = weakref.WeakMethod(method)

    def call(arg: _T) -> _R | None:
        bound = ref()
        return None if bound is None else bound(arg)

    return call


def _checked(
    region: Region, block_bytes: int, backends: Sequence[str], staging_bytes: int
) -> RegionSpan:
    """The region's span, once the transport's arguments make sense."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    span = describe_region(region)
    if span.nbytes % block_bytes:
        raise ValueError(
            f"region of {span.nbytes} bytes is not a whole number of "
            f"{block_bytes}-byte blocks"
        )
    if not backends:
        raise ValueError("at least one NIXL backend is needed")
    if staging_bytes < 0:
        raise ValueError(f"read_staging_bytes is negative: {staging_bytes}")
    return span
