"""Pure parts of the NIXL data transport: no NIXL, no CUDA, no processes.

The address arithmetic tested here decides which bytes of which peer get
overwritten, so it is tested on its own, exhaustively where that is cheap.
"""

from __future__ import annotations

import mmap
import random
import sys
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from p2p_kv.data import (
    MEM_DRAM,
    MEM_VRAM,
    RegionInfo,
    RegionSpan,
    build_descs,
    check_ucx_error_handling_mode,
    describe_region,
    ucx_tls_allows_peer_mode,
)
from p2p_kv.data.plan import plan_write

# -- descriptors ------------------------------------------------------------------


def test_build_descs_from_lists() -> None:
    descs = build_descs(0x1000, 4096, 3, [0, 5], [2, 1])
    assert descs == [(0x1000, 8192, 3), (0x1000 + 5 * 4096, 4096, 3)]


def test_build_descs_from_arrays() -> None:
    starts = np.array([0, 5], dtype=np.int64)
    counts = np.array([2, 1], dtype=np.int64)
    descs = build_descs(0x1000, 4096, 3, starts, counts)
    assert isinstance(descs, np.ndarray) and descs.dtype == np.uint64
    assert descs.tolist() == [[0x1000, 8192, 3], [0x1000 + 5 * 4096, 4096, 3]]


def test_build_descs_large_addresses_do_not_overflow() -> None:
    base = 0x7F00_0000_0000
    cases: list[tuple[Any, Any]] = [([1000], [64]), (np.array([1000]), np.array([64]))]
    for starts, counts in cases:
        descs = build_descs(base, 2 << 20, 0, starts, counts)
        assert int(descs[0][0]) == base + 1000 * (2 << 20)
        assert int(descs[0][1]) == 64 * (2 << 20)


@pytest.mark.parametrize("n", [3, 300])
def test_plan_and_descs_cover_exactly_the_mapped_bytes(n: int) -> None:
    """Expanding descriptors byte range by byte range gives back the mapping."""
    rng = random.Random(n)
    src = rng.sample(range(2 * n), n)
    dst = rng.sample(range(3 * n), n)
    bb = 4096
    plan = plan_write(src, dst, 2 * n, 3 * n)
    local = build_descs(0x10000, bb, 0, plan.src_starts, plan.counts)
    remote = build_descs(0x90000000, bb, 0, plan.dst_starts, plan.counts)
    pairs = set()
    for (la, ln, _), (ra, rn, _) in zip(local, remote, strict=True):
        assert ln == rn and ln % bb == 0
        for k in range(int(ln) // bb):
            pairs.add(((int(la) - 0x10000) // bb + k, (int(ra) - 0x90000000) // bb + k))
    assert pairs == set(zip(src, dst, strict=True))


# -- region description ---------------------------------------------------------


def _addr_of(arr: np.ndarray[Any, Any]) -> int:
    return int(arr.ctypes.data)


def test_describe_memoryview() -> None:
    buf = bytearray(8192)
    span = describe_region(memoryview(buf))
    assert span == RegionSpan(_addr_of(np.frombuffer(buf, np.uint8)), 8192, MEM_DRAM, 0)


def test_describe_2d_memoryview_like_vllm_hands_a_tier() -> None:
    buf = bytearray(4 * 1024)
    view = memoryview(buf).cast("B", (4, 1024))
    span = describe_region(view)
    assert span.addr == _addr_of(np.frombuffer(buf, np.uint8))
    assert span.nbytes == 4096
    assert span.mem_kind == MEM_DRAM


def test_describe_readonly_buffer() -> None:
    data = bytes(100)
    span = describe_region(memoryview(data))
    assert span.nbytes == 100


def test_describe_numpy_any_dtype() -> None:
    arr = np.zeros((3, 5), dtype=np.float16)
    assert describe_region(arr) == RegionSpan(_addr_of(arr), 30, MEM_DRAM, 0)


def test_describe_mmap() -> None:
    m = mmap.mmap(-1, 4096)
    try:
        span = describe_region(m)
        assert span.nbytes == 4096 and span.addr > 0
    finally:
        m.close()


def test_describe_non_contiguous_rejected() -> None:
    arr = np.zeros((4, 4), dtype=np.uint8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        describe_region(arr)


def test_describe_empty_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        describe_region(bytearray())


def test_describe_unsupported_type() -> None:
    with pytest.raises(TypeError, match="cannot register"):
        describe_region(object())  # type: ignore[arg-type]


def test_describe_cpu_tensor() -> None:
    t = torch.zeros(16, 8, dtype=torch.bfloat16)
    assert describe_region(t) == RegionSpan(t.data_ptr(), 256, MEM_DRAM, 0)


def test_describe_non_contiguous_tensor_rejected() -> None:
    t = torch.zeros(8, 8).t()
    with pytest.raises(ValueError, match="contiguous"):
        describe_region(t)


@dataclass
class _FakeDevice:
    type: str
    index: int | None


class _FakeCudaTensor:
    """Just enough of torch.Tensor on cuda:N for registration logic."""

    def __init__(self, ptr: int, numel: int, elem: int, index: int | None) -> None:
        self._ptr = ptr
        self._numel = numel
        self._elem = elem
        self.device = _FakeDevice("cuda", index)

    def data_ptr(self) -> int:
        return self._ptr

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._elem


def test_describe_cuda_tensor_like_is_vram_on_its_device() -> None:
    fake = _FakeCudaTensor(0x7F00_DEAD_0000, 1 << 20, 2, index=1)
    assert describe_region(fake) == RegionSpan(0x7F00_DEAD_0000, 2 << 20, MEM_VRAM, 1)


def test_describe_cuda_tensor_without_index_rejected() -> None:
    with pytest.raises(ValueError, match="device index"):
        describe_region(_FakeCudaTensor(0x1000, 10, 4, index=None))


def test_describe_unknown_device_rejected() -> None:
    fake = _FakeCudaTensor(0x1000, 10, 4, index=0)
    fake.device = _FakeDevice("xpu", 0)
    with pytest.raises(ValueError, match="xpu"):
        describe_region(fake)


def test_vram_descs_carry_device_id() -> None:
    fake = _FakeCudaTensor(0x10_0000, 64 * 1024, 1, index=3)
    span = describe_region(fake)
    descs = build_descs(span.addr, 4096, span.device_id, [2], [3])
    assert descs == [(0x10_0000 + 2 * 4096, 3 * 4096, 3)]


# -- RegionInfo on the wire --------------------------------------------------------


def test_region_info_roundtrips_msgpack() -> None:
    info = RegionInfo(
        agent_name="a-1",
        agent_metadata=b"\x00\x01meta",
        base_addr=0x7F00_0000_1000,
        num_blocks=128,
        block_bytes=65536,
        mem_kind=MEM_VRAM,
        device_id=1,
    )
    wire = msgspec.msgpack.encode(info)
    assert msgspec.msgpack.decode(wire, type=RegionInfo) == info
    assert info.region_bytes == 128 * 65536


def test_region_info_rejects_wrong_types() -> None:
    wire = msgspec.msgpack.encode(
        {
            "agent_name": "a",
            "agent_metadata": b"",
            "base_addr": "not-an-int",
            "num_blocks": 1,
            "block_bytes": 1,
            "mem_kind": "DRAM",
            "device_id": 0,
        }
    )
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(wire, type=RegionInfo)


# -- UCX error-handling mode -------------------------------------------------------


@pytest.mark.parametrize(
    ("tls", "allowed"),
    [
        (None, True),
        ("", True),
        ("sm,self", False),
        ("self,cma,posix", False),
        ("shm,self", False),
        ("tcp,self", True),
        ("sm,tcp", True),
        ("rc_x,sm", True),
        ("all", True),
        ("^ib", True),
    ],
)
def test_peer_mode_needs_a_network_transport(tls: str | None, allowed: bool) -> None:
    assert ucx_tls_allows_peer_mode(tls) is allowed


def test_error_handling_mode_checks() -> None:
    assert check_ucx_error_handling_mode("none", "sm,self") == "none"
    assert check_ucx_error_handling_mode("peer", None) == "peer"
    with pytest.raises(ValueError, match="shared-memory"):
        check_ucx_error_handling_mode("peer", "sm,self")
    with pytest.raises(ValueError, match="must be one of"):
        check_ucx_error_handling_mode("thread", None)


def test_module_imports_without_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package and every module in it import without NIXL (it is
    imported lazily, by a transport)."""
    import importlib
    import pkgutil

    import p2p_kv
    import p2p_kv.data

    # The imports below rebind the package's attribute as well as the
    # module table's entries: later tests' `from p2p_kv import data` must
    # get back the modules everything else uses (they patched copies, once).
    monkeypatch.setattr(p2p_kv, "data", p2p_kv.data)
    for name in [m for m in sys.modules if m == "nixl" or m.startswith("nixl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nixl", None)  # makes `import nixl` fail
    ours = [
        m for m in sys.modules if m == "p2p_kv.data" or m.startswith("p2p_kv.data.")
    ]
    for name in ours:
        monkeypatch.delitem(sys.modules, name)
    fresh = importlib.import_module("p2p_kv.data")
    assert fresh.build_descs(0, 4096, 0, [1], [2]) == [(4096, 8192, 0)]
    names = [m.name for m in pkgutil.iter_modules(fresh.__path__)]
    assert {"nixl", "regions", "staged", "transfer"} <= set(names)
    for name in names:
        importlib.import_module(f"p2p_kv.data.{name}")


@pytest.mark.parametrize("as_array", [False, True])
def test_a_load_whose_ends_line_up_but_middle_does_not_is_copied(
    as_array: bool,
) -> None:
    """From another GPU, 64 runs and more are our copy, one run NIXL's:
    one run was judged by the first and last index alone, so 64 blocks
    with their middle swapped in pairs went to NIXL, into the slots."""
    from p2p_kv.data.cuda_ipc import CudaIpcMapping
    from p2p_kv.data.local import IPC_MIN_RUNS
    from p2p_kv.data.local import may_copy as _may_copy

    other_gpu = CudaIpcMapping.__new__(CudaIpcMapping)
    other_gpu.same_gpu = False
    n = IPC_MIN_RUNS
    local = list(range(n))
    swapped = [0] + [x for i in range(1, n - 1, 2) for x in (i + 1, i)] + [n - 1]
    assert len(plan_write(local, swapped, n, n).counts) >= IPC_MIN_RUNS
    wrap = np.asarray if as_array else list
    assert _may_copy(other_gpu, wrap(local), wrap(swapped))
    assert not _may_copy(other_gpu, wrap(local), wrap(local))  # one run: NIXL
