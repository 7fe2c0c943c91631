"""The NIXL agent: loading NIXL, its backends, and descriptor lists.

Everything NIXL-specific is imported lazily (:func:`load_nixl`), so the
rest of ``p2p_kv.data`` imports on machines without NIXL.

Three of NIXL's defaults are wrong for us (see ``shared/notes/nixl.md``),
and they are handled here so that a user never has to set an environment
variable:

* No progress thread. NIXL's Python wrapper starts UCX's progress thread
  with a zero poll delay, which spins a whole core even when idle (and cuts
  throughput 2-4x on a small machine). We run without it: the transport
  progresses UCX whenever it posts or checks a transfer and whenever it
  drains notifications. An idle transport costs no CPU at all.
* UCX error handling ``none`` instead of NIXL's ``peer``. Measured here on
  loopback (CMA data, TCP wire-up and notifications): with ``peer``, no
  WRITE completes at the initiator until the *receiver* next progresses UCX
  (a first transfer never completes if the receiver is not polling; later
  ones that carry a notification take as long as the receiver's poll
  interval: 5.6 ms for a 5 ms poll instead of 7-17 us), and a process that
  wrote to a peer that then died sometimes aborts at exit on a UCX
  assertion. With ``none`` a WRITE without a notification never needs the
  receiver, and once the receiver has polled at least once on a connection
  about 255 WRITEs with notifications complete before its unread
  notifications stall the next one; a dead peer is still reported (the post
  fails with ``NIXL_ERR_REMOTE_DISCONNECT``). ``none`` is also the only mode
  UCX accepts when ``UCX_TLS`` leaves only shared-memory transports
  (``sm,self``). ``peer`` stays available as an option.
* NIXL's Python logger prints INFO lines to *stdout*, which is where vLLM
  and our CLI print results. We raise it to WARNING unless the user asked
  for a level with ``NIXL_LOG_LEVEL``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from p2p_kv.data.plan import WritePlan
from p2p_kv.data.regions import RegionInfo, RegionSpan, build_descs
from p2p_kv.ratelog import PeerLog

__all__ = [
    "DEFAULT_UCX_ERROR_HANDLING_MODE",
    "Lists",
    "check_ucx_error_handling_mode",
    "disconnected",
    "load_nixl",
    "new_notifs",
    "open_agent",
    "ucx_tls_allows_peer_mode",
]

_UCX_ERROR_MODES: Final = ("none", "peer")
# "none": WRITEs complete without the receiver's help (see module docstring).
DEFAULT_UCX_ERROR_HANDLING_MODE: Final = "none"

# UCX transports that can carry active messages with peer-failure detection.
# When UCX_TLS names none of them, only "none" error handling can start.
_UCX_PEER_CAPABLE_TLS: Final = frozenset(
    {
        "all",
        "tcp",
        "ib",
        "rc",
        "rc_v",
        "rc_x",
        "rc_verbs",
        "rc_mlx5",
        "dc",
        "dc_x",
        "dc_mlx5",
        "ud",
        "ud_v",
        "ud_x",
        "ud_verbs",
        "ud_mlx5",
        "srd",
    }
)


def ucx_tls_allows_peer_mode(ucx_tls: str | None) -> bool:
    """Whether UCX can start a worker in ``peer`` mode under ``UCX_TLS``.

    ``peer`` mode needs an active-message transport with a peer-failure
    handler; shared-memory transports (``sm``, ``self``, ``cma``, ``posix``,
    ``sysv``) have none, so ``UCX_TLS=sm,self`` makes UCX refuse the worker
    with an error that names nothing we can act on.
    """
    if not ucx_tls:
        return True
    names = [t.strip().lower() for t in ucx_tls.split(",") if t.strip()]
    if not names or names[0].startswith("^"):
        # "^x,y" excludes transports from the default set, which keeps tcp.
        return True
    for name in names:
        base = name.split(":", 1)[0]
        if base in _UCX_PEER_CAPABLE_TLS or base.startswith(("rc", "dc", "ud")):
            return True
    return False


def check_ucx_error_handling_mode(mode: str, ucx_tls: str | None) -> str:
    """Validate a requested UCX error-handling mode before UCX sees it.

    Raises a ValueError that says why, instead of NIXL's bare
    ``NIXL_ERR_BACKEND``, when ``peer`` cannot start under ``UCX_TLS``.
    """
    if mode not in _UCX_ERROR_MODES:
        raise ValueError(
            f"ucx_error_handling_mode must be one of {_UCX_ERROR_MODES}, got {mode!r}"
        )
    if mode == "peer" and not ucx_tls_allows_peer_mode(ucx_tls):
        raise ValueError(
            f"UCX cannot use error-handling mode 'peer' with UCX_TLS={ucx_tls!r}: "
            "shared-memory transports have no peer-failure handler; use 'none'"
        )
    return mode


def disconnected(exc: BaseException) -> bool:
    """NIXL's "the peer's endpoint is gone" (``nixlRemoteDisconnectError``):
    the transfer is over, failed, not in an unknown state."""
    return type(exc).__name__ == "nixlRemoteDisconnectError"


def load_nixl() -> tuple[Any, Any, Any]:
    """Import NIXL on first use and quiet its stdout logger.

    Lazy so that the pure helpers import without NIXL. The logger level is
    lowered only when the user did not choose one with ``NIXL_LOG_LEVEL``.
    """
    from nixl._api import nixl_agent, nixl_agent_config
    from nixl._bindings import nixlXferDList

    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger = logging.getLogger("nixl")
        if nixl_logger.level < logging.WARNING:
            nixl_logger.setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config, nixlXferDList


def open_agent(
    name: str, backends: Sequence[str], ucx_error_handling_mode: str
) -> tuple[Any, Any]:
    """A NIXL agent named ``name`` running ``backends``, with no progress
    or listener thread, and the descriptor-list constructor: ``(agent,
    xfer_dlist)``. Raises ValueError for a mode UCX cannot start."""
    ucx_mode = check_ucx_error_handling_mode(
        ucx_error_handling_mode, os.environ.get("UCX_TLS")
    )
    nixl_agent, nixl_agent_config, xfer_dlist = load_nixl()
    config = nixl_agent_config(
        enable_prog_thread=False,
        enable_listen_thread=False,
        backends=[],
    )
    agent = nixl_agent(name, config)
    for backend in backends:
        params = {}
        if backend == "UCX":
            params["ucx_error_handling_mode"] = ucx_mode
        agent.create_backend(backend, params)
    return agent, xfer_dlist


class Lists:
    """Descriptor lists of blocks of ``block_bytes`` for one agent.

    Lists are built with the binding's constructor (``xfer_dlist``)
    directly: the wrapper's type sniffing (``get_xfer_descs``) costs about
    2 us per list, a quarter of a one-block WRITE.

    The one reference to the agent the transport's parts share: dropping
    it (``agent = None``, at close) lets the agent go, and with it UCX's
    endpoints, which is how a peer learns that we are gone."""

    def __init__(self, agent: Any, xfer_dlist: Any, block_bytes: int) -> None:
        self.agent = agent
        self._xfer_dlist = xfer_dlist
        self.block_bytes = block_bytes

    def runs(self, base: int, device: int, kind: str, starts: Any, counts: Any) -> Any:
        """Coalesced descriptors of runs of blocks of the region at ``base``."""
        descs = build_descs(base, self.block_bytes, device, starts, counts)
        return self._xfer_dlist(self.agent.nixl_mems[kind], descs)

    def blocks(
        self, owner: str, base: int, num_blocks: int, device: int, kind: str
    ) -> Any:
        """A prepared list of every block of ``owner``'s region at ``base``
        (``NIXL_INIT_AGENT``: ours): a transfer then names blocks by index."""
        starts = np.arange(num_blocks, dtype=np.int64)
        descs = build_descs(
            base, self.block_bytes, device, starts, np.ones_like(starts)
        )
        return self.agent.prep_xfer_dlist(owner, descs, kind)

    def xfer(
        self,
        op: str,
        plan: WritePlan,
        ours: RegionSpan,
        theirs: RegionInfo,
        notif: bytes,
    ) -> Any:
        """A NIXL request (not posted) of the plan's runs: ours from
        ``src_starts``, the peer's from ``dst_starts``."""
        return self.agent.initialize_xfer(
            op,
            self.runs(
                ours.addr, ours.device_id, ours.mem_kind, plan.src_starts, plan.counts
            ),
            self.runs(
                theirs.base_addr,
                theirs.device_id,
                theirs.mem_kind,
                plan.dst_starts,
                plan.counts,
            ),
            theirs.agent_name,
            notif,
        )


def new_notifs(agent: Any, plog: PeerLog) -> list[tuple[str, bytes]]:
    """Notifications the agent received, as ``(sender agent name,
    payload)``; reading them progresses UCX."""
    try:
        notifs: dict[Any, list[bytes]] = agent.get_new_notifs()
    except UnicodeDecodeError as exc:
        # A sender names itself, and anyone holding our metadata can send:
        # NIXL's binding fails the whole batch on a name that is not UTF-8
        # (the batch is gone by then). No agent of ours has such a name,
        # and our caller must not fail for it.
        plog.warning(
            "notif_name",
            repr(exc.object[:80]),
            "notifications from an agent whose name is not UTF-8 "
            "were dropped, with any that came with them",
        )
        return []
    out: list[tuple[str, bytes]] = []
    for sender, msgs in notifs.items():
        name = sender.decode() if isinstance(sender, bytes) else str(sender)
        out.extend((name, bytes(m)) for m in msgs)
    return out
