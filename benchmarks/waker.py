"""Lookup round trip to a producer whose engine sleeps (the waker's job).

vLLM's 3-process engine (``vllm serve``) sleeps on its input queue when it
has no request; p2p_kv's waker thread (``TierRuntime.start_waker``) handles
the tier meanwhile and calls the engine in when a peer's lookup needs its
primary tier. How long a consumer's lookup takes then, three ways in the
same run, each producer and the consumer a ``StandalonePeer`` in this
process (real TCP and NIXL):

* ``stepping``: the producer engine steps itself, waiting on its sockets
  between steps (an in-process engine): the baseline, no waker involved;
* ``waker``: the engine sleeps; the waker sleeps on the control sockets'
  descriptors and calls the engine in when the lookup arrives;
* ``tick``: the same waker with its descriptors hidden, so it wakes only
  on a 10 ms tick (the waker itself ticks at 10 ms only while transfers
  are in flight or a peer may be moving bytes to or from us, 200 ms
  otherwise).

Lookups of one key, a hit, one at a time, 50-60 ms apart (the producer
falls back asleep between them). Run: ``p2p-kv bench waker
[--lookups N] [--json]`` (or ``python -m benchmarks.waker``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

MODES = ("stepping", "waker", "tick")


def _p2p() -> Any:
    import p2p_kv.runtime.standalone as standalone

    return standalone


class Producer:
    """A producer engine in a thread: stepping on its own, or asleep until
    its tier's waker calls it in."""

    def __init__(self, mode: str) -> None:
        sa = _p2p()
        self.peer = sa.StandalonePeer(16, 4096, engine_id=f"wk-{mode}-{os.getpid()}")
        for slot in range(8):
            self.peer.pinner.table[sa.make_key(slot)] = slot
        self._called = threading.Event()
        self._stop = threading.Event()
        rt = self.peer.runtime
        if mode == "stepping":
            target = self._step_always
        else:
            idle_s = None
            if mode == "tick":
                rt.control.readiness_fds = list  # nothing to sleep on: the tick
                idle_s = 0.01  # the old tick, also with nothing in flight
            if idle_s is None:
                rt.start_waker(self._called.set)
            else:
                rt.start_waker(self._called.set, idle_s=idle_s)
            target = self._step_when_called
        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()

    def _step_always(self) -> None:
        while not self._stop.is_set():
            with self.peer.runtime.lock:
                self.peer.step()

    def _step_when_called(self) -> None:
        rt = self.peer.runtime
        while not self._stop.is_set():
            if self._called.wait(0.05):
                self._called.clear()
                with rt.lock:
                    rt.waker.engine_stepped()
                    self.peer.step(wait=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.peer.close()


def measure(mode: str, lookups: int, seed: int) -> dict[str, Any]:
    sa = _p2p()
    producer = Producer(mode)
    consumer = sa.StandalonePeer(16, 4096, engine_id=f"wk-c-{mode}-{os.getpid()}")
    rng = random.Random(seed)
    key = [sa.make_key(1)]
    try:
        warm = consumer.fetch(producer.peer.address, "warm", key, [3])
        if not warm.ok:
            raise RuntimeError(f"{mode}: warm-up fetch failed: {warm}")
        seconds = []
        for i in range(lookups):
            time.sleep(0.05 + 0.01 * rng.random())
            consumer.step(wait=False)
            out = consumer.fetch(producer.peer.address, f"{mode}-{i}", key, [3])
            if not out.ok:
                raise RuntimeError(f"{mode}: fetch {i} failed: {out}")
            seconds.append(out.lookup_s)
    finally:
        consumer.close()
        producer.close()
    seconds.sort()
    return {
        "median_ms": 1e3 * statistics.median(seconds),
        "p90_ms": 1e3 * seconds[int(0.9 * (len(seconds) - 1))],
        "max_ms": 1e3 * seconds[-1],
        "lookups": lookups,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=40)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    rows = {mode: measure(mode, args.lookups, seed=i) for i, mode in enumerate(MODES)}
    base = rows["stepping"]["median_ms"]
    for row in rows.values():
        row["x_stepping"] = row["median_ms"] / base
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'producer engine':<16} {'median ms':>9} {'p90 ms':>7} {'max ms':>7} {'x stepping':>10}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:<16} {r['median_ms']:>9.2f} {r['p90_ms']:>7.2f} "
            f"{r['max_ms']:>7.2f} {r['x_stepping']:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
