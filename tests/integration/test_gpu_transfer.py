"""GPU memory through the whole fetch path, between two processes.

A producer :class:`StandalonePeer` in a spawned process holds its blocks in a
CUDA tensor (GPU to GPU) or in host memory (host to GPU); a consumer
StandalonePeer here holds a CUDA tensor on the other GPU (the same GPU where
there is only one). Every fetch goes through lookup and pin, then one of the
load paths below, and afterwards the whole consumer region is compared byte
for byte with what each slot must hold, so a block that lands in the wrong
slot fails as surely as one that does not land.

These need CUDA and skip, saying so, where torch sees no GPU (CI). What can
be checked without a GPU (VRAM registration and descriptors) is in
``tests/unit/test_gpu_regions.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

KIB = 1024
BS = 64 * KIB
PRODUCER_BLOCKS = 32
CONSUMER_BLOCKS = 64


#: ``read``: the consumer READs the pinned blocks: from a host region on
#: this host as its own copies (DMA from the producer's shared file,
#: registered), from a GPU region through NIXL for loads of few runs (all of
#: these, unless it is on our own GPU: then as copies); ``read_ipc``: a GPU
#: region's loads of more than one run copied through CUDA IPC whatever
#: their size; ``nixl_read``: every READ through NIXL; ``write``:
#: the producer WRITEs after a Fetch; ``pd``: disaggregated prefill, the
#: producer's blocks parked as stores, offered to the consumer's Fetch and
#: READ as on ``read``. Copies are queued one batch a load,
#: and are also checked on their fallbacks: a runtime without batches
#: (``read_per_run``) and none to call at all, torch's copies
#: (``read_torch``).
PATHS = ("read", "nixl_read", "write", "pd")
COPY_MODES = {
    "read": "batch",
    "pd": "batch",
    "read_ipc": "batch",
    "read_per_run": "per_run",
    "read_torch": "torch",
}
CASES = [(kind, path) for kind in ("vram", "dram") for path in PATHS]
CASES += [("vram", "read_ipc"), ("dram", "read_per_run"), ("dram", "read_torch")]
#: ``nixl_read`` with 3 blocks of staging (GPU memory): loads in pieces.
CASES += [("vram", "nixl_read_pieces"), ("dram", "nixl_read_pieces")]
STAGING_BLOCKS = {"nixl_read_pieces": 3}
#: Both peers share a secret, as a fleet runs them: the write path needs
#: one (a producer loads no NIXL metadata from a peer that did not prove it).
SECRET = b"p2p_kv-gpu-test"
#: (producer blocks, consumer slots) of each fetch of the test
MAPPINGS = [
    ([0], [63]),  # one block, the region's last slot
    (list(range(1, 9)), list(range(10, 18))),  # contiguous: one descriptor
    (list(range(9, 17)), [20 + 2 * i for i in range(8)]),  # scattered
    (list(range(31, 16, -1)), list(range(40, 55))),  # reversed: a descriptor each
]


def _devices() -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        pytest.skip(
            "needs CUDA: torch.cuda.is_available() is False here; these tests "
            "move blocks into GPU memory (run them on the GPU machine)"
        )
    last = min(1, torch.cuda.device_count() - 1)
    return "cuda:0", f"cuda:{last}"


def _pattern(start: int, nbytes: int, device: str) -> Any:
    """Bytes that depend on their global offset: a block one slot off or a
    shifted range never matches by accident."""
    import torch

    x = torch.arange(start, start + nbytes, dtype=torch.int64, device=device)
    x = x * 0x9E3779B1 + 0x7F4A7C15
    return ((x ^ (x >> 13) ^ (x >> 29)) & 0xFF).to(torch.uint8)


def _key(i: int) -> bytes:
    from p2p_kv.runtime.standalone import make_key

    return make_key(i)


def _producer(kind: str, path: str, device: str, conn: Any, stop: Any) -> None:
    try:
        import torch

        from p2p_kv.runtime.standalone import StandalonePeer

        nbytes = PRODUCER_BLOCKS * BS
        region: Any
        if kind == "vram":
            torch.cuda.set_device(device)
            region = _pattern(0, nbytes, device)
        else:
            from p2p_kv.runtime.standalone import shared_region

            region = shared_region(nbytes)
            region[:] = _pattern(0, nbytes, "cpu").numpy()
        peer = StandalonePeer(
            PRODUCER_BLOCKS,
            BS,
            engine_id=f"gpu-test-{kind}",
            region=region,
            reads=path != "write",
            secret=SECRET,
        )
        for slot in range(PRODUCER_BLOCKS):
            peer.pinner.table[_key(slot)] = slot
        if path == "pd":
            from p2p_kv.node.roles import Roles

            rt = peer.runtime
            for n, (src, _) in enumerate(MAPPINGS):  # fetch n's blocks, parked
                rt.start_request(f"p-{n}", Roles(dest_kv_id=f"gpu-{n}"))
                keys = [_key(s) for s in src]
                rt.manager.submit_store(1000 + n, f"p-{n}", keys, src, rt.clock())
                rt.end_request(f"p-{n}")
        conn.send(("ready", peer.address, peer.runtime.data.local_region().mem_kind))
        peer.serve_until(stop, max_s=240)
        peer.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


@pytest.fixture(params=CASES, ids=lambda p: "-".join(p))
def pair(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, str, str, Any, str]]:
    """(consumer, producer address, producer memory kind, consumer region,
    path)."""
    src_dev, dst_dev = _devices()
    kind, path = request.param
    import torch

    from p2p_kv.data import cuda_ipc, local
    from p2p_kv.runtime.standalone import StandalonePeer

    if path == "read_ipc":
        monkeypatch.setattr(local, "IPC_MIN_RUNS", 1)
        # Split the batches over streams: 8 runs over 2, 15 over 4 (3+4+4+4).
        monkeypatch.setattr(cuda_ipc, "BATCH_MIN_RUNS", 3)
    elif path == "read_per_run":
        monkeypatch.setattr(cuda_ipc, "_memcpy_batch", lambda lib: None)
    elif path == "read_torch":
        monkeypatch.setattr(cuda_ipc, "_cudart", lambda: None)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    stop = ctx.Event()
    proc = ctx.Process(
        target=_producer, args=(kind, path, src_dev, child, stop), daemon=True
    )
    proc.start()
    try:
        assert parent.poll(120), "producer did not start"
        msg = parent.recv()
        assert msg[0] == "ready", msg[1]
        torch.cuda.set_device(dst_dev)
        region = torch.zeros(CONSUMER_BLOCKS * BS, dtype=torch.uint8, device=dst_dev)
        consumer = StandalonePeer(
            CONSUMER_BLOCKS,
            BS,
            engine_id="gpu-test-cons",
            region=region,
            reads=path != "write",
            same_host=not path.startswith("nixl_read"),
            read_staging_bytes=STAGING_BLOCKS.get(path, CONSUMER_BLOCKS) * BS,
            secret=SECRET,
        )
        try:
            yield consumer, msg[1], msg[2], region, path
        finally:
            consumer.close()
    finally:
        stop.set()
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def _check_region(region: Any, expect: dict[int, int]) -> None:
    """Every consumer slot holds its source block's bytes, or zeros."""
    import torch

    torch.cuda.synchronize(region.device)
    rows = region.view(CONSUMER_BLOCKS, BS)
    zeros = torch.zeros(BS, dtype=torch.uint8, device=region.device)
    for slot in range(CONSUMER_BLOCKS):
        src = expect.get(slot)
        want = zeros if src is None else _pattern(src * BS, BS, str(region.device))
        assert torch.equal(rows[slot], want), (
            f"consumer slot {slot} should hold "
            f"{'zeros' if src is None else f'producer block {src}'}"
        )


def test_fetch_into_gpu_memory(pair: tuple[Any, str, str, Any, str]) -> None:
    consumer, address, producer_mem, region, path = pair
    assert consumer.runtime.data.local_region().mem_kind == "VRAM"
    assert producer_mem in ("VRAM", "DRAM")
    expect: dict[int, int] = {}
    mappings = MAPPINGS
    for n, (src, dst) in enumerate(mappings):
        out = consumer.fetch(
            address,
            f"gpu-{n}",
            [_key(s) for s in src],
            dst,
            timeout_s=60,
            probe=path != "pd",
        )
        assert out.ok, out
        assert out.hits == len(src)
        expect.update(zip(dst, src, strict=True))
        _check_region(region, expect)
    report = consumer.manager.state_report()
    assert not any(report.values()), report
    # Every READ through NIXL went through staging, and left none taken;
    # a consumer that never READ through NIXL made none.
    size = (
        STAGING_BLOCKS.get(path, CONSUMER_BLOCKS) if path.startswith("nixl_read") else 0
    )
    assert consumer.runtime.data.staging_blocks() == (size, size, 0)
    # Only the read paths copy without NIXL: from a host region, or a GPU
    # region on our own GPU (one GPU here: NIXL's READs between two
    # processes on one GPU crawl), every load in every copy mode; from
    # another GPU only loads of many runs, here (``read_ipc``, any number of
    # runs) the scattered and reversed ones: the others are one run each,
    # which NIXL posts faster.
    one_gpu = len(set(_devices())) == 1
    copies = 0
    if path in COPY_MODES and (producer_mem == "DRAM" or one_gpu):
        copies = len(mappings)
    elif path == "read_ipc":
        copies = 2
    assert consumer.runtime.data.local_reads == copies
    if copies:
        assert consumer.runtime.data._local.copier.mode == COPY_MODES[path]
    # Only the write path lets the producer write into our slots.
    written = sum(s.link.counters.loads_written for s in consumer.manager.sessions())
    assert written == (len(mappings) if path == "write" else 0)


def test_pattern_detects_shifted_block() -> None:
    """The check above could not fail if neighbouring blocks looked alike."""
    a = _pattern(0, BS, "cpu")
    b = _pattern(BS, BS, "cpu")
    shifted = _pattern(1, BS, "cpu")
    assert not np.array_equal(a.numpy(), b.numpy())
    assert not np.array_equal(a.numpy(), shifted.numpy())


def _exporter(conn: Any, stop: Any) -> None:
    """A GPU peer: a 2 MiB tensor offered through CUDA IPC, and a listening
    socket whose accepted connection proves its pid."""
    import socket

    import torch

    from p2p_kv.data.cuda_ipc import export_cuda_region

    tensor = torch.full((2 * 1024 * KIB,), 0x11, dtype=torch.uint8, device="cuda")
    offer = export_cuda_region(tensor.data_ptr(), tensor.numel(), 0)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    conn.send((listener.getsockname()[1], offer.handle, offer.offset))
    far, _ = listener.accept()
    stop.wait(60)
    far.close()


def test_a_cuda_ipc_offer_past_its_allocation_is_refused() -> None:
    """A GPU peer's offer names its handle plus an offset and length; past
    the allocation the handle opens lies whatever the consumer allocated
    next, and copying from there put the consumer's own private memory
    into the KV cache it serves (shown on the H200 in review). The
    opened allocation's size bounds the offer now."""
    import socket

    import torch

    from p2p_kv.data import cuda_ipc
    from p2p_kv.data.cuda_ipc import CudaCopier, CudaIpcMapping
    from p2p_kv.data.offer import CudaIpcRegion
    from p2p_kv.data.procfs import boot_id, socket_inode

    _devices()  # skips, saying why, without CUDA
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    stop = ctx.Event()
    proc = ctx.Process(target=_exporter, args=(theirs, stop), daemon=True)
    proc.start()
    try:
        assert ours.poll(120), "the exporting peer did not start"
        port, handle, offset = ours.recv()
        sock = socket.create_connection(("127.0.0.1", port))
        inode = socket_inode(sock.fileno())
        assert inode is not None
        kv = torch.zeros((8 * 1024 * KIB,), dtype=torch.uint8, device="cuda")
        copier = CudaCopier(kv, 2 * 1024 * KIB)
        mib2 = 2 * 1024 * KIB

        def mapping(off: int, length: int) -> CudaIpcMapping:
            region = CudaIpcRegion(boot_id(), proc.pid or 0, handle, off, length)
            return CudaIpcMapping(region, inode)

        good = mapping(offset, mib2)
        copier.register(good)
        # The handle opens the peer's whole allocation (torch's caching
        # allocator hands out a segment larger than the tensor).
        _, size = cuda_ipc._address_range(good._base)
        copier.unregister(good)
        good.close()
        for off, length in ((size, mib2), (size - 4096, mib2)):  # past, over
            bad = mapping(off, length)
            with pytest.raises(ValueError, match="allocation its handle opens"):
                copier.register(bad)
            assert bad.addr == 0
        sock.close()
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("scattered", [False, True], ids=["one_run", "runs"])
def test_a_copy_into_gpu_slots_waits_for_work_queued_before_it(
    scattered: bool,
) -> None:
    """Work the caller queued on its stream before the load (a zeroing of
    the slots, a kernel still using them) ran after our copy, on its own
    side streams, and overwrote the loaded bytes: vLLM's own loads wait
    for the compute stream, ours did not."""
    import socket

    import torch

    from p2p_kv.data.cuda_ipc import CudaCopier
    from p2p_kv.data.plan import plan_write
    from p2p_kv.data.procfs import socket_inode
    from p2p_kv.data.shm_copy import PeerMapping, find_backing, shared_region

    _devices()  # skips, saying why, without CUDA
    bs, n = 64 * KIB, 64
    src = shared_region(n * bs)
    src[:] = np.repeat(np.arange(n, dtype=np.uint8) + 1, bs)
    info = find_backing(src.ctypes.data, src.size)
    assert info is not None
    server = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(server.getsockname())
    theirs, _ = server.accept()
    inode = socket_inode(theirs.fileno())
    assert inode is not None
    peer = PeerMapping(info, inode)
    dst = torch.zeros(n * bs, dtype=torch.uint8, device="cuda:0")
    copier = CudaCopier(dst, bs)
    copier.register(peer)
    try:
        local = list(range(n))
        remote = local[::-1] if scattered else local
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)  # the caller's stream busy a while
        dst.fill_(7)  # then it writes the slots
        copier.copy(peer, plan_write(local, remote, n, n))
        torch.cuda.synchronize()
        got = dst.view(n, bs)[:, 0].cpu().numpy()
        assert got.tolist() == [r + 1 for r in remote]
    finally:
        copier.unregister(peer)
        peer.close()
        for s in (ours, theirs, server):
            s.close()
