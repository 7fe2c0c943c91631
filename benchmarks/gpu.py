"""GPU memory through p2p_kv: fetch throughput against the same run's limits.

Two kinds of producer memory, each fetched by a consumer
:class:`StandalonePeer` (this process, its region a CUDA tensor on the
destination GPU) from a producer StandalonePeer in another process, end to
end: lookup, pin, the NIXL transfer, job result:

* ``vram``: the producer's region is a CUDA tensor on the source GPU
  (GPU to GPU; UCX moves it with cuda_ipc over NVLink);
* ``dram``: the producer's region is host memory in a shared file (as a
  CPU-offloading vLLM engine's primary tier is): host to GPU.

Each path is measured against, in the same run on the same bytes:

* the physical limit: torch copying the fetch's bytes in one copy
  (``vram``: GPU to GPU; ``dram``: pinned host to GPU), and torch copying
  the same runs one copy each;
* raw NIXL between two processes with the same memory kinds and the same
  coalesced descriptors (``benchmarks/raw_nixl.py``'s agent setup), so the
  gap to it is p2p_kv's own overhead;
* for ``dram`` only, what staging would give: raw NIXL host to *pinned
  host* in the consumer process, then a pinned host-to-GPU copy of the same
  runs (the two medians added: no overlap assumed).

Two block layouts: ``scattered`` (destinations in every other slot, so one
descriptor per block: the worst case) and ``contiguous`` (one descriptor).
Every path's destination bytes are checked byte for byte against a
position-dependent pattern before timing.

Three p2p_kv data paths: ``read`` (the default: the consumer READs the
pinned blocks one-sided; from a same-host peer's shared host region it
copies them itself, a DMA from CUDA-registered pages), ``nixl_read`` (every
READ through NIXL) and ``write`` (the producer WRITEs after a Fetch). Both
processes timestamp
a load's events (message received, post, completion, send) on the shared
monotonic clock, so the output says where a load's time goes, leg by leg.

Run on the GPU machine: ``python -m benchmarks.gpu [--quick] [--json-out F]``
from the checkout (or ``p2p-kv bench gpu``);
``--no-cuda`` runs the same code with CPU tensors (a smoke test of the
harness, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# NVLink multicast can take a shared host's GPUs out of service: keep it off
# in every process this script starts (children inherit the environment).
for _var, _val in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_var, _val)

from benchmarks.gpu_memory import (  # noqa: E402
    clear,
    empty_cache,
    fill,
    make_region,
    mapping,
    measure_limits,
    set_device,
    summary_of,
    sync,
    torch_module,
    wrong_blocks,
)
from benchmarks.harness import (  # noqa: E402
    KIB,
    MIB,
    FetchPair,
    ProducerProcess,
    WorkerPair,
    bench_peer,
    block_label,
    block_runs,
    median_round,
    met,
    serve_blocks,
    serve_commands,
)

if TYPE_CHECKING:
    from p2p_kv.runtime.standalone import StandalonePeer

SIZES = (64 * KIB, 256 * KIB, 2 * MIB)
COUNTS = (1, 16, 256)
QUICK = ((64 * KIB, 1), (64 * KIB, 16), (2 * MIB, 16))
# "Large fetch", where the throughput target applies: 512 MiB is 1.4 ms at
# NVLink speed, the smallest fetch that a control-plane round trip of a few
# hundred microseconds could still leave at 0.8x.
BIG_BYTES = 256 * MIB
TARGET_RATIO = 0.8
_TIMEOUT_S = 240.0
_FETCH_TIMEOUT_S = 120.0


# ---------------------------------------------------------------------------
# Raw NIXL: two worker processes with the same memory kinds and descriptors
# ---------------------------------------------------------------------------


def _raw_worker(conn: Any) -> None:
    """Either role: register a region, WRITE timed (producer), drain
    notifications (consumer), verify, copy staged bytes to the GPU."""
    serve_commands(conn, _raw_handlers)


def _raw_handlers() -> dict[str, Callable[..., Any]]:
    from benchmarks import raw_nixl
    from p2p_kv.data import describe_region

    held: dict[str, Any] = {}  # agent, region, reg, span: one region at a time

    def setup(name: str, kind: str, device: str, nbytes: int, fill_it: bool) -> Any:
        set_device(device)
        region = make_region(kind, nbytes, device)
        if fill_it:
            fill(region, device if kind == "vram" else "cpu")
        agent = raw_nixl._make_agent(name)
        span = describe_region(region)
        reg = agent.register_memory(
            [(span.addr, span.nbytes, span.device_id, "")], span.mem_kind
        )
        held.update(agent=agent, region=region, reg=reg, span=span)
        return agent.get_agent_metadata(), span

    def run(
        remote: str, rspan: Any, bs: int, runs: Any, reps: int, stop: bytes
    ) -> list[float]:
        agent, span = held["agent"], held["span"]
        seconds = raw_nixl.timed_transfers(
            agent,
            (span.addr, span.device_id, span.mem_kind),
            remote,
            (rspan.addr, rspan.device_id, rspan.mem_kind),
            bs,
            runs,
            reps,
            "WRITE",
            timeout_s=_TIMEOUT_S / 2,
        )
        agent.send_notif(remote, stop)
        return list(seconds)

    def serve(stop: bytes) -> None:
        agent = held["agent"]
        while not any(stop in v for v in agent.get_new_notifs().values()):
            time.sleep(0.0005)

    def verify(bs: int, src: Any, dst: Any) -> Any:
        sync()
        return wrong_blocks(held["region"], bs, src, dst)

    def clear_blocks(bs: int, dst: Any) -> None:
        clear(held["region"], bs, dst)
        sync()

    def h2d(bs: int, runs: Any, device: str, reps: int) -> list[float]:
        # Staging's second half: pinned host -> GPU, the same runs.
        region = held["region"]
        torch = torch_module()
        gpu = torch.empty(region.numel(), dtype=torch.uint8, device=device)
        seconds = []
        for i in range(reps + 2):
            sync()
            t0 = time.perf_counter()
            for _s, d, c in runs:
                gpu[d * bs : (d + c) * bs].copy_(
                    region[d * bs : (d + c) * bs], non_blocking=True
                )
            sync()
            if i >= 2:
                seconds.append(time.perf_counter() - t0)
        del gpu
        return seconds

    def teardown() -> None:
        if held.get("agent") is not None:
            held["agent"].deregister_memory(held["reg"])
        held.clear()
        empty_cache()

    return {
        "setup": setup,
        "peer": lambda md: held["agent"].add_remote_agent(md),
        "run": run,
        "serve": serve,
        "verify": verify,
        "clear": clear_blocks,
        "h2d": h2d,
        "teardown": teardown,
    }


class RawGpuPair(WorkerPair):
    """Raw NIXL writer and receiver, any memory kinds."""

    name = "raw NIXL GPU worker"

    def __init__(self) -> None:
        super().__init__((_raw_worker, _raw_worker), _TIMEOUT_S)

    def measure(
        self,
        src: tuple[str, str],
        dst: tuple[str, str],
        bs: int,
        n: int,
        layout: str,
        reps: int,
        staged_to: str | None = None,
    ) -> dict[str, Any]:
        """``src``/``dst`` are ``(kind, device)``; with ``staged_to`` the
        receiver also times copying the written runs to that GPU."""
        src_blocks, dst_blocks = mapping(layout, n)
        runs = block_runs(src_blocks, dst_blocks)
        self._cell += 1
        tag = f"{os.getpid()}-{self._cell}"
        p_md, _ = self._call(0, "setup", f"rawg-p-{tag}", src[0], src[1], n * bs, True)
        c_md, c_span = self._call(
            1,
            "setup",
            f"rawg-c-{tag}",
            dst[0],
            dst[1],
            (max(dst_blocks) + 1) * bs,
            False,
        )
        try:
            remote = self._call(0, "peer", c_md)
            self._call(1, "peer", p_md)
            stop = f"stop-{tag}".encode()
            self._conns[1].send(("serve", stop))
            seconds = self._call(0, "run", remote, c_span, bs, runs, reps, stop)
            self._reply(1)
            bad = self._call(1, "verify", bs, src_blocks, dst_blocks)
            if bad:
                raise AssertionError(f"raw NIXL: {bad} of {n} blocks hold wrong bytes")
            out = summary_of(seconds, n * bs)
            out["descriptors"] = len(runs)
            out["verified"] = True
            if staged_to is not None:
                h2d = self._call(1, "h2d", bs, runs, staged_to, reps)
                w, h = statistics.median(seconds), statistics.median(h2d)
                out["staged"] = {
                    "gbps": n * bs / (w + h) / 1e9,
                    "latency_us": (w + h) * 1e6,
                    "h2d_gbps": n * bs / h / 1e9,
                }
            return out
        finally:
            self._call(0, "teardown")
            self._call(1, "teardown")


# ---------------------------------------------------------------------------
# p2p_kv end to end: a producer StandalonePeer in a process, a consumer here
# ---------------------------------------------------------------------------


def _p2p_producer(
    kind: str,
    device: str,
    bs: int,
    num_blocks: int,
    trace_conn: Any,
    path: str,
    out: Any,
    stop: Any,
) -> None:
    traced: list[list[tuple[str, float]]] = []

    def start() -> tuple[StandalonePeer, tuple[Any, ...]]:
        set_device(device)
        region = make_region(kind, num_blocks * bs, device)
        fill(region, device if kind == "vram" else "cpu")
        sync()
        peer = bench_peer(num_blocks, bs, f"gpu-prod-{os.getpid()}", path, region)
        traced.append(trace_peer(peer, "p"))
        return peer, (peer.address, peer.runtime.data.local_region().mem_kind)

    def answer_trace(peer: StandalonePeer) -> None:
        if trace_conn.poll():
            trace_conn.recv()
            trace_conn.send(list(traced[0]))
            traced[0].clear()

    serve_blocks(out, stop, start, answer_trace, max_s=float("inf"))


def _wrap(obj: Any, method: str, record: Any) -> None:
    """Call ``record(t_start, t_end, args, result)`` around a bound method."""
    inner = getattr(obj, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        res = inner(*args, **kwargs)
        record(t0, time.perf_counter(), args, res)
        return res

    setattr(obj, method, wrapper)


def trace_peer(peer: Any, role: str) -> list[tuple[str, float]]:
    """Timestamp what a load passes through in this process (role ``p``:
    producer, ``c``: consumer), on either data path: the producer WRITEs
    after a Fetch, or the consumer READs the pinned blocks itself.

    ``perf_counter`` is CLOCK_MONOTONIC, shared by both processes, so the
    two processes' events line up on one time axis.
    """
    events: list[tuple[str, float]] = []
    rt = peer.runtime

    def on_message(t0: float, t1: float, args: Any, res: Any) -> None:
        name = type(args[2]).__name__  # (peer, session, message, now)
        if name in ("Fetch", "TransferDone", "LookupResp"):
            events.append((f"{role}.rx_{name}", t0))

    def post(t0: float, t1: float, args: Any, res: Any) -> None:
        events.extend(((f"{role}.post_start", t0), (f"{role}.post_end", t1)))

    def done(t0: float, t1: float, args: Any, res: Any) -> None:
        if res:
            events.append((f"{role}.xfer_done", t1))

    # Each decoded message reaches the manager's one dispatch, past
    # receive_frame's opening of the frame.
    _wrap(rt.manager, "_on_message", on_message)
    for method in ("post_write", "post_read"):
        _wrap(rt.data, method, post)
    _wrap(rt.data, "poll_completions", done)
    _wrap(rt.control, "send", lambda t0, t1, a, r: events.append((f"{role}.send", t0)))
    return events


# The checkpoints a load can pass, in order; a path skips those it has not
# (a READ has no Fetch, a WRITE no consumer post).
CHECKPOINTS = (
    "submit",
    "p.rx_Fetch",
    "p.post_start",
    "p.post_end",
    "p.xfer_done",
    "p.send",
    "c.rx_TransferDone",
    "c.post_start",
    "c.post_end",
    "c.xfer_done",
    "result",
)


def phases(
    windows: list[tuple[float, float]],
    producer: list[tuple[str, float]],
    consumer: list[tuple[str, float]],
) -> dict[str, float]:
    """Median microseconds between consecutive checkpoints of each load
    (submit_load -> result), from the first event of each kind inside its
    window; a producer ``send`` counts only after its transfer is done."""
    legs: dict[str, list[float]] = {}
    merged = sorted(producer + consumer, key=lambda e: e[1])
    for t_sub, t_end in windows:
        at: dict[str, float] = {"submit": t_sub, "result": t_end}
        for name, t in merged:
            if not t_sub <= t <= t_end or name in at:
                continue
            if name == "p.send" and "p.xfer_done" not in at:
                continue
            at[name] = t
        seen = [c for c in CHECKPOINTS if c in at]
        for a, b in itertools.pairwise(seen):
            legs.setdefault(f"{a}->{b}", []).append((at[b] - at[a]) * 1e6)
    return {k: round(statistics.median(v), 1) for k, v in legs.items()}


#: ``read``: the consumer READs the pinned blocks one-sided after the
#: lookup; ``write``: reads off, the producer WRITEs after a Fetch.
#: read: the READ path as configured by default (a same-host peer's host
#: region is copied straight out of its shared file); nixl_read: READs
#: through NIXL only (``same_host_copy: false``); write: Fetch + WRITE.
PATHS = ("read", "nixl_read", "nixl_read_in_place", "write")


class P2PGpuPair(FetchPair):
    """Producer StandalonePeer (``kind`` memory) in a process; consumer
    StandalonePeer here over a tensor on ``dst_dev``."""

    def __init__(
        self,
        kind: str,
        src_dev: str,
        dst_dev: str,
        bs: int,
        max_blocks: int,
        path: str = "write",
    ) -> None:
        self.path = path
        self._trace, child = mp.get_context("spawn").Pipe()
        producer = ProducerProcess(
            _p2p_producer,
            kind,
            src_dev,
            bs,
            max_blocks,
            child,
            path,
            timeout_s=_TIMEOUT_S,
        )
        self.producer_mem = producer.ready[1]
        set_device(dst_dev)
        self.region = make_region(
            "vram" if dst_dev != "cpu" else "pinned", 2 * max_blocks * bs, dst_dev
        )
        consumer = bench_peer(
            2 * max_blocks, bs, f"gpu-cons-{os.getpid()}", path, self.region
        )
        super().__init__(producer, {path: consumer}, bs)
        self.consumer = consumer
        self.consumer_mem = consumer.runtime.data.local_region().mem_kind
        self._events = trace_peer(consumer, "c")
        self._windows: list[tuple[float, float]] = []

    def request(self, path: str, n: int) -> tuple[str, dict[str, Any]]:
        return f"gpu-{self._n}", {"timeout_s": _FETCH_TIMEOUT_S}

    def fetched(self, t0: float, out: Any) -> None:
        # fetch() starts its clock a moment after t0: the submit time is
        # early by that moment (a microsecond), never late.
        self._windows.append((t0 + out.lookup_s, t0 + out.total_s))

    def clear(self, path: str, dst: list[int]) -> None:
        clear(self.region, self.block_bytes, dst)
        sync()

    def check(self, path: str, src: list[int], dst: list[int]) -> None:
        sync()
        bad = wrong_blocks(self.region, self.block_bytes, src, dst)
        if bad:
            raise AssertionError(f"p2p_kv: {bad} of {len(src)} blocks hold wrong bytes")

    def warmed_up(self, path: str) -> None:
        self._phases()  # drop the warm-ups' events

    def _phases(self) -> dict[str, float]:
        self._trace.send("trace")
        if not self._trace.poll(_TIMEOUT_S):
            raise TimeoutError("p2p_kv producer sent no trace")
        producer = self._trace.recv()
        out = phases(self._windows, producer, self._events)
        self._windows.clear()
        self._events.clear()
        return out

    def measure(self, n: int, layout: str, reps: int, verify: bool) -> dict[str, Any]:
        src, dst = mapping(layout, n)
        total, submit = self.timed_fetches(self.path, src, dst, reps, verify)
        return {
            "e2e": summary_of(total, n * self.block_bytes),
            "submit": summary_of(submit, n * self.block_bytes),
            "phases_us": self._phases(),
            "verified": verify,
        }

    def close(self) -> None:
        super().close()
        self.region = None
        empty_cache()


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------


def _repeats(nbytes: int, mode: str, base: int) -> int:
    if mode == "dram" and nbytes > 16 * MIB:
        return 3  # UCX's host<->GPU path runs at about 1 GB/s
    return base


def run_mode(
    mode: str,
    layouts: Sequence[str],
    cells: Sequence[tuple[int, int]],
    devices: tuple[str, str],
    raw: RawGpuPair,
    base_reps: int,
    rounds: int,
    paths: Sequence[str],
    progress: Any,
) -> list[dict[str, Any]]:
    src_dev, dst_dev = devices
    kind = "vram" if mode == "vram" and src_dev != "cpu" else "dram"
    if mode == "vram" and src_dev == "cpu":
        kind = "pinned"  # --no-cuda: a CPU tensor stands in for the GPU
    dst_kind = "vram" if dst_dev != "cpu" else "pinned"
    rows: list[dict[str, Any]] = []
    for bs in dict.fromkeys(b for b, _ in cells):
        counts = [n for b, n in cells if b == bs]
        # One producer per path and block size serves every layout and count.
        with contextlib.ExitStack() as stack:
            pairs = {
                path: stack.enter_context(
                    P2PGpuPair(kind, src_dev, dst_dev, bs, max(counts), path)
                )
                for path in paths
            }
            for layout in layouts:
                for n in counts:
                    if layout == "contiguous" and n == 1:
                        continue  # the same single descriptor as scattered
                    row = _cell(
                        mode,
                        layout,
                        kind,
                        dst_kind,
                        devices,
                        raw,
                        pairs,
                        bs,
                        n,
                        base_reps,
                        rounds,
                    )
                    rows.append(row)
                    progress(row)
    return rows


def _cell(
    mode: str,
    layout: str,
    kind: str,
    dst_kind: str,
    devices: tuple[str, str],
    raw: RawGpuPair,
    pairs: dict[str, P2PGpuPair],
    bs: int,
    n: int,
    base_reps: int,
    rounds: int,
) -> dict[str, Any]:
    """One table row: every path ``rounds`` times, interleaved, so the
    machine's noise falls on all of them alike; each reports its median
    round (by GB/s)."""
    src_dev, dst_dev = devices
    reps = _repeats(bs * n, mode, base_reps)
    r_rounds = 1 if mode == "dram" and bs * n > 16 * MIB else rounds
    samples: dict[str, list[dict[str, Any]]] = {
        k: [] for k in ("limit", "torch_runs", "raw")
    }
    staged: dict[str, Any] | None = None
    phase_rounds: dict[str, list[dict[str, float]]] = {p: [] for p in pairs}
    errors: dict[str, str] = {}
    for r in range(r_rounds):
        with contextlib.ExitStack() as idle:
            for pair in pairs.values():
                idle.enter_context(pair.idle())
            lim = measure_limits(mode, src_dev, dst_dev, bs, n, layout, max(reps, 10))
            samples["limit"].append(lim["limit"])
            samples["torch_runs"].append(lim["torch_runs"])
            samples["raw"].append(
                raw.measure((kind, src_dev), (dst_kind, dst_dev), bs, n, layout, reps)
            )
            if mode == "dram" and r == 0 and dst_dev != "cpu":
                staged = raw.measure(
                    (kind, src_dev),
                    ("pinned", dst_dev),
                    bs,
                    n,
                    layout,
                    reps,
                    staged_to=dst_dev,
                )["staged"]
        for path, pair in pairs.items():
            if path in errors:
                continue
            try:
                # The other paths' consumers keep stepping meanwhile: a
                # host->GPU fetch can take seconds, and a consumer silent
                # for longer than the liveness deadline loses its session.
                with contextlib.ExitStack() as idle:
                    for other, o_pair in pairs.items():
                        if other != path:
                            idle.enter_context(o_pair.idle())
                    res = pair.measure(n, layout, reps, verify=r == 0)
            except Exception as exc:
                # Recorded in the row, and the run goes on: one path's
                # failure must not cost the other paths' numbers.
                errors[path] = f"{type(exc).__name__}: {exc}"
                continue
            samples.setdefault(f"{path}_e2e", []).append(res["e2e"])
            samples.setdefault(f"{path}_load", []).append(res["submit"])
            phase_rounds[path].append(res["phases_us"])
    row: dict[str, Any] = {
        "mode": mode,
        "layout": layout,
        "block_bytes": bs,
        "num_blocks": n,
        "bytes": bs * n,
        "descriptors": samples["raw"][0]["descriptors"],
        "repeats": reps,
        "rounds": r_rounds,
        "memory": f"{kind}->{dst_kind}",
        "paths": [p for p in pairs if f"{p}_e2e" in samples],
        "errors": errors,
        "verified": True,
    }
    for name, runs in samples.items():
        row[name] = median_round(runs)
    if staged is not None:
        row["staged"] = staged
        staged["x_limit"] = staged["gbps"] / row["limit"]["gbps"]
    lim_gbps = row["limit"]["gbps"]
    for name in samples:
        if name != "limit":
            row[name]["x_limit"] = row[name]["gbps"] / lim_gbps
        if name.endswith(("_e2e", "_load")):
            row[name]["x_raw"] = row[name]["gbps"] / row["raw"]["gbps"]
    # Each path's legs, from the round whose load time was the median.
    row["phases_us"] = {}
    for path, got in phase_rounds.items():
        if not got:
            continue
        loads = samples[f"{path}_load"]
        order = sorted(range(len(got)), key=lambda i: loads[i]["gbps"])
        row["phases_us"][path] = got[order[(len(order) - 1) // 2]]
    return row


def _verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for layout in dict.fromkeys(r["layout"] for r in rows):
            big = [
                r
                for r in rows
                if r["mode"] == mode
                and r["layout"] == layout
                and r["bytes"] >= BIG_BYTES
            ]
            if not big:
                continue
            v: dict[str, Any] = {
                "min_raw_x_limit_big": min(r["raw"]["x_limit"] for r in big)
            }
            paths = [p for p in big[0]["paths"] if all(p in r["paths"] for r in big)]
            if not paths:
                continue
            for path in paths:
                for leg in ("e2e", "load"):
                    k = f"{path}_{leg}"
                    v[f"min_{k}_x_limit_big"] = min(r[k]["x_limit"] for r in big)
                    v[f"min_{k}_x_raw_big"] = min(r[k]["x_raw"] for r in big)
            best = max(v[f"min_{p}_e2e_x_limit_big"] for p in paths)
            v["best_path_min_e2e_x_limit_big"] = best
            v["target_met"] = best >= TARGET_RATIO
            out[f"{mode}/{layout}"] = v
    return out


def _header(paths: Sequence[str]) -> str:
    cols = "".join(
        f" | {p + ' e2e':>10} {'us':>8} {'x lim':>5} {'x raw':>5}" for p in paths
    )
    return (
        f"{'block':>5} {'n':>4} {'MiB':>6} {'desc':>4} | {'limit':>6} {'t.runs':>6} | "
        f"{'raw':>6} {'x lim':>5}{cols}"
    )


def _line(row: dict[str, Any]) -> str:
    lim, tr, raw = row["limit"], row["torch_runs"], row["raw"]
    line = (
        f"{block_label(row['block_bytes']):>5} {row['num_blocks']:>4} "
        f"{row['bytes'] / MIB:>6.2f} {row['descriptors']:>4} | "
        f"{lim['gbps']:>6.1f} {tr['gbps']:>6.1f} | "
        f"{raw['gbps']:>6.2f} {raw['x_limit']:>5.2f}"
    )
    for path in row["paths"]:
        e2e = row[f"{path}_e2e"]
        line += (
            f" | {e2e['gbps']:>10.2f} {e2e['latency_us']:>8.1f} "
            f"{e2e['x_limit']:>5.2f} {e2e['x_raw']:>5.2f}"
        )
    for path, err in row.get("errors", {}).items():
        line += f" | {path}: FAILED ({err[:120]})"
    if "staged" in row:
        st = row["staged"]
        line += f" | staged {st['gbps']:.2f} ({st['x_limit']:.2f})"
    return line


def _print_tables(result: dict[str, Any]) -> None:
    print(
        "\nGB/s (median of repeats, median round). limit = torch, one copy of "
        "all the bytes (vram: GPU->GPU, dram: pinned host->GPU); t.runs = torch, "
        "one copy per descriptor run; raw = raw NIXL WRITE, same memory and "
        "descriptors; <path> e2e = p2p_kv lookup->result (read: the consumer "
        "READs one-sided, as its own batched copy from a same-host peer's "
        "shared host region, or its GPU region through CUDA IPC for loads of "
        "64 runs or more; nixl_read: every READ through NIXL; write: the "
        "producer WRITEs after a Fetch); x lim / "
        "x raw = GB/s ratio to limit / raw NIXL; staged = raw NIXL host->pinned "
        "host + pinned host->GPU copy, medians added (dram only)"
    )
    rows = result["rows"]
    for mode in ("vram", "dram"):
        for layout in ("scattered", "contiguous"):
            sel = [r for r in rows if r["mode"] == mode and r["layout"] == layout]
            if not sel:
                continue
            print(
                f"\n## {mode} ({sel[0]['memory']}), {layout}\n{_header(sel[0]['paths'])}"
            )
            for r in sel:
                print(_line(r))
    print(
        "\nLoad (submit_load -> result) GB/s and ratio to limit, and where its "
        "time goes (us, median; p = producer, c = consumer, one monotonic clock):"
    )
    for r in rows:
        for path, legs in r["phases_us"].items():
            load = r[f"{path}_load"]
            print(
                f"{r['mode']}/{r['layout'][:4]} {block_label(r['block_bytes'])} x "
                f"{r['num_blocks']} {path}: {load['gbps']:.2f} GB/s "
                f"({load['x_limit']:.2f} lim), "
                + ", ".join(f"{k} {v:.0f}" for k, v in legs.items())
            )
    for key, v in result["targets"].items():
        per = ", ".join(
            f"{k[4:-12]} {x:.2f}x"
            for k, x in v.items()
            if k.startswith("min_") and k.endswith("_x_limit_big")
        )
        print(
            f"{key}: fetches >= {BIG_BYTES // MIB} MiB, min ratio to limit: {per}; "
            f"target >= {TARGET_RATIO}x (best p2p_kv path, e2e): "
            f"{met(v['target_met'])}"
        )


def _environment(devices: tuple[str, str]) -> dict[str, Any]:
    torch = torch_module()
    env: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "devices": list(devices),
    }
    if torch.cuda.is_available():
        env["gpus"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
        if torch.cuda.device_count() > 1:
            env["peer_access_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))
    with contextlib.suppress(Exception):
        import importlib.metadata as md

        env["nixl"] = md.version("nixl")
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small cells")
    parser.add_argument(
        "--no-cuda",
        action="store_true",
        help="CPU tensors in place of GPU memory: checks the harness only",
    )
    parser.add_argument("--modes", default="vram,dram")
    parser.add_argument("--layouts", default="scattered,contiguous")
    parser.add_argument(
        "--paths",
        default="read,nixl_read,write",
        help="p2p_kv data paths (those it has)",
    )
    parser.add_argument("--sizes-kib", default="", help="e.g. 64,2048")
    parser.add_argument("--counts", default="", help="e.g. 1,16,256")
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--json-out", default="", help="write the full results here")
    args = parser.parse_args(argv)

    torch = torch_module()
    if args.no_cuda:
        devices = ("cpu", "cpu")
    elif not torch.cuda.is_available():
        print("gpu.py: no CUDA device here (use --no-cuda for a harness check)")
        return 2
    else:
        last = min(1, torch.cuda.device_count() - 1)
        devices = ("cuda:0", f"cuda:{last}")
    sizes = [int(s) * KIB for s in args.sizes_kib.split(",") if s] or list(SIZES)
    counts = [int(c) for c in args.counts.split(",") if c] or list(COUNTS)
    cells = list(QUICK) if args.quick else [(b, n) for b in sizes for n in counts]
    base = args.repeats or (5 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 3)
    paths = [p for p in args.paths.split(",") if p in PATHS]
    result: dict[str, Any] = {"environment": _environment(devices), "rows": []}
    print(f"devices {devices[0]} -> {devices[1]}; {_header(paths)}", flush=True)

    def progress(row: dict[str, Any]) -> None:
        print(f"{row['mode']:>4} {row['layout'][:4]} {_line(row)}", flush=True)
        result["rows"].append(row)
        if args.json_out:  # after every row: a run cut short keeps its rows
            Path(args.json_out).write_text(json.dumps(result, indent=2))

    try:
        with RawGpuPair() as raw:
            for mode in args.modes.split(","):
                run_mode(
                    mode,
                    args.layouts.split(","),
                    cells,
                    devices,
                    raw,
                    base,
                    rounds,
                    paths,
                    progress,
                )
    finally:
        result["targets"] = _verdicts(result["rows"])
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=2))
    _print_tables(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
