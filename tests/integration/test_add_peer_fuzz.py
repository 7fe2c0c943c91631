"""``add_peer`` against hostile Regions, with real NIXL agents.

A Region is a peer's word, sent before (without a shared secret: instead
of) any proof of who it is. Whatever it holds, ``add_peer`` either keeps
the peer or raises ValueError, and a Region refused leaves nothing loaded
in NIXL: no agent, no UCX endpoint, no log line per try.

What NIXL holds is asked of NIXL itself, not of our bookkeeping. Its Python
API lists no remote agents, but ``invalidateRemoteMD(name)`` answers
``NIXL_ERR_NOT_FOUND`` exactly when neither its memory sections nor its
connections hold ``name``, so every name any try could have made NIXL load
(the name NIXL reads from that try's metadata) is invalidated at the end
and must be found nowhere. NIXL also leaves UCX endpoints behind that this
cannot see (metadata it refuses while loading memory sections: the name's
endpoint stays in the UCX backend, and that name never loads again), so
each such name must then load the valid metadata afresh.

The bytes only UCX reads (the worker address in a connection, the key in
a memory descriptor) are not mutated: NIXL hands them to UCX unchecked, and
one flipped bit in the address's header aborts the process in a UCX
assertion. Only a peer that proved the shared secret may send them.
"""

from __future__ import annotations

import gc
import logging
import struct
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import psutil
import pytest

from p2p_kv.data import NixlDataTransport, RegionInfo
from p2p_kv.data.offer import CudaIpcRegion, ShmRegion
from p2p_kv.data.procfs import boot_id

pytestmark = pytest.mark.timeout(120)

BS, N = 4096, 16
TRIES = 20_000
WARM_UP = 2000
#: RSS growth allowed after the warm-up (one agent held costs ~44 KB).
RSS_BOUND = 6 << 20
NOT_FOUND = "NIXL_ERR_NOT_FOUND"

Fields = list[tuple[bytes, bytes]]
Parties = tuple[NixlDataTransport, NixlDataTransport, NixlDataTransport]


# -- NIXL's metadata format, as the test reads and writes it ----------------


def _fields(blob: bytes) -> Fields:
    """A valid NIXL agent metadata's fields, in order, by its schema."""
    at, out = len(b"nixlSerDes|"), Fields()

    def take(tag: bytes) -> bytes:
        nonlocal at
        assert blob[at : at + len(tag)] == tag, (tag, at)
        (size,) = struct.unpack_from("=Q", blob, at + len(tag))
        start = at + len(tag) + 8
        out.append((tag, blob[start : start + size]))
        at = start + size + 1
        return blob[start : start + size]

    def count(tag: bytes) -> int:
        n: int = struct.unpack("=Q", take(tag))[0]
        return n

    take(b"Agent")
    for _ in range(count(b"Conns")):
        take(b"t")
        take(b"c")
    take(b"")
    for _ in range(count(b"nixlSecElms")):
        take(b"bknd")
        take(b"nixlDList")
        take(b"t")
        for _ in range(count(b"n")):
            take(b"")
    assert at == len(blob)
    return out


def _blob(fields: Fields, sizes: dict[int, int] | None = None) -> bytes:
    """Fields back into metadata; ``sizes``: a length field's value to
    write instead of the true one, by field index."""
    sizes = sizes or {}
    return b"nixlSerDes|" + b"".join(
        tag + struct.pack("=Q", sizes.get(i, len(value))) + value + b"|"
        for i, (tag, value) in enumerate(fields)
    )


def _renamed(blob: bytes, name: bytes) -> bytes:
    fields = _fields(blob)
    fields[0] = (b"Agent", name)
    return _blob(fields)


def _opaque(blob: bytes) -> set[int]:
    """Byte offsets only UCX reads: a connection's worker address, a
    descriptor's key."""
    at, out = len(b"nixlSerDes|"), set[int]()
    for tag, value in _fields(blob):
        start = at + len(tag) + 8
        if tag == b"c":
            out.update(range(start, start + len(value)))
        elif tag == b"" and len(value) > 24:
            out.update(range(start + 24, start + len(value)))
        at = start + len(value) + 1
    return out


def _nixl_name(blob: bytes) -> bytes:
    """The agent name NIXL's loader reads from ``blob`` (its deserializer:
    the intro, then the "Agent" field, its ``|`` unchecked); b"" for none."""
    intro, tag = b"nixlSerDes|", b"Agent"
    at = len(intro) + len(tag)
    if not blob.startswith(intro + tag) or at + 8 > len(blob):
        return b""
    (size,) = struct.unpack_from("=Q", blob, at)
    if at + 8 + size + 1 > len(blob):
        return b""
    return blob[at + 8 : at + 8 + size]


# -- the parties --------------------------------------------------------------


def _region(seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, N * BS, np.uint8)


@pytest.fixture
def parties() -> Iterator[Parties]:
    """Us (offering nothing same-host, but opening offers), a peer whose
    Region is mutated, and a peer we know."""
    with (
        NixlDataTransport(_region(0), BS, name="fuzz-us") as us,
        NixlDataTransport(_region(1), BS, name="fuzz-peer", same_host=False) as peer,
        NixlDataTransport(_region(2), BS, name="fuzz-known", same_host=False) as known,
    ):
        yield us, peer, known


def _read(t: NixlDataTransport, agent: str, remote: int, local: int) -> bool:
    tid = t.post_read(agent, [remote], [local])
    end = time.monotonic() + 10
    while time.monotonic() < end:
        for done, ok in t.poll_completions():
            assert done == tid
            return bool(ok)
    raise AssertionError("READ not reported")


class _Mutator:
    """Hostile variants of a valid Region: its metadata's bytes and fields,
    and its other fields."""

    def __init__(
        self, good: RegionInfo, us: str, known: str, rng: np.random.Generator
    ) -> None:
        self.good, self.us, self.known, self.rng = good, us, known, rng
        self.md = good.agent_metadata
        self.fields = _fields(self.md)
        self.flippable = sorted(set(range(len(self.md))) - _opaque(self.md))
        self.fresh = 0
        self.kinds: list[Callable[[], tuple[RegionInfo, str | None]]] = [
            self.flip,
            self.flip,
            self.flip,
            self.truncate,
            self.extend,
            self.bad_utf8_name,
            self.bad_utf8_name,
            self.known_name,
            self.our_name,
            self.random_bytes,
            self.empty,
            self.bad_size,
            self.fields_reordered,
            self.other_field,
            self.other_field,
            self.new_incarnation,
            self.same_host_offer,
        ]

    def __call__(self) -> tuple[RegionInfo, str | None]:
        """A Region, and the ``conn_inode`` to add it with."""
        return self.kinds[int(self.rng.integers(len(self.kinds)))]()

    def _with(self, md: bytes, **kw: Any) -> tuple[RegionInfo, str | None]:
        return msgspec.structs.replace(self.good, agent_metadata=md, **kw), None

    def _name(self) -> str:
        self.fresh += 1
        return f"fuzz-new-{self.fresh:06d}"

    def flip(self) -> tuple[RegionInfo, str | None]:
        md = bytearray(self.md)
        for _ in range(int(self.rng.integers(1, 4))):
            at = self.flippable[int(self.rng.integers(len(self.flippable)))]
            md[at] ^= 1 << int(self.rng.integers(8))
        return self._with(bytes(md))

    def truncate(self) -> tuple[RegionInfo, str | None]:
        return self._with(self.md[: int(self.rng.integers(len(self.md)))])

    def extend(self) -> tuple[RegionInfo, str | None]:
        return self._with(self.md + self.rng.bytes(int(self.rng.integers(1, 32))))

    def bad_utf8_name(self) -> tuple[RegionInfo, str | None]:
        # A distinct name each time: each would be one more agent held.
        name = b"\xff\xfe" + self._name().encode()
        claimed = self.good.agent_name if self.rng.integers(2) else self._name()
        return self._with(_renamed(self.md, name), agent_name=claimed)

    def known_name(self) -> tuple[RegionInfo, str | None]:
        md = _renamed(self.md, self.known.encode())
        claimed = self.known if self.rng.integers(2) else self.good.agent_name
        return self._with(md, agent_name=claimed)

    def our_name(self) -> tuple[RegionInfo, str | None]:
        md = _renamed(self.md, self.us.encode())
        claimed = self.us if self.rng.integers(2) else self.good.agent_name
        return self._with(md, agent_name=claimed)

    def random_bytes(self) -> tuple[RegionInfo, str | None]:
        junk = self.rng.bytes(int(self.rng.integers(1, 600)))
        return self._with(b"nixlSerDes|" + junk if self.rng.integers(2) else junk)

    def empty(self) -> tuple[RegionInfo, str | None]:
        return self._with(b"")

    def bad_size(self) -> tuple[RegionInfo, str | None]:
        i = int(self.rng.integers(len(self.fields)))
        true = len(self.fields[i][1])
        sizes = [0, max(0, true - 1), true + 1, true + 1000, 2**63, 2**64 - 1]
        size = sizes[int(self.rng.integers(len(sizes)))]
        return self._with(_blob(self.fields, {i: size}))

    def fields_reordered(self) -> tuple[RegionInfo, str | None]:
        fields = list(self.fields)
        i, j = (int(x) for x in self.rng.choice(len(fields), 2, replace=False))
        if self.rng.integers(2):
            fields[i], fields[j] = fields[j], fields[i]
        else:
            fields.insert(i, fields[j])  # a field twice
        return self._with(_blob(fields))

    def other_field(self) -> tuple[RegionInfo, str | None]:
        g, big = self.good, 2**64
        field, value = [
            ("base_addr", 0),
            ("base_addr", -1),
            ("base_addr", g.base_addr + BS),
            ("base_addr", big - 1),
            ("base_addr", big + g.base_addr),
            ("num_blocks", 0),
            ("num_blocks", -1),
            ("num_blocks", N + 1),
            ("num_blocks", 2**62),
            ("block_bytes", 2 * BS),
            ("block_bytes", 0),
            ("mem_kind", "VRAM"),
            ("mem_kind", "dram"),
            ("mem_kind", ""),
            ("device_id", -1),
            ("device_id", 1),
            ("device_id", 2**63),
            ("agent_name", ""),
            ("agent_name", self.us),
            ("agent_name", self.known),
            ("agent_name", "x" * 100_000),
            ("agent_name", "\ud800"),
        ][int(self.rng.integers(22))]
        return self._with(self.md, **{field: value})

    def new_incarnation(self) -> tuple[RegionInfo, str | None]:
        """Valid: the peer under a new name (kept, then removed)."""
        name = self._name()
        return self._with(_renamed(self.md, name.encode()), agent_name=name)

    def same_host_offer(self) -> tuple[RegionInfo, str | None]:
        """Valid metadata under a new name, with an offer that cannot be
        opened: kept, reading through NIXL (one line per interval)."""
        info, _ = self.new_incarnation()
        rng, region = self.rng, self.good.region_bytes
        pid = [1, 2**40, -5, 0][int(rng.integers(4))]
        length = region if rng.integers(2) else int(rng.integers(-1, 2**40))
        shm = ShmRegion(boot_id(), pid, 3, 1, 2, int(rng.integers(-1, 9)), length)
        ipc = CudaIpcRegion(boot_id(), pid, rng.bytes(64), 0, length)
        return msgspec.structs.replace(info, shm=shm, cuda_ipc=ipc), "123456"


def _probe(us: NixlDataTransport, names: set[bytes], valid: bytes) -> tuple[int, int]:
    """(names NIXL held, names whose UCX endpoint was left behind): each
    name is invalidated, then must load the valid metadata afresh."""
    agent = us._agent
    held = poisoned = 0
    for name in names:
        if str(agent.agent.invalidateRemoteMD(name)) != f"nixl_status_t.{NOT_FOUND}":
            held += 1
        try:
            agent.add_remote_agent(_renamed(valid, name))
        except Exception:
            poisoned += 1
        agent.agent.invalidateRemoteMD(name)
    return held, poisoned


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def test_hostile_regions_leave_nothing_loaded(
    parties: Parties,
    caplog: pytest.LogCaptureFixture,
) -> None:
    us, peer, known = parties
    good, kept = peer.local_region(), known.local_region()
    us.add_peer(kept)
    mutate = _Mutator(good, us.agent_name, kept.agent_name, np.random.default_rng(7))
    loads = Counter[str]()
    real_load = us._agent.add_remote_agent

    def counted_load(md: bytes) -> Any:
        try:
            out = real_load(md)
        except Exception:
            loads["refused by NIXL"] += 1
            raise
        loads["loaded"] += 1
        return out

    us._agent.add_remote_agent = counted_load
    names: set[bytes] = set()  # every name NIXL read from a try's metadata
    escaped = Counter[str]()
    sample: dict[str, str] = {}
    outcomes = Counter[str]()
    rss0 = 0
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="vllm.p2p_kv.data"):
        for i in range(TRIES):
            if i == WARM_UP:
                rss0 = _rss()
            info, conn = mutate()
            names.add(_nixl_name(info.agent_metadata))
            try:
                us.add_peer(info, conn_inode=conn)
            except ValueError:
                outcomes["refused"] += 1
            except Exception as exc:
                escaped[type(exc).__name__] += 1
                sample.setdefault(type(exc).__name__, traceback.format_exc())
            else:
                outcomes["kept"] += 1
                if info.agent_name != kept.agent_name:
                    us.remove_peer(info.agent_name)
        rss1 = _rss()
    elapsed = time.monotonic() - t0
    data_lines = [r for r in caplog.records if r.name == "vllm.p2p_kv.data"]
    names -= {b"", us.agent_name.encode(), kept.agent_name.encode()}
    # The known peer is untouched: still ours, its session not ended.
    still = sorted(us.peers())
    faulted = us.take_faulted()
    known_reads = _read(us, kept.agent_name, 3, 4)
    us._agent.add_remote_agent = real_load
    held, poisoned = _probe(us, names, good.agent_metadata)
    try:  # the peer's own Region still loads
        us.add_peer(good)
        good_reads: bool | str = _read(us, good.agent_name, 5, 6)
    except Exception as exc:
        good_reads = repr(exc)
    report = (
        f"{TRIES} tries in {elapsed:.1f}s: {dict(outcomes)}, NIXL {dict(loads)}; "
        f"escaped {dict(escaped)}; {len(names)} names probed: {held} held, "
        f"{poisoned} with an endpoint left; RSS {rss0 / 2**20:.1f} -> "
        f"{rss1 / 2**20:.1f} MiB after the warm-up; {len(data_lines)} log lines; "
        f"known peer {still}, faulted {faulted}, reads {known_reads}; "
        f"the peer's own Region then: {good_reads}"
    )
    print(report)
    assert not escaped, report + "\n" + "\n".join(sample.values())
    assert (held, poisoned) == (0, 0), report
    assert rss1 - rss0 < RSS_BOUND, report
    assert still == [kept.agent_name] and faulted == set(), report
    assert known_reads and good_reads is True, report
    assert loads["refused by NIXL"] == 0, report
    assert len(data_lines) <= 4, [r.getMessage() for r in data_lines]
    assert outcomes["kept"] > 300 and outcomes["refused"] > TRIES / 2, report
    got, src = us._region_obj, peer._region_obj
    assert isinstance(got, np.ndarray) and isinstance(src, np.ndarray)
    assert np.array_equal(got[6 * BS : 7 * BS], src[5 * BS : 6 * BS])


@pytest.mark.parametrize(
    "case", ["not_utf8", "other_name", "our_name", "cut_midway", "map_raises"]
)
def test_what_nixl_loaded_is_dropped_on_every_failure(
    parties: Parties,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    """Past the check (as if it missed something), NIXL loads metadata that
    the Region then fails: nothing of it stays loaded, whatever failed."""
    from p2p_kv.data import remote_agents as peers

    us, peer, _ = parties
    good = peer.local_region()
    monkeypatch.setattr(peers, "check_peer_metadata", lambda *_: None)
    fields = _fields(good.agent_metadata)
    name = good.agent_name.encode()
    error: type[Exception] = ValueError
    if case == "not_utf8":
        name = b"\xff" + name
    elif case == "other_name":
        name = b"fuzz-other"
    elif case == "our_name":
        name = us.agent_name.encode()
    elif case == "cut_midway":
        # NIXL connects, then finds no memory section: it keeps the
        # connection unless told otherwise.
        fields[4] = (b"", b"MemSectioN")
    else:

        def broken(*_: object) -> None:
            raise RuntimeError("mapping broke")

        monkeypatch.setattr(us._local, "maybe_map", broken)
        error = RuntimeError
    fields[0] = (b"Agent", name)
    info = msgspec.structs.replace(good, agent_metadata=_blob(fields))
    with pytest.raises(error):
        us.add_peer(info)
    assert us.peers() == []
    probed = {name, good.agent_name.encode()} - {us.agent_name.encode()}
    assert _probe(us, probed, good.agent_metadata) == (0, 0)
    monkeypatch.undo()
    us.add_peer(good)
    assert _read(us, good.agent_name, 1, 2)


def test_a_thousand_bad_regions_write_a_line_or_two(
    parties: Parties,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Lines a peer causes are rate-limited per kind and name the peer:
    1,000 Regions that each trigger one (a same-host offer that cannot be
    opened, or one of the wrong size) write one line of each kind."""
    us, peer, _ = parties
    mutate = _Mutator(peer.local_region(), us.agent_name, "", np.random.default_rng(3))
    with caplog.at_level(logging.INFO, logger="vllm.p2p_kv.data"):
        for _ in range(1000):
            info, conn = mutate.same_host_offer()
            us.add_peer(info, conn_inode=conn)
            us.remove_peer(info.agent_name)
            with pytest.raises(ValueError):
                us.add_peer(mutate.bad_utf8_name()[0])
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.p2p_kv.data"]
    assert 1 <= len(lines) <= 2, lines
    assert all("fuzz-new-" in line for line in lines), lines
    assert us._plog.suppressed >= 998


def test_a_notification_from_a_name_that_is_not_utf8_costs_no_caller(
    parties: Parties, caplog: pytest.LogCaptureFixture
) -> None:
    """A notification names its sender as the sender chooses, and anyone
    holding our metadata can send one: one whose name is not UTF-8 fails
    NIXL's whole batch in its binding. It is dropped with one line, and
    the caller (the engine's poll loop) goes on."""
    from nixl._api import nixl_agent, nixl_agent_config

    us = parties[0]
    config = nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=[]
    )
    senders = []
    for name in (b"\xff\xfefuzz-evil", "fuzz-honest"):
        sender = nixl_agent(name, config)  # a bytes name: any bytes go
        sender.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        sender.add_remote_agent(us.local_region().agent_metadata)
        senders.append(sender)

    def received() -> list[tuple[str, bytes]]:
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if got := us.poll_notifs():
                return got
            if us._plog.written:
                return []
            time.sleep(0.001)
        raise AssertionError("no notification")

    with caplog.at_level(logging.WARNING, logger="vllm.p2p_kv.data"):
        senders[0].send_notif(us.agent_name, b"forged")
        assert received() == []
        senders[1].send_notif(us.agent_name, b"hello")
        assert received() == [("fuzz-honest", b"hello")]
    assert [r.getMessage() for r in caplog.records if "not UTF-8" in r.getMessage()]


def test_memory_types_are_nixls(parties: Parties) -> None:
    """The check reads NIXL's memory types as NIXL numbers them; a GPU
    region's metadata differs from a host one's only there (no GPU here to
    make one)."""
    from nixl._bindings import DRAM_SEG, VRAM_SEG

    from p2p_kv.data.regions import (
        _NIXL_MEM_TYPES,
        MEM_DRAM,
        MEM_VRAM,
        check_peer_metadata,
    )

    assert {MEM_DRAM: int(DRAM_SEG), MEM_VRAM: int(VRAM_SEG)} == _NIXL_MEM_TYPES
    host = parties[1].local_region()
    check_peer_metadata(host, ("UCX",))
    fields = _fields(host.agent_metadata)
    i = max(k for k, (tag, _) in enumerate(fields) if tag == b"t")
    fields[i] = (b"t", struct.pack("=i", int(VRAM_SEG)))
    gpu = msgspec.structs.replace(host, agent_metadata=_blob(fields), mem_kind=MEM_VRAM)
    check_peer_metadata(gpu, ("UCX",))
    with pytest.raises(ValueError, match="not DRAM"):
        check_peer_metadata(msgspec.structs.replace(gpu, mem_kind=MEM_DRAM), ("UCX",))
    with pytest.raises(ValueError, match="none of our NIXL backends"):
        check_peer_metadata(host, ("GDS",))
