"""VRAM regions in the data transport, without CUDA and without NIXL.

A fake tensor-like object stands in for a CUDA tensor and a fake NIXL agent
records what the transport asks of NIXL, so CI checks the GPU path's
registration and descriptors: which memory type and device each side's
descriptors name and which addresses they cover, on both ways the
transport can describe a transfer (prepared per-block lists indexed by
block, or coalesced descriptors built per transfer). A wrong device id or
memory type here would make UCX read or write the wrong GPU's memory, or
refuse the transfer, only on a GPU machine. The transfers themselves run in
``tests/integration/test_gpu_transfer.py`` where CUDA exists.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest

from p2p_kv.data import MEM_DRAM, MEM_VRAM, NixlDataTransport, RegionInfo, local, staged
from p2p_kv.data import agent as agent_mod
from p2p_kv.data import staged as staged_mod
from p2p_kv.data.cuda_ipc import export_cuda_region
from p2p_kv.data.offer import CudaIpcRegion
from p2p_kv.data.plan import WritePlan
from p2p_kv.data.procfs import boot_id

BS = 4096


def nixl_metadata(name: str, mem: str, addr: int, nbytes: int, device: int) -> bytes:
    """Agent metadata in NIXL's format (``nixlSerDes``), as the transport
    checks it before loading: one UCX connection, one region, one key."""
    fields = [
        (b"Agent", name.encode()),
        (b"Conns", struct.pack("=Q", 1)),
        (b"t", b"UCX"),
        (b"c", b"worker-address"),
        (b"", b"MemSection"),
        (b"nixlSecElms", struct.pack("=Q", 1)),
        (b"bknd", b"UCX"),
        (b"nixlDList", b"nixlSDList"),
        (b"t", struct.pack("=i", {MEM_DRAM: 0, MEM_VRAM: 1}[mem])),
        (b"n", struct.pack("=Q", 1)),
        (b"", struct.pack("=QQQ", addr, nbytes, device) + b"rkey"),
    ]
    return b"nixlSerDes|" + b"".join(
        tag + struct.pack("=Q", len(value)) + value + b"|" for tag, value in fields
    )


@dataclass
class FakeDevice:
    type: str
    index: int | None


class FakeCudaTensor:
    """The part of a torch CUDA tensor that registration reads."""

    def __init__(self, ptr: int, nbytes: int, index: int) -> None:
        self._ptr = ptr
        self._nbytes = nbytes
        self.device = FakeDevice("cuda", index)

    def data_ptr(self) -> int:
        return self._ptr

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return self._nbytes // 2

    def element_size(self) -> int:
        return 2  # bf16: the byte count must not be taken from numel alone


@dataclass
class FakeDList:
    mem: str
    descs: list[tuple[int, int, int]]


@dataclass
class FakePrepped:
    agent: str
    mem: str
    descs: list[tuple[int, int, int]]

    def release(self) -> None:
        pass


@dataclass
class FakeAgent:
    """Records NIXL calls; every transfer completes at once. With
    ``can_prep`` False, preparing lists fails, as it would in a NIXL
    without them, and the transport falls back to coalesced descriptors."""

    name: str
    can_prep: bool = True
    prepped: list[FakePrepped] = field(default_factory=list)
    registered: list[tuple[list[tuple[int, int, int, str]], str]] = field(
        default_factory=list
    )
    deregistered: list[Any] = field(default_factory=list)
    xfers: list[tuple[str, FakeDList, FakeDList, str, bytes]] = field(
        default_factory=list
    )
    handles: list[object] = field(default_factory=list)
    #: transfers run until ``landed`` holds their handle
    hold: bool = False
    landed: list[object] = field(default_factory=list)
    failed: list[object] = field(default_factory=list)
    nixl_mems: dict[str, str] = field(
        default_factory=lambda: {MEM_DRAM: "mem:DRAM", MEM_VRAM: "mem:VRAM"}
    )

    def create_backend(self, name: str, params: dict[str, str]) -> None:
        assert name == "UCX"

    def register_memory(self, descs: list[Any], mem: str) -> object:
        self.registered.append((list(descs), mem))
        return ("reg", len(self.registered))

    def deregister_memory(self, reg: object) -> None:
        self.deregistered.append(reg)

    def get_agent_metadata(self) -> bytes:
        ((addr, nbytes, device, _),), mem = self.registered[0]
        return nixl_metadata(self.name, mem, addr, nbytes, device)

    def add_remote_agent(self, md: bytes) -> bytes:
        (size,) = struct.unpack_from("=Q", md, 16)  # after the intro and "Agent"
        return md[24 : 24 + size]

    def remove_remote_agent(self, name: str) -> None:
        pass

    def initialize_xfer(
        self, op: str, local: FakeDList, remote: FakeDList, peer: str, notif: bytes
    ) -> object:
        self.xfers.append((op, local, remote, peer, notif))
        self.handles.append(_Handle())
        return self.handles[-1]

    def prep_xfer_dlist(self, agent: str, descs: Any, mem: str) -> FakePrepped:
        if not self.can_prep:
            raise NotImplementedError("no prepared lists in this fake")
        self.prepped.append(FakePrepped(agent, mem, _dlist(mem, descs).descs))
        return self.prepped[-1]

    def make_prepped_xfer(
        self,
        op: str,
        local: FakePrepped,
        local_idx: list[int],
        remote: FakePrepped,
        remote_idx: list[int],
        notif: bytes,
    ) -> object:
        """Recorded as the per-block descriptors the indices select."""
        self.xfers.append(
            (
                op,
                FakeDList(f"mem:{local.mem}", [local.descs[i] for i in local_idx]),
                FakeDList(f"mem:{remote.mem}", [remote.descs[i] for i in remote_idx]),
                remote.agent,
                notif,
            )
        )
        self.handles.append(_Handle())
        return self.handles[-1]

    def transfer(self, handle: object) -> str:
        return self.check_xfer_state(handle)

    def check_xfer_state(self, handle: object) -> str:
        if handle in self.failed:
            return "ERR"
        return "PROC" if self.hold and handle not in self.landed else "DONE"

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}


class _Handle:
    def release(self) -> None:
        pass


STAGE_BASE = 0x7D00_0000_0000


class FakeStaging:
    """Read staging without CUDA: an address on the region's device, and
    the copies out of it that were asked for."""

    def __init__(
        self, num_blocks: int, block_bytes: int, *_region: int, cuda_region: Any = None
    ) -> None:
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.addr, self.nbytes = STAGE_BASE, num_blocks * block_bytes
        self.device_id = 0 if cuda_region is None else cuda_region.device.index
        self.copies: list[tuple[list[int], list[int]]] = []
        self.buffer = bytearray(self.nbytes)

    def copy_out(self, stage: Any, slots: Any, threads: Any = None) -> None:
        self.copies.append((stage.tolist(), slots.tolist()))


def _dlist(mem: str, descs: Any) -> FakeDList:
    rows = descs.tolist() if isinstance(descs, np.ndarray) else descs
    return FakeDList(mem, [tuple(int(v) for v in r) for r in rows])


def _blocks(dl: FakeDList) -> FakeDList:
    """Split coalesced descriptors into per-block ones, so both ways of
    describing a transfer compare alike."""
    return FakeDList(
        dl.mem,
        [(a + k * BS, BS, dev) for a, n, dev in dl.descs for k in range(n // BS)],
    )


def _sent(agent: FakeAgent) -> list[tuple[str, FakeDList, FakeDList, str, bytes]]:
    return [(op, _blocks(lo), _blocks(re), p, n) for op, lo, re, p, n in agent.xfers]


@pytest.fixture(params=[True, False], ids=["prepared", "coalesced"])
def agents(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> list[FakeAgent]:
    made: list[FakeAgent] = []

    def agent(name: str, config: object) -> FakeAgent:
        made.append(FakeAgent(name, can_prep=request.param))
        return made[-1]

    monkeypatch.setattr(
        agent_mod, "load_nixl", lambda: (agent, lambda **kw: kw, _dlist), raising=True
    )
    monkeypatch.setattr(staged, "StagingMemory", FakeStaging)
    return made


def _peer(
    mem: str, device: int, base: int, blocks: int, name: str = "peer-1"
) -> RegionInfo:
    return RegionInfo(
        agent_name=name,
        agent_metadata=nixl_metadata(name, mem, base, blocks * BS, device),
        base_addr=base,
        num_blocks=blocks,
        block_bytes=BS,
        mem_kind=mem,
        device_id=device,
    )


def test_cuda_tensor_registers_one_vram_span_on_its_device(
    agents: list[FakeAgent],
) -> None:
    region = FakeCudaTensor(0x7F00_0000_0000, 16 * BS, index=1)
    t = NixlDataTransport(region, BS, name="gpu", read_staging_bytes=4 * BS)
    (agent,) = agents
    assert agent.registered == [([(0x7F00_0000_0000, 16 * BS, 1, "")], MEM_VRAM)]
    # Read staging comes with the first READ through NIXL: GPU memory on
    # the region's GPU, registered as such.
    t.add_peer(_peer(MEM_VRAM, 0, 0x7E00_0000_0000, 32))
    tid = t.post_read("peer-1", [3], [4])
    assert t.poll_completions() == [(tid, True)]
    assert agent.registered[1:] == [([(STAGE_BASE, 4 * BS, 1, "")], MEM_VRAM)]
    info = t.local_region()
    assert (info.mem_kind, info.device_id, info.base_addr) == (
        MEM_VRAM,
        1,
        0x7F00_0000_0000,
    )
    assert (info.num_blocks, info.block_bytes) == (16, BS)
    # Metadata is taken after registration: it carries the region's keys.
    assert info.agent_metadata == nixl_metadata(
        t.agent_name, MEM_VRAM, 0x7F00_0000_0000, 16 * BS, 1
    )
    t.close()
    assert agent.deregistered == [("reg", 1), ("reg", 2)]


def test_vram_to_vram_descriptors_name_each_sides_gpu(
    agents: list[FakeAgent],
) -> None:
    local_base, remote_base = 0x7F00_0000_0000, 0x7E00_0000_0000
    t = NixlDataTransport(FakeCudaTensor(local_base, 16 * BS, index=1), BS)
    t.add_peer(_peer(MEM_VRAM, 0, remote_base, 32))
    tid = t.post_write("peer-1", [3, 4, 5, 9], [20, 21, 22, 2], notif=b"n")
    assert t.poll_completions() == [(tid, True)]
    ((op, local, remote, peer, notif),) = _sent(agents[0])
    assert (op, peer, notif) == ("WRITE", "peer-1", b"n")
    assert local == FakeDList(
        "mem:VRAM", [(local_base + s * BS, BS, 1) for s in (3, 4, 5, 9)]
    )
    assert remote == FakeDList(
        "mem:VRAM", [(remote_base + d * BS, BS, 0) for d in (20, 21, 22, 2)]
    )
    if agents[0].can_prep:  # the coalesced form: two runs, not four blocks
        return
    assert [d[1] for d in agents[0].xfers[0][1].descs] == [3 * BS, BS]


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in_place"])
def test_vram_read_names_each_sides_gpu(
    agents: list[FakeAgent], staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A READ describes our VRAM (its staging, or in place our slots) as the
    destination, the peer's as the source: the device ids must not swap
    with the direction. Staged, the landed blocks are copied to the slots."""
    local_base, remote_base = 0x7F00_0000_0000, 0x7E00_0000_0000
    monkeypatch.setattr(staged_mod, "PIECES_IN_FLIGHT", 2)
    t = NixlDataTransport(
        FakeCudaTensor(local_base, 16 * BS, index=1),
        BS,
        # 16 staging blocks, two pieces in flight: the 3 go as one piece
        # (at most half of the peer's share of 8)
        read_staging_bytes=16 * BS if staged else 0,
    )
    t.add_peer(_peer(MEM_VRAM, 0, remote_base, 32))
    tid = t.post_read("peer-1", [30, 31, 5], [7, 8, 9])  # remote blocks, then ours
    assert t.poll_completions() == [(tid, True)]
    ((op, local, remote, _, _),) = _sent(agents[0])
    assert op == "READ"
    base, rows = (STAGE_BASE, (0, 1, 2)) if staged else (local_base, (7, 8, 9))
    assert local == FakeDList("mem:VRAM", [(base + r * BS, BS, 1) for r in rows])
    assert remote == FakeDList(
        "mem:VRAM", [(remote_base + r * BS, BS, 0) for r in (30, 31, 5)]
    )
    if staged:
        assert t._staging.mem.copies == [([0, 1, 2], [7, 8, 9])]
        assert t.staging_blocks() == (16, 16, 0)


PIECES_SLOTS = [1, 3, 5, 7, 9, 11]


def _six_block_staged_read(
    agents: list[FakeAgent],
) -> tuple[NixlDataTransport, FakeAgent, int]:
    """A READ of 6 blocks into 8 of staging (the peer's share: 4), its
    transfers held running."""
    t = NixlDataTransport(
        FakeCudaTensor(0x7F00_0000_0000, 16 * BS, index=1),
        BS,
        read_staging_bytes=8 * BS,
    )
    t.add_peer(_peer(MEM_VRAM, 0, 0x7E00_0000_0000, 32))
    agent = agents[0]
    agent.hold = True
    return t, agent, t.post_read("peer-1", [20, 21, 22, 23, 24, 25], PIECES_SLOTS)


def test_a_staged_read_keeps_its_pieces_in_flight(agents: list[FakeAgent]) -> None:
    """A load larger than a piece moves in pieces, up to
    ``staged.PIECES_IN_FLIGHT`` at once (here each a quarter of the peer's
    share of 4: one block): one lands and is copied out while the next run,
    and its staging goes to the next piece at once, whatever the order they
    land in."""
    assert staged_mod.PIECES_IN_FLIGHT == 4
    t, agent, tid = _six_block_staged_read(agents)
    assert len(agent.handles) == 4  # four pieces of a block, all running
    assert t.poll_completions() == []
    assert t.staging_blocks() == (8, 4, 0)
    agent.landed.append(agent.handles[1])  # the second piece lands first
    assert t.poll_completions() == []
    assert len(agent.handles) == 5  # its staging went to the fifth piece
    done: list[tuple[int, bool]] = []
    for _ in range(3):
        agent.landed[:] = agent.handles
        done += t.poll_completions()
    assert done == [(tid, True)]
    copies = t._staging.mem.copies
    assert [out for _, out in copies] == [[3], [1], [5], [7], [9], [11]]
    assert t.staging_blocks() == (8, 8, 0)


class SlowCopyStaging(FakeStaging):
    """Staging whose copies out run on the copy threads and take a while:
    a piece can be caught mid-copy."""

    copied: ClassVar[list[list[int]]] = []

    def copy_out(self, stage: Any, slots: Any, threads: Any = None) -> Any:
        out = slots.tolist()

        def slow() -> None:
            time.sleep(0.2)
            self.copied.append(out)

        return threads.run([slow])


def test_a_read_given_up_on_mid_copy_waits_for_the_copy_before_its_slots_go(
    agents: list[FakeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece being copied out writes the caller's slots: a READ given up
    on then (its peer lost) is reported failed only once that copy has
    ended, or the copy would land in slots handed to another request. The
    pieces still running keep their staging, as ever."""
    monkeypatch.setattr(staged_mod, "StagingMemory", SlowCopyStaging)
    SlowCopyStaging.copied.clear()
    t, agent, tid = _six_block_staged_read(agents)
    agent.landed.append(agent.handles[0])
    assert t.poll_completions() == []  # its copy runs on a thread
    assert SlowCopyStaging.copied == []
    t.remove_peer("peer-1")
    assert SlowCopyStaging.copied == [[1]]  # ended before the give-up did
    assert t.poll_completions() == [(tid, False)]
    assert t.staging_blocks() == (8, 5, 3)
    t.close()


def test_a_copy_out_that_fails_fails_the_read_and_gives_its_staging_back(
    agents: list[FakeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    class FailingCopy(FakeStaging):
        def copy_out(self, stage: Any, slots: Any, threads: Any = None) -> Any:
            def boom() -> None:
                raise OSError("bad address")

            return threads.run([boom])

    monkeypatch.setattr(staged_mod, "StagingMemory", FailingCopy)
    t, agent, tid = _six_block_staged_read(agents)
    agent.landed.extend(agent.handles)
    done: list[tuple[int, bool]] = []
    for _ in range(20):
        done += t.poll_completions()
        if done:
            break
        time.sleep(0.01)
    assert done == [(tid, False)]
    agent.landed[:] = agent.handles
    t.poll_completions()
    assert t.staging_blocks() == (8, 8, 0)
    t.close()


def test_a_failed_piece_buries_the_pieces_still_running(
    agents: list[FakeAgent],
) -> None:
    """The READ fails at once; the other pieces' staging stays held until
    UCX ends them, and nothing of them is copied into the slots."""
    t, agent, tid = _six_block_staged_read(agents)
    agent.failed.append(agent.handles[0])
    assert t.poll_completions() == [(tid, False)]
    assert t.staging_blocks() == (8, 5, 3)
    agent.landed.extend(agent.handles[1:])
    assert t.poll_completions() == []
    assert t.staging_blocks() == (8, 8, 0)
    assert t._staging.mem.copies == []


def test_a_peer_that_stalls_mid_read_leaves_the_others_their_staging(
    agents: list[FakeAgent],
) -> None:
    """A peer alive and connected but stalled keeps its READs' staging
    (UCX does not end them) until it resumes or dies. One such READ took
    the whole staging, and every other peer's READs waited out their
    deadlines for as long as the stall lasted: a peer's READs now hold at
    most its share (``staged.PEER_STAGING_SHARE``) of what the others leave."""
    t = NixlDataTransport(
        FakeCudaTensor(0x7F00_0000_0000, 32 * BS, index=1),
        BS,
        read_staging_bytes=8 * BS,
    )
    t.add_peer(_peer(MEM_VRAM, 0, 0x7E00_0000_0000, 32))
    t.add_peer(_peer(MEM_VRAM, 0, 0x7C00_0000_0000, 32, name="peer-2"))
    agent = agents[0]
    agent.hold = True
    t.post_read("peer-1", list(range(8)), list(range(0, 16, 2)))
    t.remove_peer("peer-1")  # its session was lost: the READ is given up on
    assert [ok for _, ok in t.poll_completions()] == [False]
    assert t.staging_blocks() == (8, 4, 4)  # its share, held for the stall
    before = len(agent.handles)
    tid = t.post_read("peer-2", [3, 4], [20, 22])
    # Half of the 4 blocks left: pieces of one block, two in flight.
    assert len(agent.handles) - before == 2
    agent.landed.extend(agent.handles[before:])
    assert t.poll_completions() == [(tid, True)]
    assert sorted(s for _, out in t._staging.mem.copies[-2:] for s in out) == [20, 22]


def test_two_staged_reads_from_one_peer_share_its_staging(
    agents: list[FakeAgent],
) -> None:
    """A peer's second READ while its first runs counts the first's pieces
    against the peer's share, and both land. (The count compared READs by
    value, their numpy block arrays with them, and failed the second.)"""
    t = NixlDataTransport(
        FakeCudaTensor(0x7F00_0000_0000, 32 * BS, index=1),
        BS,
        read_staging_bytes=16 * BS,  # the peer's share: 8, pieces of 4
    )
    t.add_peer(_peer(MEM_VRAM, 0, 0x7E00_0000_0000, 32))
    agent = agents[0]
    agent.hold = True
    first = t.post_read("peer-1", list(range(6)), list(range(0, 12, 2)))
    second = t.post_read("peer-1", [10, 11, 12, 13], [20, 22, 24, 26])
    assert t.staging_blocks() == (16, 8, 0)  # 4 + 2, then 2 of the second's
    done: list[tuple[int, bool]] = []
    for _ in range(4):  # every piece posted so far lands
        agent.landed[:] = agent.handles
        done += t.poll_completions()
    assert sorted(done) == [(first, True), (second, True)]
    landed = sorted(s for _, out in t._staging.mem.copies for s in out)
    assert landed == sorted([*range(0, 12, 2), 20, 22, 24, 26])
    assert t.staging_blocks() == (16, 16, 0)


def test_an_idle_runtime_frees_the_staging_of_a_read_given_up_on(
    agents: list[FakeAgent],
) -> None:
    """A READ whose peer was removed keeps its staging (and the peer's
    agent) until UCX ends it. Only ``poll_completions`` frees them, and the
    runtime called it only while transfers were in flight: once the failed
    READ was reported, an idle engine held both until some other transfer
    came. Its polls (the waker's passes) must free them."""
    from p2p_kv.control.transport import ControlTransport
    from p2p_kv.node.manager import LoadManager
    from p2p_kv.runtime.tier_runtime import TierRuntime, fresh_nonce

    from .memnet import identity

    t, agent, _ = _six_block_staged_read(agents)
    rt = TierRuntime(
        LoadManager(identity("a"), nonces=fresh_nonce),
        ControlTransport("127.0.0.1", 0),
        t,
    )
    try:
        t.remove_peer("peer-1")  # its session closed: the READ is given up on
        rt.poll(wait=False)  # the failed completion is taken
        assert t.in_flight() == 0
        assert t.staging_blocks() == (8, 4, 4)
        assert t.settling()
        agent.landed.extend(agent.handles)  # UCX ends both pieces
        rt.poll(wait=False)
        assert t.staging_blocks() == (8, 8, 0)
        assert not t.settling()
        assert t._peers.retiring == {}  # and the removed peer's agent is dropped
        assert t._staging.mem.copies == []  # nothing of it reached the slots
    finally:
        rt.close()


def test_a_transport_closed_under_a_read_given_up_on_keeps_only_its_staging(
    agents: list[FakeAgent],
) -> None:
    """UCX may still write a cancelled READ's staging after close, so the
    staging outlives the transport; the object that owns it also views the
    engine's region, and kept whole it kept the engine's KV cache (GPU
    memory) alive for the life of the process."""
    t, _, _ = _six_block_staged_read(agents)
    t.remove_peer("peer-1")  # the READ is given up on while it runs
    assert t.settling()
    stage = t._staging.mem
    kept = len(staged._KEPT_STAGING)
    t.close()
    try:
        assert staged._KEPT_STAGING[kept:] == [stage.buffer]
    finally:
        del staged._KEPT_STAGING[kept:]


def test_host_to_gpu_descriptors_mix_memory_types(
    agents: list[FakeAgent], caplog: pytest.LogCaptureFixture
) -> None:
    host = np.zeros(8 * BS, dtype=np.uint8)
    t = NixlDataTransport(host, BS)
    remote_base = 0x7E00_0000_0000
    with caplog.at_level(logging.WARNING, logger="vllm.p2p_kv.data"):
        t.add_peer(_peer(MEM_VRAM, 3, remote_base, 8))
    assert "slow software path" in caplog.text
    t.post_write("peer-1", [0, 1], [6, 7])
    ((_, local, remote, _, _),) = _sent(agents[0])
    base = int(host.ctypes.data)
    assert local == FakeDList("mem:DRAM", [(base, BS, 0), (base + BS, BS, 0)])
    assert remote == FakeDList(
        "mem:VRAM", [(remote_base + 6 * BS, BS, 3), (remote_base + 7 * BS, BS, 3)]
    )


def test_large_vram_plan_uses_array_descriptors_with_device(
    agents: list[FakeAgent],
) -> None:
    """Batches of 128+ blocks take the numpy path: the device column must
    survive it too."""
    local_base, remote_base = 0x7F00_0000_0000, 0x7E00_0000_0000
    t = NixlDataTransport(FakeCudaTensor(local_base, 256 * BS, index=1), BS)
    t.add_peer(_peer(MEM_VRAM, 2, remote_base, 512))
    src = list(range(256))
    dst = [2 * i for i in range(256)]
    t.post_write("peer-1", src, dst)
    ((_, local, remote, _, _),) = _sent(agents[0])
    assert local.descs == [(local_base + s * BS, BS, 1) for s in src]
    assert remote.descs == [(remote_base + d * BS, BS, 2) for d in dst]


def test_same_kind_peer_is_not_warned_about(
    agents: list[FakeAgent], caplog: pytest.LogCaptureFixture
) -> None:
    t = NixlDataTransport(FakeCudaTensor(0x7F00_0000_0000, 8 * BS, index=0), BS)
    with caplog.at_level(logging.WARNING, logger="vllm.p2p_kv.data"):
        t.add_peer(_peer(MEM_VRAM, 1, 0x7E00_0000_0000, 8))
    assert "slow software path" not in caplog.text


def test_vram_region_must_hold_whole_blocks(agents: list[FakeAgent]) -> None:
    with pytest.raises(ValueError, match="whole number"):
        NixlDataTransport(FakeCudaTensor(0x7F00_0000_0000, BS + 2, index=0), BS)
    assert agents == []  # refused before any agent exists


def test_cuda_tensor_without_index_is_refused(agents: list[FakeAgent]) -> None:
    region = FakeCudaTensor(0x7F00_0000_0000, 8 * BS, index=0)
    region.device = FakeDevice("cuda", None)
    with pytest.raises(ValueError, match="device index"):
        NixlDataTransport(region, BS)
    assert agents == []


def _ipc_offer(nbytes: int) -> CudaIpcRegion:
    return CudaIpcRegion(boot_id(), 4242, b"h" * 64, offset=4096, length=nbytes)


def test_a_gpu_region_offers_cuda_ipc_where_cuda_can_export_it(
    agents: list[FakeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    region = FakeCudaTensor(0x7F00_0000_0000, 16 * BS, index=0)
    # No CUDA runtime in this process (or, on a GPU machine, no CUDA memory
    # at this address): nothing to export, NIXL reads the region.
    with pytest.raises(OSError, match=r"no CUDA runtime|cuMemGetAddressRange"):
        export_cuda_region(0x7F00_0000_0000, 16 * BS, 0)
    assert NixlDataTransport(region, BS).local_region().cuda_ipc is None
    asked: list[tuple[int, int, int]] = []

    def export(addr: int, nbytes: int, device: int) -> CudaIpcRegion:
        asked.append((addr, nbytes, device))
        return _ipc_offer(nbytes)

    monkeypatch.setattr(local, "export_cuda_region", export)
    info = NixlDataTransport(region, BS).local_region()
    assert asked == [(0x7F00_0000_0000, 16 * BS, 0)]
    wire = msgspec.msgpack.encode(info)
    assert msgspec.msgpack.decode(wire, type=RegionInfo).cuda_ipc == _ipc_offer(16 * BS)
    host = NixlDataTransport(np.zeros(16 * BS, dtype=np.uint8), BS)
    assert host.local_region().cuda_ipc is None  # host memory is not exported
    assert (
        NixlDataTransport(region, BS, same_host=False).local_region().cuda_ipc is None
    )


@pytest.mark.parametrize(
    ("ours", "opened"), [("vram", True), ("dram", False)], ids=["gpu", "host"]
)
def test_only_a_gpu_consumer_opens_a_gpu_peers_ipc_offer(
    agents: list[FakeAgent], monkeypatch: pytest.MonkeyPatch, ours: str, opened: bool
) -> None:
    """GPU memory is copied only into GPU memory; a host consumer READs it
    through NIXL. A refused offer leaves the peer on NIXL, usable."""
    tried: list[tuple[CudaIpcRegion, str]] = []

    class Refusing:
        def __init__(self, offer: CudaIpcRegion, conn: str) -> None:
            tried.append((offer, conn))
            raise OSError("no CUDA here")

    monkeypatch.setattr(local, "CudaIpcMapping", Refusing)
    region: Any = (
        FakeCudaTensor(0x7F00_0000_0000, 16 * BS, index=0)
        if ours == "vram"
        else np.zeros(16 * BS, dtype=np.uint8)
    )
    t = NixlDataTransport(region, BS)
    peer = msgspec.structs.replace(
        _peer(MEM_VRAM, 1, 0x7E00_0000_0000, 16), cuda_ipc=_ipc_offer(16 * BS)
    )
    t.add_peer(peer, conn_inode="12345")
    assert tried == ([(_ipc_offer(16 * BS), "12345")] if opened else [])
    assert t.same_host_peers == 0
    t.post_read("peer-1", [0], [3])  # through NIXL
    assert [op for op, *_ in agents[0].xfers] == ["READ"]


class OpenedGpuRegion:
    """A GPU peer's region as opened through CUDA IPC (not a host file)."""

    def __init__(self, same_gpu: bool) -> None:
        #: as ``CudaIpcMapping.copy_always``: every load is copied from a
        #: region on our own GPU
        self.copy_always = same_gpu


@pytest.mark.parametrize("same_gpu", [False, True], ids=["other_gpu", "same_gpu"])
def test_a_gpu_peers_loads_are_copied_when_they_scatter_or_share_our_gpu(
    agents: list[FakeAgent], monkeypatch: pytest.MonkeyPatch, same_gpu: bool
) -> None:
    """Opened through CUDA IPC, a region on another GPU is copied from only
    by loads of many runs; small or single-run loads stay on NIXL, which
    posts them faster (``local.IPC_MIN_RUNS``). A region on our own GPU is
    copied from by every load: NIXL's READs between two processes on one
    GPU crawl (0.7 GB/s on an H200)."""
    monkeypatch.setattr(local, "IPC_MIN_RUNS", 4)
    t = NixlDataTransport(FakeCudaTensor(0x7F00_0000_0000, 64 * BS, index=0), BS)
    t.add_peer(_peer(MEM_VRAM, 1, 0x7E00_0000_0000, 64))
    copied: list[list[tuple[int, int, int]]] = []

    class Copier:
        def copy(self, src: object, plan: WritePlan) -> None:
            copied.append(plan.runs())

    t._peers.known["peer-1"].mapping = OpenedGpuRegion(same_gpu)  # type: ignore[assignment]
    t._local.copier = Copier()  # type: ignore[assignment]
    t.post_read("peer-1", [0, 1, 2], [5, 7, 9])  # 3 blocks: too few
    t.post_read("peer-1", list(range(8)), list(range(10, 18)))  # one run
    t.post_read("peer-1", list(range(8)), [10, 11, 12, 13, 20, 21, 22, 23])  # 2 runs
    t.post_read("peer-1", list(range(8)), list(range(10, 26, 2)))  # 8 runs
    scattered = [(10 + 2 * i, i, 1) for i in range(8)]
    if same_gpu:
        assert copied == [
            [(5, 0, 1), (7, 1, 1), (9, 2, 1)],
            [(10, 0, 8)],
            [(10, 0, 4), (20, 4, 4)],
            scattered,
        ]
        assert t.local_reads == 4
        assert agents[0].xfers == []
        return
    assert copied == [scattered]
    assert t.local_reads == 1
    assert [op for op, *_ in agents[0].xfers] == ["READ"] * 3
    with pytest.raises(ValueError, match="8 entries but dst_blocks has 0"):
        t.post_read("peer-1", [], list(range(8)))  # a caller's mistake, named
