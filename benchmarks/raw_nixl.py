"""Same-run baselines for the data plane: raw NIXL WRITEs and a plain memcpy.

``benchmarks/transfer.py`` compares our :class:`p2p_kv.data.NixlDataTransport`
against these two numbers taken on the same machine in the same run, because
this kind of machine is noisy (up to 2x between runs) and a baseline from
another day means little:

* :func:`measure_raw_nixl` - two processes, NIXL used directly with the
  same setup as the transport (no progress thread, receiver polling, the
  same error-handling choice) and the *same coalesced descriptors*
  ``post_write`` would build, so the gap to it is our own overhead.
* :func:`measure_memcpy` - one thread copying the same scattered blocks
  with numpy inside one process: what the bytes cost without any transport.

Both move bytes between memfd-backed buffers, the memory p2p_kv's regions
live in (:func:`shared_buffer` says why).

Run ``p2p-kv bench raw_nixl`` (or ``python -m benchmarks.raw_nixl`` from
the checkout) for a small table.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import traceback
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.harness import (
    KIB,
    MIB,
    WorkerPair,
    block_runs,
    enter_producer_netns,
    scattered_mapping,
)

_STEP_TIMEOUT_S = 120.0
# How often the receiving process drains notifications while a cell runs.
# With UCX error handling "none" (the transport's default) WRITEs complete
# without the receiver, so this only shapes how busy the receiver looks;
# with "peer" each WRITE would wait for the next poll.
DEFAULT_CONSUMER_POLL_S = 0.001


def _summary(
    block_bytes: int, num_blocks: int, seconds: list[float], descriptors: int
) -> dict[str, Any]:
    nbytes = block_bytes * num_blocks
    med = statistics.median(seconds)
    ordered = sorted(seconds)
    return {
        "block_bytes": block_bytes,
        "num_blocks": num_blocks,
        "repeats": len(seconds),
        "descriptors": descriptors,
        "bytes": nbytes,
        "gbps": nbytes / med / 1e9,
        "gbps_best": nbytes / ordered[0] / 1e9,
        "latency_us": med * 1e6,
        "latency_us_min": ordered[0] * 1e6,
        "latency_us_p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e6,
    }


# ---------------------------------------------------------------------------
# memcpy baseline
# ---------------------------------------------------------------------------


def measure_memcpy(
    block_bytes: int,
    num_blocks: int,
    repeats: int,
    src_blocks: Sequence[int] | None = None,
    dst_blocks: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One thread copying the mapping's runs with numpy, in one process."""
    if src_blocks is None or dst_blocks is None:
        src_blocks, dst_blocks = scattered_mapping(num_blocks)
    runs = block_runs(src_blocks, dst_blocks)
    src = shared_buffer((max(src_blocks) + 1) * block_bytes, 1)
    dst = shared_buffer((max(dst_blocks) + 1) * block_bytes, None)
    bb = block_bytes
    views = [
        (dst[d * bb : (d + c) * bb], src[s * bb : (s + c) * bb]) for s, d, c in runs
    ]
    for to, frm in views:  # warm-up
        np.copyto(to, frm)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for to, frm in views:
            np.copyto(to, frm)
        seconds.append(time.perf_counter() - t0)
    return _summary(block_bytes, num_blocks, seconds, len(runs))


# ---------------------------------------------------------------------------
# raw NIXL baseline: two processes
# ---------------------------------------------------------------------------


def _make_agent(name: str) -> Any:
    """A NIXL agent configured exactly like NixlDataTransport's."""
    from nixl._api import nixl_agent, nixl_agent_config

    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    agent = nixl_agent(
        name,
        nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[]
        ),
    )
    from p2p_kv import data

    mode = data.check_ucx_error_handling_mode(
        data.DEFAULT_UCX_ERROR_HANDLING_MODE, os.environ.get("UCX_TLS")
    )
    agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
    return agent


def shared_buffer(nbytes: int, rng_seed: int | None) -> np.ndarray[Any, Any]:
    """Bytes in a memfd, as p2p_kv's regions are (and vLLM's CPU tier, a
    ``/dev/shm`` file): numpy's own large arrays get transparent huge
    pages, on which the kernel's copies (CMA, ``preadv``) ran about 2x
    faster here (7.1 against 3.1 GB/s), so a baseline on them would
    compare unlike memory. Every page is written before timing."""
    from p2p_kv.runtime.standalone import shared_region

    buf: np.ndarray[Any, Any] = shared_region(nbytes)
    if rng_seed is None:
        buf[:] = 1
    else:
        buf[:] = np.random.default_rng(rng_seed).integers(
            0, 256, size=nbytes, dtype=np.uint8
        )
    return buf


def _region(
    agent: Any, nbytes: int, rng_seed: int | None
) -> tuple[np.ndarray[Any, Any], Any]:
    buf = shared_buffer(nbytes, rng_seed)
    reg = agent.register_memory([(int(buf.ctypes.data), nbytes, 0, "")], "DRAM")
    return buf, reg


def _producer_worker(conn: Any) -> None:
    """The producer's worker: in the producers' namespace, if one is set."""
    enter_producer_netns()
    _worker(conn)


def _worker(conn: Any) -> None:
    """Either side of a raw NIXL pair, as told: register a memfd region,
    READ the peer's blocks (the consumer: the producer's process does
    nothing, as on p2p_kv's read path), WRITE into the peer's (the
    producer), drain notifications until a stop word, verify."""
    agent: Any = None
    buf: Any = None
    reg: Any = None
    try:
        while True:
            cmd, *args = conn.recv()
            out: Any = None
            if cmd == "exit":
                conn.send(("ok", None))
                return
            if cmd == "setup":
                name, nbytes, block_bytes, seed = args
                agent = _make_agent(name)
                buf, reg = _region(agent, nbytes, seed)
                rows = buf.reshape(-1, block_bytes)
                crcs = [] if seed is None else [zlib.crc32(r.data) for r in rows]
                out = (agent.get_agent_metadata(), int(buf.ctypes.data), crcs)
            elif cmd == "peer":
                out = agent.add_remote_agent(args[0])
            elif cmd in ("read", "write"):
                remote, remote_base, block_bytes, runs, repeats, stop = args
                out = timed_transfers(
                    agent,
                    (int(buf.ctypes.data), 0, "DRAM"),
                    remote,
                    (remote_base, 0, "DRAM"),
                    block_bytes,
                    runs,
                    repeats,
                    cmd.upper(),
                )
                if stop:
                    agent.send_notif(remote, stop)
            elif cmd == "serve":
                # Poll like a consumer expecting data: regularly, sleeping.
                stop, poll_s = args
                while not any(stop in v for v in agent.get_new_notifs().values()):
                    if poll_s > 0:
                        time.sleep(poll_s)
            elif cmd == "verify":
                block_bytes, dst, want = args
                rows = buf.reshape(-1, block_bytes)
                out = [zlib.crc32(rows[d].data) for d in dst] == want
            elif cmd == "teardown":
                if agent is not None:
                    agent.deregister_memory(reg)
                agent = buf = reg = None
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
    except BaseException:
        conn.send(("err", traceback.format_exc()))


#: Where a worker's blocks are: (base address, device id, NIXL memory kind).
Place = tuple[int, int, str]


def remote_progress() -> bool:
    """Whether a READ needs its producer's progress: UCX over TCP only
    (``UCX_TLS`` naming tcp and no shared-memory transport) emulates a
    READ with messages the producer's worker must answer; CMA and RDMA
    READs are one-sided. A raw READ's producer then polls without pause,
    the best case, instead of sitting idle."""
    tls = os.environ.get("UCX_TLS", "")
    names = {t.strip().lstrip("^") for t in tls.split(",")}
    return "tcp" in names and not names & {"sm", "cma", "posix", "shm", "all"}


def timed_transfers(
    agent: Any,
    local: Place,
    remote_agent: Any,
    remote: Place,
    block_bytes: int,
    runs: list[tuple[int, int, int]],
    repeats: int,
    op: str,
    timeout_s: float = _STEP_TIMEOUT_S,
) -> list[float]:
    """Post ``op`` over ``runs`` (local start, remote start, count) and time
    each transfer from post to DONE: the NIXL calls ``post_write`` /
    ``post_read`` and ``poll_completions`` make, for any memory kinds."""
    from p2p_kv import data

    starts = np.array([r[0] for r in runs], dtype=np.int64)
    dsts = np.array([r[1] for r in runs], dtype=np.int64)
    counts = np.array([r[2] for r in runs], dtype=np.int64)
    local_descs = agent.get_xfer_descs(
        data.build_descs(local[0], block_bytes, local[1], starts, counts), local[2]
    )
    remote_descs = agent.get_xfer_descs(
        data.build_descs(remote[0], block_bytes, remote[1], dsts, counts), remote[2]
    )
    seconds: list[float] = []
    for i in range(repeats + 2):  # two warm-ups: connection wire-up, caches
        t0 = time.perf_counter()
        notif = b"x" if op == "WRITE" else b""
        handle = agent.initialize_xfer(
            op, local_descs, remote_descs, remote_agent, notif
        )
        state = agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        while state == "PROC":
            state = agent.check_xfer_state(handle)
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw NIXL {op} did not complete")
        elapsed = time.perf_counter() - t0
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {op} ended in state {state}")
        if i >= 2:
            seconds.append(elapsed)
    return seconds


class RawNixlPair(WorkerPair):
    """Raw NIXL: a producer that WRITEs and a consumer that polls, or a
    consumer that READs from an idle producer (``op="READ"``)."""

    def __init__(self) -> None:
        super().__init__((_producer_worker, _worker), _STEP_TIMEOUT_S + 60)

    def measure(
        self,
        block_bytes: int,
        num_blocks: int,
        repeats: int,
        src_blocks: Sequence[int] | None = None,
        dst_blocks: Sequence[int] | None = None,
        consumer_poll_s: float = DEFAULT_CONSUMER_POLL_S,
        op: str = "WRITE",
    ) -> dict[str, Any]:
        if src_blocks is None or dst_blocks is None:
            src_blocks, dst_blocks = scattered_mapping(num_blocks)
        runs = block_runs(src_blocks, dst_blocks)
        self._cell += 1
        tag = f"{os.getpid()}-{self._cell}"
        p_md, p_base, crcs = self._call(
            0,
            "setup",
            f"raw-prod-{tag}",
            (max(src_blocks) + 1) * block_bytes,
            block_bytes,
            7,
        )
        c_md, c_base, _ = self._call(
            1,
            "setup",
            f"raw-cons-{tag}",
            (max(dst_blocks) + 1) * block_bytes,
            block_bytes,
            None,
        )
        remote = self._call(0, "peer", c_md)
        producer = self._call(1, "peer", p_md)
        if op == "READ":
            back = [(d, s, n) for s, d, n in runs]
            stop = f"stop-{tag}".encode() if remote_progress() else b""
            if stop:
                # Over TCP the producer's progress answers the READ: it
                # polls every 100 us (spinning, it and the READer took both
                # cores here and starved every other process).
                self._conns[0].send(("serve", stop, 1e-4))
            seconds = self._call(
                1, "read", producer, p_base, block_bytes, back, repeats, stop
            )
            if stop:
                self._reply(0)
        else:
            stop = f"stop-{tag}".encode()
            self._conns[1].send(("serve", stop, consumer_poll_s))
            seconds = self._call(
                0, "write", remote, c_base, block_bytes, runs, repeats, stop
            )
            self._reply(1)
        ok = self._call(
            1, "verify", block_bytes, list(dst_blocks), [crcs[s] for s in src_blocks]
        )
        self._call(0, "teardown")
        self._call(1, "teardown")
        if not ok:
            raise AssertionError(
                "raw NIXL benchmark: destination bytes differ from source"
            )
        result = _summary(block_bytes, num_blocks, seconds, len(runs))
        result["verified"] = True
        return result


def measure_raw_nixl(
    block_bytes: int,
    num_blocks: int,
    repeats: int,
    src_blocks: Sequence[int] | None = None,
    dst_blocks: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Median GB/s and latency of raw NIXL WRITEs between two processes.

    Each repeat is one transfer request built from the coalesced
    descriptors (created, posted, polled to DONE, released), the same
    sequence of NIXL calls ``post_write`` + ``poll_completions`` make.
    Destination bytes are verified after the run. Starts two processes;
    use :class:`RawNixlPair` to measure many cells with one pair.
    """
    with RawNixlPair() as pair:
        return pair.measure(block_bytes, num_blocks, repeats, src_blocks, dst_blocks)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", default="64,256,2048")
    parser.add_argument("--blocks", default="1,16,256")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    sizes = [int(s) * KIB for s in args.sizes_kib.split(",")]
    counts = [int(c) for c in args.blocks.split(",")]
    print(
        f"{'block':>8} {'blocks':>6} {'descs':>5} | {'memcpy GB/s':>11} | "
        f"{'NIXL GB/s':>9} {'median us':>10} {'min us':>8} | {'NIXL/memcpy':>11}"
    )
    with RawNixlPair() as pair:
        for bs in sizes:
            for n in counts:
                reps = args.repeats if bs * n <= 64 * MIB else max(5, args.repeats // 4)
                mc = measure_memcpy(bs, n, reps)
                raw = pair.measure(bs, n, reps)
                print(
                    f"{bs // KIB:>6}Ki {n:>6} {raw['descriptors']:>5} | {mc['gbps']:>11.2f} | "
                    f"{raw['gbps']:>9.2f} {raw['latency_us']:>10.1f} "
                    f"{raw['latency_us_min']:>8.1f} | {raw['gbps'] / mc['gbps']:>11.2f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
