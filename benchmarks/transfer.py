"""Fetch throughput through p2p_kv, end to end, against same-run baselines.

One row per (block size, block count). Each p2p_kv fetch is a
:meth:`p2p_kv.runtime.standalone.StandalonePeer.fetch` by a consumer in this process
against a producer StandalonePeer in another process (``serve_until``), on
both load paths:

* ``read`` (the default): lookup over the control plane, the producer pins
  and answers with its slots, the consumer READs them one-sided, job
  result. The Release to the producer leaves in the engine step that
  returns the result, before it: one send is inside *submit->result*. The
  producer is on this host, so the READ is a copy out of its shared region
  (``p2p_kv.data.shm_copy``), not a NIXL transfer: the same-host shortcut;
* ``nixl_read``: the same with ``same_host_copy`` off: the READ goes
  through NIXL (UCX, CMA here), as it does between hosts, into read
  staging, then a copy into the slots (``p2p_kv.data.staged``);
* ``nixl_read_in_place``: the same with ``read_staging_mib: 0``: the READ
  lands in the slots (the cost of staging is the gap between the two);
* ``write`` (reads off): lookup, Fetch, the producer WRITEs with NIXL,
  TransferDone, job result;
* ``pd`` (disaggregated prefill, the default configuration): the producer
  parks the blocks as a ``remote_decoder`` request's stores (before the
  clock starts); the consumer's ``remote_prefiller`` request needs no
  lookup, its load is a Fetch the producer answers with an offer of the
  parked stores, which the consumer READs (a same-host copy here), job
  result. Its *submit* therefore includes the Fetch's round trip.

Two times per fetch:

* ``lookup->result``: from the first lookup to the job result (control and
  data planes together: what a request waits);
* ``submit->result``: from ``submit_load`` to the job result (the load
  itself).

Baselines, measured in the same run on the same mapping (source blocks
``0..n-1`` into every other destination slot, so nothing coalesces: one
descriptor per block on every path):

* raw NIXL READ (the read path's baseline) and WRITE (the write path's),
  and single-thread memcpy: ``benchmarks/raw_nixl.py``;
* vLLM's in-tree p2p tier data transport
  (``vllm.v1.kv_offload.tiering.p2p.data.nixl.NixlTransport``), driven
  directly between two processes: ``write_blocks`` then ``poll`` to done;
* a bare TCP socket's round trip and p2p_kv's control-plane round trip
  (``benchmarks/round_trip.py``: echoes in another process, idle between
  trips as engines are between fetches). A lookup crosses one, so no
  design fetches end to end in less than raw READ plus a TCP round trip;
  the verdicts print one-block fetches against that sum (target <= 2x)
  and the control plane against the bare socket (target <= 1.5x).

Targets (from the issue): p2p_kv >= 0.8x raw NIXL for fetches of 16 MiB
and more; small fetches (<= 1 MiB) within 2x raw NIXL's latency.

Run: ``p2p-kv bench transfer [--json] [--quick] [--repeats N]`` (or
``python -m benchmarks.transfer`` from the checkout).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks import round_trip
from benchmarks.harness import (
    KIB,
    MIB,
    PRODUCER_NETNS_ENV,
    FetchPair,
    ProducerProcess,
    WorkerPair,
    bench_peer,
    between_namespaces,
    block_label,
    key,
    median_round,
    met,
    producer_host,
    scattered_mapping,
    serve_blocks,
    serve_commands,
    summary,
)
from benchmarks.raw_nixl import RawNixlPair, measure_memcpy
from benchmarks.round_trip import MESSAGE, RoundTrips

if TYPE_CHECKING:
    from p2p_kv.runtime.standalone import StandalonePeer

SIZES = (64 * KIB, 256 * KIB, 2 * MIB)
COUNTS = (1, 16, 256)
QUICK = ((64 * KIB, 1), (64 * KIB, 16), (64 * KIB, 256), (2 * MIB, 1), (2 * MIB, 16))
BIG_BYTES = 16 * MIB  # throughput target applies from here
SMALL_BYTES = 1 * MIB  # latency target applies up to here
TARGET_RATIO = 0.8
TARGET_LATENCY_X = 2.0
#: one-block fetches, lookup to result, against raw READ + a bare TCP trip
TARGET_FLOOR_X = 2.0
PATHS = ("read", "nixl_read", "nixl_read_in_place", "write", "pd")
#: Between namespaces: the paths a fetch from another host can take (the
#: same-host shortcut needs a producer proved to be on this host, and
#: across namespaces none is).
NETNS_PATHS = ("nixl_read", "nixl_read_in_place", "write")
#: end-to-end cells also compared with raw READ plus one bare TCP round trip
FLOOR_CELLS = ("e2e", "n_e2e")
#: p2p_kv cells and the raw NIXL baseline each is compared with
P2P_CELLS = {
    "submit": ("read", "submit", "raw_read"),
    "e2e": ("read", "e2e", "raw_read"),
    "n_submit": ("nixl_read", "submit", "raw_read"),
    "n_e2e": ("nixl_read", "e2e", "raw_read"),
    "i_submit": ("nixl_read_in_place", "submit", "raw_read"),
    "dp": ("read", "data_plane", "raw_read"),
    "n_dp": ("nixl_read", "data_plane", "raw_read"),
    "w_submit": ("write", "submit", "raw_nixl"),
    "w_e2e": ("write", "e2e", "raw_nixl"),
    "pd_submit": ("pd", "submit", "raw_read"),
}
_TIMEOUT_S = 180.0


# ---------------------------------------------------------------------------
# p2p_kv end to end: a producer process, a consumer here
# ---------------------------------------------------------------------------


def _p2p_producer(
    block_bytes: int, num_blocks: int, parks: Any, out: Any, stop: Any
) -> None:
    """Serve lookups and fetches; on ``parks`` (a pipe), park the blocks of
    slots ``0..n-1`` as a finished ``remote_decoder`` request's stores."""
    stores = itertools.count(1 << 50)

    def start() -> tuple[StandalonePeer, tuple[Any, ...]]:
        peer = bench_peer(
            num_blocks, block_bytes, f"bench-prod-{os.getpid()}", host=producer_host()
        )
        region = np.asarray(peer.region)
        region[:] = np.random.default_rng(7).integers(
            0, 256, region.size, dtype=np.uint8
        )
        rows = region.reshape(num_blocks, block_bytes)
        return peer, (peer.address, [zlib.crc32(r.data) for r in rows])

    def each_step(peer: StandalonePeer) -> None:
        from p2p_kv.node.roles import Roles

        peer.results.clear()  # the parked stores' results: served
        if parks.poll():
            kv_id, n = parks.recv()
            rt = peer.runtime
            with rt.lock:
                rt.start_request(f"p-{kv_id}", Roles(dest_kv_id=kv_id))
                rt.manager.submit_store(
                    next(stores),
                    f"p-{kv_id}",
                    [key(s) for s in range(n)],
                    list(range(n)),
                    rt.clock(),
                )
                rt.end_request(f"p-{kv_id}")
            parks.send(kv_id)

    serve_blocks(out, stop, start, each_step)


class P2PPair(FetchPair):
    """Producer StandalonePeer in a process; a consumer StandalonePeer here
    per load path (``read``: one-sided READs; ``write``: reads off, so the
    producer WRITEs; the others: :func:`benchmarks.harness.path_options`)."""

    def __init__(self, block_bytes: int, max_blocks: int) -> None:
        #: the load paths measured (between namespaces, the remote ones)
        self.paths = NETNS_PATHS if os.environ.get(PRODUCER_NETNS_ENV) else PATHS
        self._parks, theirs = mp.get_context("spawn").Pipe()
        producer = ProducerProcess(
            _p2p_producer, block_bytes, max_blocks, theirs, timeout_s=_TIMEOUT_S
        )
        consumers = {
            path: bench_peer(
                2 * max_blocks, block_bytes, f"bench-cons-{path}-{os.getpid()}", path
            )
            for path in self.paths
        }
        super().__init__(producer, consumers, block_bytes)
        self.crcs = producer.ready[1]

    def request(self, path: str, n: int) -> tuple[str, dict[str, Any]]:
        if path != "pd":
            return super().request(path, n)
        kv_id = f"bench-{self._n}"
        self._parks.send((kv_id, n))  # keys are of slots 0..n-1
        if self._parks.recv() != kv_id:
            raise RuntimeError("p2p_kv producer did not park the blocks")
        return kv_id, {"probe": False}

    def _keep_alive(self, i: int) -> None:
        """Long numpy work between fetches: step now and then, as an engine
        would, so the producer keeps hearing from us."""
        if i % 8 == 7:
            for consumer in self.consumers.values():
                consumer.step(wait=False)

    def _rows(self, path: str) -> Any:
        return np.asarray(self.consumers[path].region).reshape(-1, self.block_bytes)

    def clear(self, path: str, dst: list[int]) -> None:
        rows = self._rows(path)
        for i, d in enumerate(dst):
            rows[d] = 0
            self._keep_alive(i)

    def check(self, path: str, src: list[int], dst: list[int]) -> None:
        rows = self._rows(path)
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            if zlib.crc32(rows[d].data) != self.crcs[s]:
                raise AssertionError(f"p2p_kv: slot {d} holds the wrong bytes")
            self._keep_alive(i)

    def measure(
        self, path: str, num_blocks: int, repeats: int, verify: bool = True
    ) -> dict[str, Any]:
        consumer = self.consumers[path]
        src, dst = scattered_mapping(num_blocks)
        total, submit = self.timed_fetches(path, src, dst, repeats, verify=verify)
        nbytes = num_blocks * self.block_bytes
        used = sum(
            s.link.counters.loads_fetched
            if path in ("write", "pd")
            else s.link.counters.loads_read
            for s in consumer.manager.sessions()
        )
        copies = consumer.runtime.data.local_reads
        if used == 0 or (copies > 0) != (path in ("read", "pd")):
            raise AssertionError(
                f"p2p_kv: loads did not take the {path} path "
                f"({used} loads, {copies} same-host copies)"
            )
        out = {
            "e2e": summary(total, nbytes),
            "submit": summary(submit, nbytes),
            "verified": True,
        }
        # Between namespaces the READ moves only as the producer makes
        # progress, which it does while it holds blocks offered for it: a
        # READ posted by hand, with no offer, waits on its idle ticks.
        if path not in ("write", "pd") and not os.environ.get(PRODUCER_NETNS_ENV):
            out["data_plane"] = summary(
                self._data_plane(consumer, src, dst, repeats), nbytes
            )
        return out

    def _data_plane(
        self, consumer: Any, src: list[int], dst: list[int], repeats: int
    ) -> list[float]:
        """The same READ through p2p_kv's data transport alone, from its
        post to its completion: no lookup, no manager, no step. What the
        load costs beyond this is bookkeeping and the engine's step."""
        rt = consumer.runtime
        agent = rt.transfers.agent_of(self.peer)
        if agent is None:
            raise RuntimeError("p2p_kv: no data-plane agent for the producer")
        seconds = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            tid = rt.data.post_read(agent, src, dst)
            while True:
                done = dict(rt.data.poll_completions())
                if tid in done:
                    break
            seconds.append(time.perf_counter() - t0)
            if not done[tid]:
                raise RuntimeError("p2p_kv: data-plane READ failed")
        return seconds[2:]


# ---------------------------------------------------------------------------
# vLLM's in-tree p2p tier data transport, driven directly
# ---------------------------------------------------------------------------


def _vllm_worker(conn: Any) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO goes to stdout
    serve_commands(conn, _vllm_handlers)


def _vllm_handlers() -> dict[str, Callable[..., Any]]:
    from vllm.v1.kv_offload.tiering.p2p.data.nixl import NixlTransport

    held: dict[str, Any] = {}  # the transport and its buffer

    def setup(
        name: str, num_blocks: int, block_bytes: int, seed: int | None
    ) -> tuple[Any, int, list[int]]:
        if seed is None:
            buf = np.ones(num_blocks * block_bytes, dtype=np.uint8)
        else:
            buf = np.random.default_rng(seed).integers(
                0, 256, num_blocks * block_bytes, dtype=np.uint8
            )
        view = memoryview(buf).cast("B", (num_blocks, block_bytes))
        transport = NixlTransport(name, view)
        if not transport.available:
            raise RuntimeError("vLLM NixlTransport: NIXL agent unavailable")
        held.update(transport=transport, buf=buf)
        rows = buf.reshape(num_blocks, block_bytes)
        return (
            transport.get_agent_metadata(),
            transport.base_addr,
            [zlib.crc32(r.data) for r in rows],
        )

    def peer(md: Any, base: int, num_blocks: int, block_bytes: int) -> None:
        held["transport"].add_remote_peer("peer", md, base, num_blocks, block_bytes)

    def run(src: list[int], dst: list[int], repeats: int) -> list[float]:
        transport = held["transport"]
        seconds = []
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            tid = transport.write_blocks("peer", src, dst)
            deadline = time.monotonic() + _TIMEOUT_S
            while True:
                res = transport.poll("peer")
                if tid in res.failed:
                    raise RuntimeError("vLLM NixlTransport write failed")
                if tid in res.done:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("vLLM NixlTransport write hung")
            if i >= 2:
                seconds.append(time.perf_counter() - t0)
        return seconds

    def crcs(block_bytes: int, slots: list[int]) -> list[int]:
        rows = held["buf"].reshape(-1, block_bytes)
        return [zlib.crc32(rows[s].data) for s in slots]

    def teardown() -> None:
        if held.get("transport") is not None:
            held["transport"].close()
        held.clear()

    return {
        "setup": setup,
        "peer": peer,
        "run": run,
        "crcs": crcs,
        "teardown": teardown,
    }


class VllmPair(WorkerPair):
    """Writer and receiver processes, each owning a vLLM NixlTransport."""

    name = "vLLM worker"

    def __init__(self) -> None:
        super().__init__((_vllm_worker, _vllm_worker), _TIMEOUT_S)

    def measure(
        self, block_bytes: int, num_blocks: int, repeats: int
    ) -> dict[str, Any]:
        src, dst = scattered_mapping(num_blocks)
        self._cell += 1
        tag = f"{os.getpid()}-{self._cell}"
        n_dst = max(dst) + 1
        p_md, p_base, p_crcs = self._call(
            0, "setup", f"vllm-w-{tag}", num_blocks, block_bytes, 7
        )
        c_md, c_base, _ = self._call(
            1, "setup", f"vllm-r-{tag}", n_dst, block_bytes, None
        )
        try:
            self._call(0, "peer", c_md, c_base, n_dst, block_bytes)
            self._call(1, "peer", p_md, p_base, num_blocks, block_bytes)
            seconds = self._call(0, "run", src, dst, repeats)
            got = self._call(1, "crcs", block_bytes, dst)
            if got != [p_crcs[s] for s in src]:
                raise AssertionError("vLLM NixlTransport: destination bytes differ")
        finally:
            self._call(0, "teardown")
            self._call(1, "teardown")
        out = summary(seconds, num_blocks * block_bytes)
        out["verified"] = True
        return out


# ---------------------------------------------------------------------------
# the control plane against a bare TCP socket (benchmarks/round_trip.py)
# ---------------------------------------------------------------------------


def _rt_cell(summary: dict[str, Any]) -> dict[str, Any]:
    """A round trip's summary as a row's cell (``latency_us``; ``gbps`` of
    its 64-byte message, which only orders the rounds)."""
    us = summary["median_us"]
    return {"latency_us": us, "gbps": len(MESSAGE) / us / 1e3}


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------


def _repeats(nbytes: int, base: int) -> int:
    if nbytes <= 16 * MIB:
        return base
    if nbytes <= 64 * MIB:
        return max(3, base // 3)
    return max(3, base // 6)


def run(
    cells: Sequence[tuple[int, int]],
    base_repeats: int,
    rounds: int = 3,
    progress: Any = None,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    vllm: VllmPair | None = None
    vllm_reason = ""
    if os.environ.get(PRODUCER_NETNS_ENV):
        vllm_reason = "not driven between namespaces"
    else:
        try:
            vllm = VllmPair()
        except Exception as exc:
            vllm_reason = f"{type(exc).__name__}: {exc}"
    trips: RoundTrips | None = None
    try:
        # Left to the scheduler, as the fetches measured beside them are:
        # the floor of a fetch must not cross cores its fetch did not.
        trips = RoundTrips(("tcp", "p2p_kv"), pinned=False)
        with RawNixlPair() as raw:
            for bs in dict.fromkeys(b for b, _ in cells):
                counts = [n for b, n in cells if b == bs]
                with P2PPair(bs, max(counts)) as p2p:
                    for n in counts:
                        row, vllm_reason = _cell(
                            raw,
                            p2p,
                            trips,
                            (vllm, vllm_reason),
                            bs,
                            n,
                            base_repeats,
                            rounds,
                        )
                        rows.append(row)
                        if progress is not None:
                            progress(row)
    finally:
        if trips is not None:
            trips.close()
        if vllm is not None:
            vllm.close()
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "rows": rows,
        "targets": _verdicts(rows),
        "vllm_not_driven": vllm_reason or None,
    }


def _cell(
    raw: RawNixlPair,
    p2p: P2PPair,
    trips: RoundTrips,
    in_tree: tuple[VllmPair | None, str],
    bs: int,
    n: int,
    base_repeats: int,
    rounds: int,
) -> tuple[dict[str, Any], str]:
    """One table row: every path measured ``rounds`` times, interleaved, so
    that the machine's noise (other tenants) falls on all of them alike; each
    path reports its median round (by GB/s)."""
    vllm, vllm_reason = in_tree
    reps = _repeats(bs * n, base_repeats)
    src, dst = scattered_mapping(n)
    samples: dict[str, list[dict[str, Any]]] = {
        k: []
        for k in (
            "memcpy",
            "raw_nixl",
            "raw_read",
            "tcp_rt",
            "ctl_rt",
            *P2P_CELLS,
            "vllm",
        )
    }
    for r in range(rounds):
        with p2p.idle():
            samples["memcpy"].append(measure_memcpy(bs, n, reps, src, dst))
            samples["raw_nixl"].append(raw.measure(bs, n, reps, src, dst))
            samples["raw_read"].append(raw.measure(bs, n, reps, src, dst, op="READ"))
            rt = trips.measure(max(reps, 20))
            samples["tcp_rt"].append(_rt_cell(rt["tcp"]))
            samples["ctl_rt"].append(_rt_cell(rt["p2p_kv"]))
            if vllm is not None and not vllm_reason:
                try:
                    samples["vllm"].append(vllm.measure(bs, n, reps))
                except Exception as exc:
                    vllm_reason = f"{type(exc).__name__}: {exc}"
        for path in p2p.paths:
            got = p2p.measure(path, n, reps, verify=r == 0)
            for cell, (p, which, _) in P2P_CELLS.items():
                if p == path and which in got:
                    samples[cell].append(got[which])
    row: dict[str, Any] = {
        "block_bytes": bs,
        "num_blocks": n,
        "bytes": bs * n,
        "repeats": reps,
        "rounds": rounds,
    }
    for name, runs in samples.items():
        if not runs:
            why = vllm_reason if name == "vllm" else "path not measured"
            row[name] = {"not_driven": why}
            continue
        row[name] = median_round(runs)
    baselines = {name: base for name, (_, _, base) in P2P_CELLS.items()}
    baselines["vllm"] = "raw_nixl"  # it WRITEs, producer to consumer
    for name, base in baselines.items():
        cell = row[name]
        if "gbps" in cell and "gbps" in row[base]:
            cell["ratio_raw"] = cell["gbps"] / row[base]["gbps"]
            cell["latency_x_raw"] = cell["latency_us"] / row[base]["latency_us"]
    row["ctl_rt"]["x_tcp"] = row["ctl_rt"]["latency_us"] / row["tcp_rt"]["latency_us"]
    floor_us = row["raw_read"]["latency_us"] + row["tcp_rt"]["latency_us"]
    for name in FLOOR_CELLS:
        if "latency_us" in row[name]:
            row[name]["latency_x_floor"] = row[name]["latency_us"] / floor_us
    return row, vllm_reason


def _verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in P2P_CELLS:
        got = [r for r in rows if "ratio_raw" in r[name]]
        big = [r[name]["ratio_raw"] for r in got if r["bytes"] >= BIG_BYTES]
        small = [r[name]["latency_x_raw"] for r in got if r["bytes"] <= SMALL_BYTES]
        out[name] = {
            "min_ratio_big": min(big) if big else None,
            "throughput_ok": bool(big) and min(big) >= TARGET_RATIO,
            "max_latency_x_small": max(small) if small else None,
            "latency_ok": bool(small) and max(small) <= TARGET_LATENCY_X,
        }
        if name in FLOOR_CELLS:
            floor = [
                r[name]["latency_x_floor"] for r in got if r["bytes"] <= SMALL_BYTES
            ]
            out[name]["max_latency_x_floor_small"] = max(floor) if floor else None
    for name in FLOOR_CELLS:
        one = [
            r[name]["latency_x_floor"]
            for r in rows
            if r["num_blocks"] == 1 and "latency_x_floor" in r[name]
        ]
        out[name]["max_latency_x_floor_one_block"] = max(one) if one else None
        out[name]["one_block_ok"] = bool(one) and max(one) <= TARGET_FLOOR_X
    tcp = statistics.median(r["tcp_rt"]["latency_us"] for r in rows)
    ours = statistics.median(r["ctl_rt"]["latency_us"] for r in rows)
    out["round_trip"] = {
        "tcp_us": tcp,
        "p2p_kv_us": ours,
        "x_tcp": ours / tcp,
        "ok": ours / tcp <= round_trip.TARGET_X,
    }
    return out


HEADER = (
    f"{'block':>6} {'n':>4} {'MiB':>6} | {'memcpy':>6} | "
    f"{'raw RD':>7} {'us':>7} | {'read sub':>8} {'us':>7} {'x raw':>5} | "
    f"{'read e2e':>8} {'us':>7} | {'nixl sub':>8} {'us':>7} {'x raw':>5} | "
    f"{'in place':>8} {'x raw':>5} | "
    f"{'raw WR':>7} {'us':>7} | {'write sub':>9} {'us':>7} {'x raw':>5} | "
    f"{'vLLM':>5} {'x raw':>5} | {'dp us':>6} {'nixl dp':>7} | "
    f"{'pd sub':>7} {'us':>7} {'x raw':>5} | {'tcp rt':>6} {'ctl rt':>6}"
)


def _v(cell: dict[str, Any], field: str, width: int, digits: int) -> str:
    """One number of a cell, or ``n/d`` (not driven) in its place."""
    if field not in cell:
        return f"{'n/d':>{width}}"
    return f"{cell[field]:>{width}.{digits}f}"


def _line(row: dict[str, Any]) -> str:
    bs, n = row["block_bytes"], row["num_blocks"]
    block = block_label(bs)

    def gb_us_x(name: str, w: int) -> str:
        c = row[name]
        return f"{_v(c, 'gbps', w, 2)} {_v(c, 'latency_us', 7, 1)} {_v(c, 'ratio_raw', 5, 2)}"

    rr, rw, vl = row["raw_read"], row["raw_nixl"], row["vllm"]
    e2e, isub = row["e2e"], row["i_submit"]
    return (
        f"{block:>6} {n:>4} {row['bytes'] / MIB:>6.2f} | {row['memcpy']['gbps']:>6.2f} | "
        f"{rr['gbps']:>7.2f} {rr['latency_us']:>7.1f} | "
        f"{gb_us_x('submit', 8)} | "
        f"{_v(e2e, 'gbps', 8, 2)} {_v(e2e, 'latency_us', 7, 1)} | "
        f"{gb_us_x('n_submit', 8)} | "
        f"{_v(isub, 'gbps', 8, 2)} {_v(isub, 'ratio_raw', 5, 2)} | "
        f"{rw['gbps']:>7.2f} {rw['latency_us']:>7.1f} | "
        f"{gb_us_x('w_submit', 9)} | "
        f"{_v(vl, 'gbps', 5, 2)} {_v(vl, 'ratio_raw', 5, 2)} | "
        f"{_v(row['dp'], 'latency_us', 6, 1)} {_v(row['n_dp'], 'latency_us', 7, 1)} | "
        f"{gb_us_x('pd_submit', 7)} | "
        f"{row['tcp_rt']['latency_us']:>6.1f} {row['ctl_rt']['latency_us']:>6.1f}"
    )


def _print_verdicts(result: dict[str, Any]) -> None:
    if result["vllm_not_driven"]:
        print(f"vLLM NixlTransport: not driven ({result['vllm_not_driven']})")
    targets = result["targets"]
    rt = targets["round_trip"]
    print(
        f"control-plane round trip {rt['p2p_kv_us']:.0f} us, "
        f"{rt['x_tcp']:.2f}x a bare TCP socket's ({rt['tcp_us']:.0f} us; "
        f"target <= {round_trip.TARGET_X}x): {met(rt['ok'])}"
    )
    # The path between hosts (NIXL) first; the same-host copy beside it.
    for name, label in (
        ("n_submit", "NIXL read submit->result (vs raw READ)"),
        ("n_e2e", "NIXL read lookup->result (vs raw READ)"),
        ("n_dp", "NIXL read data plane alone, post->completion (vs raw READ)"),
        ("i_submit", "NIXL read in place submit->result (vs raw READ)"),
        ("w_submit", "write path submit->result (vs raw WRITE)"),
        ("submit", "same-host read submit->result (vs raw READ)"),
        ("e2e", "same-host read lookup->result (vs raw READ)"),
        ("dp", "same-host read data plane alone (vs raw READ)"),
        ("pd_submit", "disaggregated prefill submit->result (vs raw READ)"),
    ):
        v = targets[name]
        if v["min_ratio_big"] is not None:
            print(
                f"{label}: >=16 MiB min {v['min_ratio_big']:.2f}x raw NIXL "
                f"(target >= {TARGET_RATIO}x): {met(v['throughput_ok'])}"
            )
        if v["max_latency_x_small"] is not None:
            print(
                f"{label}: <=1 MiB latency up to {v['max_latency_x_small']:.1f}x raw "
                f"NIXL (target <= {TARGET_LATENCY_X}x): "
                f"{met(v['latency_ok'])}"
            )
        if v.get("max_latency_x_floor_one_block") is not None:
            print(
                f"{label}: one-block fetches up to "
                f"{v['max_latency_x_floor_one_block']:.2f}x raw READ + one bare TCP "
                f"round trip (target <= {TARGET_FLOOR_X}x): "
                f"{met(v['one_block_ok'])}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--quick", action="store_true", help="a subset of cells")
    parser.add_argument("--repeats", type=int, default=0, help="repeats per round")
    parser.add_argument(
        "--rounds", type=int, default=0, help="interleaved rounds per cell"
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="consumer and producers in two network namespaces (needs root "
        "and iproute2): UCX over TCP across a veth pair, as between hosts",
    )
    args = parser.parse_args(argv)
    if args.netns and not os.environ.get(PRODUCER_NETNS_ENV):
        return between_namespaces(
            "benchmarks.transfer", list(sys.argv[1:] if argv is None else argv)
        )
    cells = list(QUICK) if args.quick else [(b, n) for b in SIZES for n in COUNTS]
    base = args.repeats or (8 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 3)
    if args.json:
        result = run(
            cells,
            base,
            rounds,
            lambda row: print(_line(row), file=sys.stderr, flush=True),
        )
        print(json.dumps(result, indent=2))
        return 0
    print("GB/s (median); us = median latency; x raw = GB/s ratio to raw NIXL")
    print("sub = submit_load->result, e2e = lookup->result; read path (same-host")
    print("copy) and NIXL read path (staged; in place: no staging) vs raw READ,")
    print("write path (reads off) vs raw WRITE; pd = disaggregated prefill")
    print("(Fetch, offer of the parked stores, READ) vs raw READ;")
    print("dp = the read's data plane alone (post_read -> completion), us")
    print("tcp rt / ctl rt = a bare TCP socket's / p2p_kv's control-plane round")
    print("trip between two idle processes (benchmarks/round_trip.py), us")
    if os.environ.get(PRODUCER_NETNS_ENV):
        print("between network namespaces: UCX over TCP on a veth pair, the")
        print("producer at " + producer_host() + " (read and pd: the same-host")
        print("shortcut still applies, both ends being on this machine)")
    print(HEADER, flush=True)
    result = run(cells, base, rounds, lambda row: print(_line(row), flush=True))
    _print_verdicts(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
