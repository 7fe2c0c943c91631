"""Memory for benchmarks/gpu.py: regions of each kind (GPU, pinned host,
shared host file), filled and checked with one position-dependent byte
pattern, the CUDA calls around them, and torch's own copies of a fetch's
bytes (the physical limit every path is measured against).

Apart from gpu.py because its producer, its raw NIXL workers and its
consumer all use these, in three processes; torch is imported only when
one is called, so a process that never touches GPU memory never loads it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.harness import MIB, block_runs, scattered_mapping

_VERIFY_CHUNK = 32 * MIB


def torch_module() -> Any:
    import torch

    return torch


def pattern(start: int, nbytes: int, device: str) -> Any:
    """The bytes a region holds at ``[start, start + nbytes)``.

    A hash of each byte's global offset: a block that lands one slot off,
    or a byte range shifted inside a block, never matches by accident.
    """
    torch = torch_module()
    x = torch.arange(start, start + nbytes, dtype=torch.int64, device=device)
    x = x * 0x9E3779B1 + 0x7F4A7C15
    x = x ^ (x >> 13) ^ (x >> 29)
    return (x & 0xFF).to(torch.uint8)


def fill(region: Any, device: str) -> None:
    """Write the pattern over a whole region (tensor or numpy array)."""
    torch = torch_module()
    flat = torch.from_numpy(region) if isinstance(region, np.ndarray) else region
    for off in range(0, flat.numel(), _VERIFY_CHUNK):
        n = min(_VERIFY_CHUNK, flat.numel() - off)
        flat[off : off + n].copy_(pattern(off, n, device).to(flat.device))


def wrong_blocks(
    region: Any, block_bytes: int, src: Sequence[int], dst: Sequence[int]
) -> int:
    """How many destination slots do not hold their source block's bytes."""
    torch = torch_module()
    flat = torch.from_numpy(region) if isinstance(region, np.ndarray) else region
    rows = flat.view(-1, block_bytes)
    per = max(1, _VERIFY_CHUNK // block_bytes)
    bad = 0
    for i in range(0, len(src), per):
        s_chunk, d_chunk = src[i : i + per], dst[i : i + per]
        got = rows[torch.tensor(d_chunk, device=rows.device)]
        for j, s in enumerate(s_chunk):
            want = pattern(s * block_bytes, block_bytes, str(rows.device))
            if not torch.equal(got[j], want):
                bad += 1
    return bad


def clear(region: Any, block_bytes: int, dst: Sequence[int]) -> None:
    """Zero destination slots so a stale earlier write cannot pass a check."""
    torch = torch_module()
    flat = torch.from_numpy(region) if isinstance(region, np.ndarray) else region
    rows = flat.view(-1, block_bytes)
    rows[torch.tensor(list(dst), device=rows.device)] = 0


def make_region(kind: str, nbytes: int, device: str) -> Any:
    """``vram``: a tensor on ``device``; ``pinned``: pinned host tensor;
    ``dram``: host memory in a shared memfd, what StandalonePeer holds by
    default (and vLLM's primary tier is a shared file too)."""
    torch = torch_module()
    if kind == "vram":
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if kind == "pinned":
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device != "cpu")
    if kind == "dram":
        from p2p_kv.runtime.standalone import shared_region

        return shared_region(nbytes)
    raise ValueError(f"unknown region kind {kind!r}")


def set_device(device: str) -> None:
    """Make ``device`` current before NIXL sees its memory, as an engine's
    worker process has its own GPU current."""
    if device.startswith("cuda"):
        torch_module().cuda.set_device(device)


def sync() -> None:
    torch = torch_module()
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def empty_cache() -> None:
    torch = torch_module()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def summary_of(seconds: list[float], nbytes: int) -> dict[str, Any]:
    """:func:`benchmarks.harness.summary` with the number of samples."""
    return {**harness.summary(seconds, nbytes), "repeats": len(seconds)}


def contiguous_mapping(num_blocks: int) -> tuple[list[int], list[int]]:
    return list(range(num_blocks)), list(range(num_blocks))


def mapping(layout: str, num_blocks: int) -> tuple[list[int], list[int]]:
    if layout == "scattered":
        return scattered_mapping(num_blocks)
    return contiguous_mapping(num_blocks)


# ---------------------------------------------------------------------------
# Physical limits: torch copies in this process
# ---------------------------------------------------------------------------


def measure_limits(
    mode: str, src_dev: str, dst_dev: str, bs: int, n: int, layout: str, reps: int
) -> dict[str, Any]:
    """One copy of all the bytes, and one copy per run of the mapping."""
    torch = torch_module()
    src_blocks, dst_blocks = mapping(layout, n)
    if mode == "vram":
        src = torch.empty(n * bs, dtype=torch.uint8, device=src_dev)
    else:
        src = make_region("pinned", n * bs, dst_dev)
    dst = torch.empty((max(dst_blocks) + 1) * bs, dtype=torch.uint8, device=dst_dev)
    src.fill_(7)
    runs = block_runs(src_blocks, dst_blocks)
    pairs = [
        (dst[d * bs : (d + c) * bs], src[s * bs : (s + c) * bs]) for s, d, c in runs
    ]
    whole = dst[: n * bs]

    def one() -> None:
        whole.copy_(src, non_blocking=True)

    def per_run() -> None:
        for to, frm in pairs:
            to.copy_(frm, non_blocking=True)

    # Several copies per sample: a lone small copy would time the two
    # synchronisations, not the link.
    batch = max(1, (64 * MIB) // (n * bs))
    out: dict[str, Any] = {}
    for name, fn in (("limit", one), ("torch_runs", per_run)):
        seconds = []
        for i in range(reps + 3):
            sync()
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            sync()
            if i >= 3:
                seconds.append((time.perf_counter() - t0) / batch)
        out[name] = summary_of(seconds, n * bs)
    return out
