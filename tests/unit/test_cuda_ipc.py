"""Same-host READs into GPU memory, without a GPU: the CUDA runtime's
call typed per version, CUDA IPC offers proved and carried whole, batches
split over streams. The copies themselves run on the GPU machine
(``tests/integration/test_gpu_transfer.py``)."""

from __future__ import annotations

import itertools
import os

import pytest

from p2p_kv.data import cuda_ipc
from p2p_kv.data.cuda_ipc import BATCH_MIN_RUNS, BATCH_STREAMS, batch_slices
from p2p_kv.data.offer import CudaIpcRegion
from p2p_kv.data.procfs import boot_id


@pytest.mark.parametrize(
    ("version", "arity"),
    [(12040, 0), (12080, 9), (12090, 9), (13000, 8), (13010, 8)],
)
def test_batched_copies_are_typed_for_the_runtime_found(
    version: int, arity: int
) -> None:
    """cudaMemcpyBatchAsync gained ``failIdx`` in 12.8 and lost it in 13.0:
    a call typed for the wrong runtime would pass the stream as ``failIdx``."""
    import ctypes
    import types

    def get_version(out: object) -> int:
        out._obj.value = version  # type: ignore[attr-defined]
        return 0

    def batch() -> None:
        """Stands in for the C function: only its argtypes are set."""

    lib = types.SimpleNamespace(
        cudaRuntimeGetVersion=get_version, cudaMemcpyBatchAsync=batch
    )
    fn = cuda_ipc._memcpy_batch(lib)  # type: ignore[arg-type]
    if arity == 0:
        assert fn is None
    else:
        assert len(fn.argtypes) == arity
        assert fn.argtypes[3] is ctypes.c_size_t  # count
    assert cuda_ipc._memcpy_batch(None) is None
    assert cuda_ipc._memcpy_async(None) is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"boot_id": "another-boot"}, "another host"),
        ({"pid": 1}, "not the peer we talk to"),
        ({"length": 0}, "bad region span"),
        ({"handle": b"short"}, "64 bytes"),
    ],
)
def test_a_gpu_peers_ipc_offer_is_proved_like_a_shared_file(
    change: dict[str, object], why: str, conn: str
) -> None:
    """Refused before any CUDA call, saying why: the peer then stays on
    NIXL. With every check passed, a process without a CUDA runtime loaded
    still refuses, as an OSError."""
    fields: dict[str, object] = {
        "boot_id": boot_id(),
        "pid": os.getpid(),
        "handle": b"h" * 64,
        "offset": 0,
        "length": 4096,
    }
    with pytest.raises(ValueError, match=why):
        cuda_ipc.CudaIpcMapping(
            CudaIpcRegion(**{**fields, **change}),  # type: ignore[arg-type]
            conn,
        )
    offer = CudaIpcRegion(**fields)  # type: ignore[arg-type]
    if cuda_ipc._cudart() is None:
        with pytest.raises(OSError, match="no CUDA runtime"):
            cuda_ipc.CudaIpcMapping(offer, conn)
    else:  # proved; the handle is opened by the copier, on its device
        assert cuda_ipc.CudaIpcMapping(offer, conn).addr == 0


def test_an_ipc_handle_travels_whole_nuls_included() -> None:
    """A handle is opaque bytes: read as a C string it would stop at its
    first NUL (real handles have them), and the peer could not open it."""
    raw = bytes([0x10, 0x00, 0x7C, 0x2F]) + bytes(range(60))
    handle = cuda_ipc._IpcHandle.from_buffer_copy(raw)
    assert bytes(handle) == raw
    assert len(bytes(handle)) == 64


@pytest.mark.parametrize("runs", [1, 2, 31, 32, 63, 64, 65, 127, 128, 255, 256, 1000])
def test_batch_slices_cover_every_run_once(runs: int) -> None:
    """A large batch is split over streams; a run copied twice or not at
    all would be a wrong block, so the slices must tile the batch."""
    slices = batch_slices(runs, BATCH_STREAMS)
    assert slices[0][0] == 0 and slices[-1][1] == runs
    assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
    sizes = [hi - lo for lo, hi in slices]
    assert max(sizes) - min(sizes) <= 1
    assert len(slices) == max(1, min(BATCH_STREAMS, runs // BATCH_MIN_RUNS))
    assert len(slices) == 1 or min(sizes) >= BATCH_MIN_RUNS
