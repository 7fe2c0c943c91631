"""vLLM's tiering path below the scheduler, built as vLLM builds it, for
tests that drive p2p_kv with vLLM's own ``TieringOffloadingManager`` on
every supported vLLM (the ``vllm_compat`` tests).

An :class:`Engine` is an ``OffloadingConfig`` (vLLM's dataclass), our
``HostCopyTieringSpec`` (vLLM's ``TieringOffloadingSpec`` with a worker
that runs on the CPU) and ``spec.get_manager()``: the manager, its CPU
primary tier over a shared region and every ``secondary_tiers`` entry made
by ``SecondaryTierFactory`` from its ``type`` / ``module_path``. Tests call
the manager as vLLM's offloading scheduler does, under the manager's lock
where the version has one. ``core=True`` builds it inside an object named
like vLLM's engine core, with an input queue, and runs a loop that blocks
on that queue while the manager reports no pending work and steps
otherwise, as vLLM's engine-core process does: the tier's waker (vLLM 0.32,
or a tier not polled off-thread) wakes it through that queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from vllm.v1.kv_offload import config as vconfig
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

from p2p_kv.adapter.cpu_spec import HostCopyTieringSpec
from p2p_kv.adapter.tier import RELEASE, P2PKVTier

#: bytes of one offloaded block (one chunk: blocks_per_chunk 1)
BLOCK = 4096
CHUNKS = 16
END = ScheduleEndContext((), ())


def p2p_entry(**keys: Any) -> dict[str, Any]:
    """Our ``secondary_tiers`` entry, as a user writes it."""
    return {
        "type": "P2PKVTier",
        "module_path": "p2p_kv.adapter.tier",
        "host": "127.0.0.1",
        "port": 0,
        "idle_wait_ms": 5,
        **keys,
    }


class PolledTier(SecondaryTierManager):
    """A tier that holds nothing and asks vLLM's tier-poll thread for
    itself (the flag vLLM 0.33 and 0.34 read), as vLLM's in-tree ``p2p``
    tier does."""

    medium: ClassVar[Medium] = Medium.STORAGE
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **_: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self._done: list[JobResult] = []

    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        return LookupResult.MISS

    def submit_store(self, job_metadata: Any) -> None:
        self._done.append(JobResult(job_metadata.job_id, True))

    def submit_load(self, job_metadata: Any) -> None:
        self._done.append(JobResult(job_metadata.job_id, False))

    def get_finished_jobs(self) -> list[JobResult]:
        out, self._done = self._done, []
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        pass

    def drain_jobs(self) -> None:
        pass


POLLED_ENTRY = {"type": "PolledTier", "module_path": __name__}


def _config(engine_id: str, extra: dict[str, Any]) -> Any:
    """vLLM's OffloadingConfig (its fields differ a little by version:
    only those it has are given)."""

    def make(cls: Any, **kw: Any) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in kw.items() if k in names})

    return make(
        vconfig.OffloadingConfig,
        groups=(
            make(
                vconfig.OffloadingGroupConfig,
                tokens_per_block=16,
                layer_names=("l0", "l1"),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=BLOCK,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=engine_id,
        model=make(vconfig.OffloadingModelConfig, name="m", dtype="bfloat16"),
        cache=make(
            vconfig.OffloadingCacheConfig, tokens_per_hash=16, blocks_per_chunk=1
        ),
        parallel=make(
            vconfig.OffloadingParallelConfig,
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=0,
            is_parallelism_agnostic=False,
        ),
    )


class EngineCore:
    """Named as vLLM's engine core is: the tier looks for this name and an
    ``input_queue`` on the stack that builds it."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.manager = build()


class EngineCoreProc(EngineCore):
    pass


class Engine:
    """One engine's tiering manager, and its loop where it has one."""

    def __init__(
        self,
        name: str,
        tiers: list[dict[str, Any]],
        *,
        interval: float | None = None,
        core: bool = False,
    ) -> None:
        self.engine_id = f"p2pkv-t-{name}-{os.getpid()}-{time.monotonic_ns()}"
        extra: dict[str, Any] = {
            "cpu_bytes_to_use": CHUNKS * BLOCK,
            "secondary_tiers": [dict(t) for t in tiers],
        }
        if interval is not None:
            extra["tier_poll_interval_s"] = interval
        self.spec = HostCopyTieringSpec(_config(self.engine_id, extra))
        self.core: EngineCoreProc | None = None
        if core:
            self.core = EngineCoreProc(self.spec.get_manager)
            self.manager = self.core.manager
        else:
            self.manager = self.spec.get_manager()
        #: engine steps taken by the loop (``core``)
        self.steps = 0
        #: requests started and not finished: the engine steps while any is
        self.live: set[str] = set()
        #: inputs the tier put on the engine's queue (its waker's wake-ups)
        self.wakes = 0
        #: vLLM 0.32's manager has no lock: its engine thread alone calls
        #: it, which this lock stands in for between the loop and a test
        self._engine_lock = threading.RLock()
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None

    @property
    def ours(self) -> P2PKVTier:
        (tier,) = [t for t in self.manager.secondary_tiers if isinstance(t, P2PKVTier)]
        return tier

    @property
    def port(self) -> int:
        return int(self.ours.address.rsplit(":", 1)[1])

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """What vLLM's scheduler holds around every manager call (0.33 and
        later: the manager's lock; 0.32: its engine thread, played by a
        lock). vLLM runs a client's call on the engine's thread, as an
        input, which wakes an engine asleep at its step (p2p_kv's sleep
        while it holds a peer's pins, 0.32); a test's call from another
        thread pokes the engine until the loop lets go, and once after,
        so that it sees what the call changed (a new request)."""
        lock: Any = self.manager.lock if RELEASE.manager_lock else self._engine_lock
        loop = self._loop
        inputs = self.core.input_queue if self.core is not None else None
        if inputs is None or loop is None or threading.current_thread() is loop:
            inputs = None
            lock.acquire()
        else:
            while not lock.acquire(timeout=0.01):
                inputs.put_nowait(None)
        try:
            yield
        finally:
            lock.release()
            if inputs is not None:
                inputs.put_nowait(None)  # then the engine looks at its work

    def step(self) -> None:
        """The manager's part of one engine step, as its last call."""
        with self.locked():
            self.manager.on_schedule_end(END)

    def pending(self) -> bool:
        with self.locked():
            return bool(self.manager.has_pending_work())

    def has_work(self) -> bool:
        """What vLLM's engine core asks before it blocks for input: live
        requests, or the manager's pending work."""
        return bool(self.live) or self.pending()

    def start(self, ctx: ReqContext) -> None:
        with self.locked():
            self.live.add(ctx.req_id)
            self.manager.on_new_request(ctx)

    def finish(self, ctx: ReqContext) -> None:
        with self.locked():
            self.manager.on_request_finished(ctx)
            self.live.discard(ctx.req_id)

    def view(self) -> memoryview:
        return self.manager.primary_tier.get_kv_memoryview().cast("B")

    def start_loop(self) -> None:
        assert self.core is not None, "only an engine-core engine has a loop"
        self._loop = threading.Thread(target=self._run, daemon=True)
        self._loop.start()

    def _run(self) -> None:
        """vLLM's engine-core loop, as far as the manager sees it: while no
        request is live and nothing reports pending work, block on the
        input queue (no timeout: only an input wakes an idle engine) and
        take what comes, the waker's no-op among it; then step."""
        assert self.core is not None
        inputs = self.core.input_queue
        while not self._stop.is_set():
            while not self.has_work() and not self._stop.is_set():
                self._took(inputs.get())
            with contextlib.suppress(queue.Empty):
                while True:
                    self._took(inputs.get_nowait())
            if self._stop.is_set():
                return
            self.step()
            self.steps += 1

    def _took(self, item: Any) -> None:
        if item is not None:  # None: a test's call or poke, not the waker
            self.wakes += 1

    def poke(self) -> None:
        """An input that is no request (as a client's utility call): the
        idle engine wakes and asks again whether it has work."""
        assert self.core is not None
        self.core.input_queue.put_nowait(None)

    def close(self) -> None:
        self._stop.set()
        if self.core is not None:
            self.core.input_queue.put(None)
        if self._loop is not None:
            self._loop.join(timeout=10)
        self.manager.shutdown()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/vllm_offload_{self.engine_id}.mmap")


@contextlib.contextmanager
def engines() -> Iterator[Callable[..., Engine]]:
    """A factory of engines, every one closed at the end."""
    made: list[Engine] = []

    def make(*args: Any, **kwargs: Any) -> Engine:
        engine = Engine(*args, **kwargs)
        made.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in reversed(made):
            engine.close()
