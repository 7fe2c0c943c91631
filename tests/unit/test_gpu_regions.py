"""VRAM regions in the data transport, without CUDA and without NIXL.

A fake tensor-like object stands in for a CUDA tensor and a fake NIXL agent
records what the transport asks of NIXL, so CI checks the GPU path's
registration and descriptors: which memory type and device each side's
descriptors name and which addresses they cover. A wrong device id or
memory type here would make UCX read or write the wrong GPU's memory, or
refuse the transfer, only on a GPU machine. The transfers themselves run in
``tests/integration/test_gpu_transfer.py`` where CUDA exists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from p2p_kv import data
from p2p_kv.data import MEM_DRAM, MEM_VRAM, NixlDataTransport, RegionInfo

BS = 4096


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
class FakeAgent:
    """Records NIXL calls; every transfer completes at once."""

    name: str
    registered: list[tuple[list[tuple[int, int, int, str]], str]] = field(
        default_factory=list
    )
    deregistered: list[Any] = field(default_factory=list)
    xfers: list[tuple[str, FakeDList, FakeDList, str, bytes]] = field(
        default_factory=list
    )
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
        return f"md:{self.name}".encode()

    def add_remote_agent(self, md: bytes) -> bytes:
        return md.removeprefix(b"md:")

    def remove_remote_agent(self, name: str) -> None:
        pass

    def initialize_xfer(
        self, op: str, local: FakeDList, remote: FakeDList, peer: str, notif: bytes
    ) -> object:
        self.xfers.append((op, local, remote, peer, notif))
        return _Handle()

    def transfer(self, handle: object) -> str:
        return "DONE"

    def check_xfer_state(self, handle: object) -> str:
        return "DONE"

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}


class _Handle:
    def release(self) -> None:
        pass


def _dlist(mem: str, descs: Any) -> FakeDList:
    rows = descs.tolist() if isinstance(descs, np.ndarray) else descs
    return FakeDList(mem, [tuple(int(v) for v in r) for r in rows])


@pytest.fixture
def agents(monkeypatch: pytest.MonkeyPatch) -> list[FakeAgent]:
    made: list[FakeAgent] = []

    def agent(name: str, config: object) -> FakeAgent:
        made.append(FakeAgent(name))
        return made[-1]

    monkeypatch.setattr(
        data, "_load_nixl", lambda: (agent, lambda **kw: kw, _dlist), raising=True
    )
    return made


def _peer(mem: str, device: int, base: int, blocks: int) -> RegionInfo:
    return RegionInfo(
        agent_name="peer-1",
        agent_metadata=b"md:peer-1",
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
    t = NixlDataTransport(region, BS, name="gpu")
    (agent,) = agents
    assert agent.registered == [([(0x7F00_0000_0000, 16 * BS, 1, "")], MEM_VRAM)]
    info = t.local_region()
    assert (info.mem_kind, info.device_id, info.base_addr) == (
        MEM_VRAM,
        1,
        0x7F00_0000_0000,
    )
    assert (info.num_blocks, info.block_bytes) == (16, BS)
    # Metadata is taken after registration: it carries the region's keys.
    assert info.agent_metadata == f"md:{t.agent_name}".encode()
    t.close()
    assert agent.deregistered == [("reg", 1)]


def test_vram_to_vram_descriptors_name_each_sides_gpu(
    agents: list[FakeAgent],
) -> None:
    local_base, remote_base = 0x7F00_0000_0000, 0x7E00_0000_0000
    t = NixlDataTransport(FakeCudaTensor(local_base, 16 * BS, index=1), BS)
    t.add_peer(_peer(MEM_VRAM, 0, remote_base, 32))
    tid = t.post_write("peer-1", [3, 4, 5, 9], [20, 21, 22, 2], notif=b"n")
    assert t.poll_completions() == [(tid, True)]
    ((op, local, remote, peer, notif),) = agents[0].xfers
    assert (op, peer, notif) == ("WRITE", "peer-1", b"n")
    assert local == FakeDList(
        "mem:VRAM", [(local_base + 3 * BS, 3 * BS, 1), (local_base + 9 * BS, BS, 1)]
    )
    assert remote == FakeDList(
        "mem:VRAM", [(remote_base + 20 * BS, 3 * BS, 0), (remote_base + 2 * BS, BS, 0)]
    )


def test_host_to_gpu_descriptors_mix_memory_types(
    agents: list[FakeAgent], caplog: pytest.LogCaptureFixture
) -> None:
    host = np.zeros(8 * BS, dtype=np.uint8)
    t = NixlDataTransport(host, BS)
    remote_base = 0x7E00_0000_0000
    with caplog.at_level(logging.WARNING, logger="p2p_kv.data"):
        t.add_peer(_peer(MEM_VRAM, 3, remote_base, 8))
    assert "slow software path" in caplog.text
    t.post_write("peer-1", [0, 1], [6, 7])
    ((_, local, remote, _, _),) = agents[0].xfers
    assert local == FakeDList("mem:DRAM", [(int(host.ctypes.data), 2 * BS, 0)])
    assert remote == FakeDList("mem:VRAM", [(remote_base + 6 * BS, 2 * BS, 3)])


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
    ((_, local, remote, _, _),) = agents[0].xfers
    assert local.descs == [(local_base + s * BS, BS, 1) for s in src]
    assert remote.descs == [(remote_base + d * BS, BS, 2) for d in dst]


def test_same_kind_peer_is_not_warned_about(
    agents: list[FakeAgent], caplog: pytest.LogCaptureFixture
) -> None:
    t = NixlDataTransport(FakeCudaTensor(0x7F00_0000_0000, 8 * BS, index=0), BS)
    with caplog.at_level(logging.WARNING, logger="p2p_kv.data"):
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
