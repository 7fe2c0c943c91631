"""What the transfer benchmarks share: peers in two processes, the
producer's serving loop, timing summaries and the verdicts' words.

``transfer`` (host memory), ``gpu`` (GPU memory), ``raw_nixl`` (the raw
NIXL baseline) and ``round_trip`` (the control plane) all measure one
process fetching from another, and all compare a p2p_kv number with a
baseline taken in the same run, on the same mapping of blocks, because
these machines are noisy (up to 2x between runs). One skeleton for all of
them keeps their numbers comparable: a change to how a fetch is timed,
checked or summarised reaches every table at once.

Functions that spawned processes run live in modules imported by name
(``benchmarks.<name>``), never in a script's ``__main__`` alone: see
:mod:`benchmarks`.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2p_kv.runtime.standalone import FetchOutcome, StandalonePeer

KIB = 1024
MIB = 1024 * KIB
#: The shared secret of the peers a benchmark starts, as a fleet runs them
#: (sealed control frames; the write path needs one).
BENCH_SECRET = b"p2p_kv-bench"


#: Set in the process ``bench transfer --netns`` runs inside the consumer's
#: network namespace: every producer process (p2p_kv's, raw NIXL's, the
#: round trips' echoes) enters this namespace and listens on this address,
#: so what a fetch moves crosses a veth pair over TCP, as between hosts.
PRODUCER_NETNS_ENV = "P2P_KV_BENCH_PRODUCER_NETNS"
PRODUCER_HOST_ENV = "P2P_KV_BENCH_PRODUCER_HOST"
_CLONE_NEWNET = 0x40000000


def producer_host() -> str:
    """Where producers listen (and consumers dial)."""
    return os.environ.get(PRODUCER_HOST_ENV, "127.0.0.1")


def between_namespaces(module: str, argv: list[str]) -> int:
    """Run ``python -m module argv`` again inside one network namespace,
    its producers in another (:data:`PRODUCER_NETNS_ENV`), UCX over TCP on
    the veth between them (``tests.support.netns``: a checkout's), as
    between hosts. Its exit status."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.netns import UCX_ENV, Hosts

    root = Path(__file__).resolve().parent.parent
    with Hosts(2) as hosts:
        env = {
            **os.environ,
            **UCX_ENV,
            PRODUCER_NETNS_ENV: hosts.names[0],
            PRODUCER_HOST_ENV: hosts.addrs[0],
        }
        cmd = ["ip", "netns", "exec", hosts.names[1], sys.executable]
        cmd += ["-m", module, *argv]
        return subprocess.run(cmd, env=env, cwd=root, check=False).returncode


def enter_producer_netns() -> None:
    """Move this process (a producer, at its start, before it opens any
    socket or thread) into the producers' namespace, if one is set."""
    name = os.environ.get(PRODUCER_NETNS_ENV)
    if not name:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter network namespace {name}")
    finally:
        os.close(fd)


def in_producer_netns(target: Any, *args: Any) -> Any:
    """A spawned producer's entry: its namespace, then ``target(*args)``."""
    enter_producer_netns()
    return target(*args)


def key(i: int) -> bytes:
    """The key of the producer's block in slot ``i``."""
    from p2p_kv.runtime.standalone import make_key

    return make_key(i)


def scattered_mapping(num_blocks: int) -> tuple[list[int], list[int]]:
    """Source blocks in order, destinations in every other slot.

    No two destinations are adjacent, so nothing coalesces: each block is
    one descriptor, the worst case for the transport and the realistic one
    for a consumer whose free slots are fragmented. The destination region
    therefore needs ``2 * num_blocks`` slots.
    """
    return list(range(num_blocks)), [2 * i for i in range(num_blocks)]


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """p2p_kv's own coalescing, so every baseline moves the same runs as
    p2p_kv does (one descriptor or copy per run)."""
    from p2p_kv.data.plan import coalesce

    return coalesce(src, dst)


def summary(seconds: list[float], nbytes: int) -> dict[str, Any]:
    """Median GB/s and latency of ``seconds``, each moving ``nbytes``."""
    med = statistics.median(seconds)
    return {
        "gbps": nbytes / med / 1e9,
        "latency_us": med * 1e6,
        "latency_us_min": min(seconds) * 1e6,
    }


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median GB/s, and every round's GB/s beside it:
    rounds interleave the paths, so the machine's noise falls on all of
    them alike and each reports its middle round."""
    ordered = sorted(runs, key=lambda x: x["gbps"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["gbps_rounds"] = [round(x["gbps"], 3) for x in runs]
    return out


def block_label(block_bytes: int) -> str:
    """A block size as the tables print it: ``64K``, ``2M``."""
    return f"{block_bytes // KIB}K" if block_bytes < MIB else f"{block_bytes // MIB}M"


def met(ok: bool) -> str:
    """A target's verdict, in the words every table prints."""
    return "met" if ok else "NOT met"


# ---------------------------------------------------------------------------
# p2p_kv peers: the load paths, the producer's loop
# ---------------------------------------------------------------------------


def path_options(path: str) -> dict[str, Any]:
    """A StandalonePeer's options for one p2p_kv load path:

    * ``read`` (the default) and ``pd``: one-sided READs, a same-host
      peer's shared region copied directly;
    * ``nixl_read``: every READ through NIXL, into read staging;
    * ``nixl_read_in_place``: the same with no staging (the READ lands in
      the slots);
    * ``write``: reads off, so the producer WRITEs after a Fetch.
    """
    return {
        "reads": path != "write",
        "same_host": not path.startswith("nixl_read"),
        "read_staging_bytes": 0 if path == "nixl_read_in_place" else 64 * MIB,
    }


def bench_peer(
    num_blocks: int,
    block_bytes: int,
    engine_id: str,
    path: str = "read",
    region: Any = None,
    host: str = "127.0.0.1",
) -> StandalonePeer:
    """A StandalonePeer as the benchmarks run one: the bench secret, the
    options of ``path``, its own shared region unless ``region`` is given."""
    from p2p_kv.runtime.standalone import StandalonePeer

    return StandalonePeer(
        num_blocks,
        block_bytes,
        engine_id=engine_id,
        region=region,
        host=host,
        secret=BENCH_SECRET,
        **path_options(path),
    )


def serve_blocks(
    out: Any,
    stop: Any,
    start: Callable[[], tuple[StandalonePeer, tuple[Any, ...]]],
    each_step: Callable[[StandalonePeer], None] | None = None,
    max_s: float = 3600.0,
) -> None:
    """A producer process's body (for :class:`ProducerProcess`): ``start()``
    builds the peer and what ``ready`` carries, each slot ``i`` is served
    as :func:`key` ``(i)``, then the peer steps (and ``each_step`` runs)
    until ``stop`` is set or ``max_s`` passes. A failure reaches the parent
    as ``("error", traceback)``."""
    try:
        peer, ready = start()
        for slot in range(peer.runtime.data.num_blocks):
            peer.pinner.table[key(slot)] = slot
        out.put(("ready", *ready))
        end = time.monotonic() + max_s
        while not stop.is_set() and time.monotonic() < end:
            peer.step()
            if each_step is not None:
                each_step(peer)
        peer.close()
    except BaseException:
        out.put(("error", traceback.format_exc()))


class ProducerProcess:
    """A p2p_kv producer in a spawned process: ``target(*args, out, stop)``
    puts ``("ready", ...)`` (or ``("error", traceback)``) on ``out``, then
    serves until ``stop`` is set. ``ready`` holds the rest of that message."""

    def __init__(self, target: Any, *args: Any, timeout_s: float = 180.0) -> None:
        ctx = mp.get_context("spawn")
        self._out, self._stop = ctx.Queue(), ctx.Event()
        self._proc = ctx.Process(
            target=in_producer_netns,
            args=(target, *args, self._out, self._stop),
            daemon=True,
        )
        self._proc.start()
        msg = self._out.get(timeout=timeout_s)
        if msg[0] != "ready":
            self._proc.join(5)
            raise RuntimeError(f"p2p_kv producer failed:\n{msg[1]}")
        self.ready: tuple[Any, ...] = tuple(msg[1:])

    def close(self) -> None:
        self._stop.set()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


@contextlib.contextmanager
def keep_stepping(peers: Sequence[Any]) -> Iterator[None]:
    """Step StandalonePeers from a thread, as idle engines would, while the
    caller measures something else: a consumer nobody steps loses its
    session to the peer's liveness deadline. Non-blocking steps with a
    short sleep, so the stepping itself costs the measurement little."""
    stop = threading.Event()

    def steps() -> None:
        while not stop.is_set():
            for peer in peers:
                peer.step(wait=False)
            time.sleep(0.005)

    thread = threading.Thread(target=steps, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


#: How often the consumers not being measured are stepped, at most: well
#: inside the producer's liveness deadline (1.5 heartbeat intervals of
#: 0.5 s), and rare enough to cost the timed fetches nothing.
TEND_S = 0.1


class FetchPair:
    """A producer in a spawned process and consumer StandalonePeers here,
    one per load path: fetches timed from the first lookup to the job
    result (``e2e``) and from ``submit_load`` to it (``submit``).

    Subclasses say how a destination is cleared and checked; a path that
    needs more than a lookup (a parked store, a trace window) adds it in
    :meth:`request` and :meth:`fetched`."""

    def __init__(
        self,
        producer: ProducerProcess,
        consumers: dict[str, StandalonePeer],
        block_bytes: int,
    ) -> None:
        self._producer = producer
        #: the producer's address, the first thing its ``ready`` carries
        self.peer: str = producer.ready[0]
        self.consumers = consumers
        self.block_bytes = block_bytes
        self._n = 0
        self._tended = time.monotonic()

    def fetch(self, path: str, keys: list[bytes], dst: list[int]) -> FetchOutcome:
        """One fetch of ``keys`` into ``dst``, raising unless every key hit
        and the load succeeded."""
        self._n += 1
        kv_id, options = self.request(path, len(keys))
        t0 = time.perf_counter()
        out = self.consumers[path].fetch(self.peer, kv_id, keys, dst, **options)
        if not out.ok or out.hits != len(keys):
            raise RuntimeError(f"p2p_kv {path} fetch {self._n} failed: {out}")
        self.fetched(t0, out)
        self._tend(path)
        return out

    def _tend(self, path: str) -> None:
        """Step the other paths' consumers now and then, outside the timed
        fetch, as idle engines are stepped: one left alone while another
        path's fetches ran (slow ones between namespaces) missed its
        heartbeats, the producer dropped its session (after 1.5 heartbeat
        intervals, 0.75 s), and its next fetch found no hits."""
        now = time.monotonic()
        if now - self._tended < TEND_S:
            return
        self._tended = now
        for name, consumer in self.consumers.items():
            if name != path:
                consumer.step(wait=False)

    def request(self, path: str, n: int) -> tuple[str, dict[str, Any]]:
        """The producer's request id for the next fetch (of ``n`` blocks)
        and the options for StandalonePeer.fetch: a fresh id, no options."""
        return f"bench-{self._n}", {}

    def fetched(self, t0: float, out: FetchOutcome) -> None:
        """Called after each good fetch, ``t0`` taken just before it."""

    def clear(self, path: str, dst: list[int]) -> None:
        """Zero the destination slots, so a stale earlier load cannot pass
        the check."""

    def check(self, path: str, src: list[int], dst: list[int]) -> None:
        """Raise unless every destination slot holds its source's bytes."""

    def warmed_up(self, path: str) -> None:
        """Called once the warm-up fetches are done, before the timed ones."""

    def timed_fetches(
        self, path: str, src: list[int], dst: list[int], repeats: int, verify: bool
    ) -> tuple[list[float], list[float]]:
        """Two warm-up fetches (the first checked when ``verify``), then
        ``repeats`` timed ones: their lookup->result and submit->result
        seconds. The consumer must be left with no state of theirs."""
        keys = [key(s) for s in src]
        if verify:
            self.clear(path, dst)
        self.fetch(path, keys, dst)  # warm-up, then check what it wrote
        if verify:
            self.check(path, src, dst)
        self.fetch(path, keys, dst)
        self.warmed_up(path)
        total, submit = [], []
        for _ in range(repeats):
            out = self.fetch(path, keys, dst)
            total.append(out.total_s)
            submit.append(out.total_s - out.lookup_s)
        report = self.consumers[path].manager.state_report()
        if any(report.values()):
            raise AssertionError(f"p2p_kv consumer state left over: {report}")
        return total, submit

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """While the baselines run, keep stepping the consumers like idle
        engines (they wait on their sockets, so this costs next to no CPU);
        a silent consumer would lose its session to the liveness check."""
        with keep_stepping(list(self.consumers.values())):
            yield

    def close(self) -> None:
        for consumer in self.consumers.values():
            consumer.close()
        self._producer.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------
# worker processes driven over pipes
# ---------------------------------------------------------------------------


def serve_commands(
    conn: Any, handlers: Callable[[], dict[str, Callable[..., Any]]]
) -> None:
    """A :class:`WorkerPair` worker's loop: each message is ``(command,
    *args)``, answered ``("ok", handlers[command](*args))``; ``exit`` ends
    it. ``handlers`` is called first, in the worker, so what it imports
    (NIXL, vLLM) and builds fails as any command does: the parent gets
    ``("err", traceback)`` rather than a worker that never answers."""
    try:
        table = handlers()
        while True:
            command, *args = conn.recv()
            if command == "exit":
                conn.send(("ok", None))
                return
            conn.send(("ok", table[command](*args)))
    except BaseException:
        conn.send(("err", traceback.format_exc()))


class WorkerPair:
    """Two spawned worker processes driven over pipes: each message is a
    tuple, each reply ``("ok", value)`` or ``("err", traceback)``. Reused
    across measurements because importing NIXL is slow."""

    name = "benchmark worker"

    def __init__(self, targets: Sequence[Any], timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self._timeout_s = timeout_s
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for target in targets:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(child,), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._cell = 0

    def _call(self, which: int, *msg: Any) -> Any:
        self._conns[which].send(msg)
        return self._reply(which)

    def _reply(self, which: int) -> Any:
        conn = self._conns[which]
        if not conn.poll(self._timeout_s):
            raise TimeoutError(f"{self.name} did not answer")
        status, value = conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def close(self) -> None:
        for i, proc in enumerate(self._procs):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    self._call(i, "exit")
            proc.join(5)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
