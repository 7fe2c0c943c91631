"""How many of p2p_kv's files and functions one load walks through.

A reader who follows a load from ``submit_load`` to its result reads every
function it runs. Two StandalonePeers in this process (real sockets and a
real NIXL agent each): A holds 4 blocks of 64 KiB and serves from its own
thread; B looks them up, then loads them, and only B's thread is profiled
(``sys.setprofile``), from its ``submit_load`` until its step returns the
result. Per path (``nixl``: NIXL READ with read staging, ``same_host``
off; ``same_host``: the copy out of A's shared region), reported:

* **load**: the source files (under ``src/p2p_kv/``) and distinct
  functions that ran, the step's own work included (polling, serving,
  timers);
* **idle**: the same for 100 engine steps with nothing in flight, after
  the load (each waits up to 10 ms for work: heartbeats come and go);
* **the load's own**: files and functions that ran for the load and not
  for an idle step: what a reader must walk for the load alone.

The goal (issue "A house a newcomer can walk"): a load's walk crosses at
most 10 files.

    p2p-kv bench walk [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from p2p_kv.node.manager import Answer
from p2p_kv.runtime.standalone import StandalonePeer, make_key

SRC = "/src/p2p_kv/"
GOAL_FILES = 10
BLOCKS = 4
BLOCK_BYTES = 64 * 1024
#: steps with nothing in flight: enough for the idle path's timers
#: (a heartbeat each 0.5 s; each idle step waits up to 10 ms)
IDLE_STEPS = 100


class Trace:
    """The (file, function) pairs of ours that ran while installed."""

    def __init__(self) -> None:
        self.ran: set[tuple[str, str]] = set()

    def __call__(self, frame: Any, event: str, arg: object) -> None:
        if event == "call" and SRC in (name := frame.f_code.co_filename):
            self.ran.add((name.split(SRC, 1)[1], frame.f_code.co_qualname))

    def during(self, work: Callable[[], int]) -> int:
        sys.setprofile(self)
        try:
            return work()
        finally:
            sys.setprofile(None)


def _walk(same_host: bool) -> dict[str, Any]:
    a = StandalonePeer(64, BLOCK_BYTES, engine_id="walk-a")
    b = StandalonePeer(64, BLOCK_BYTES, engine_id="walk-b", same_host=same_host)
    keys = [make_key(i) for i in range(BLOCKS)]
    a.fill(keys, list(range(1, BLOCKS + 1)))
    stop = threading.Event()
    server = threading.Thread(target=a.serve_until, args=(stop,), daemon=True)
    server.start()
    try:
        b.open("walk", a.address, "kv-walk")
        end = time.monotonic() + 10.0
        answers = b.ask("walk", keys, end)
        if answers != [Answer.HIT] * BLOCKS:
            raise RuntimeError(f"lookup answered {answers}, not {BLOCKS} hits")

        def load() -> int:
            b.runtime.submit_load(1, "walk", keys, list(range(10, 10 + BLOCKS)))
            steps = 0
            while 1 not in b.results:
                if time.monotonic() > end:
                    raise RuntimeError("the load did not end in 10 s")
                b.step()
                steps += 1
            return steps

        loaded = Trace()
        steps = loaded.during(load)
        if not b.results[1].success:
            raise RuntimeError(f"the load failed: {b.results[1]}")
        b.runtime.end_request("walk")
        b.runtime.pump()

        def idle() -> int:
            for _ in range(IDLE_STEPS):
                b.step()
            return IDLE_STEPS

        idle_trace = Trace()
        idle_trace.during(idle)
    finally:
        stop.set()
        server.join(5.0)
        a.close()
        b.close()
    own = loaded.ran - idle_trace.ran
    return {
        "steps": steps,
        "load": _counts(loaded.ran),
        "idle": _counts(idle_trace.ran),
        "own": _counts(own),
    }


def _counts(ran: set[tuple[str, str]]) -> dict[str, Any]:
    files = sorted({f for f, _ in ran})
    return {"files": len(files), "functions": len(ran), "file_names": files}


def run() -> dict[str, Any]:
    paths = {"nixl": _walk(same_host=False), "same_host": _walk(same_host=True)}
    return {
        "paths": paths,
        "goal_files": GOAL_FILES,
        "met": {p: r["own"]["files"] <= GOAL_FILES for p, r in paths.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2p-kv bench walk", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    result = run()
    if args.json:
        print(json.dumps(result))
        return 0
    print("path       | steps | load: files, functions | idle steps | the load's own")
    for name, r in result["paths"].items():
        load, idle, own = r["load"], r["idle"], r["own"]
        print(
            f"{name:<10} | {r['steps']:>5} | {load['files']:>5}, {load['functions']:>4}"
            f"          | {idle['files']:>3}, {idle['functions']:>4} "
            f"| {own['files']:>3}, {own['functions']:>4}"
        )
        print(f"  the load's own files: {', '.join(own['file_names'])}")
    for name, met in result["met"].items():
        print(
            f"goal, the load's own walk within {GOAL_FILES} files ({name}): "
            f"{'met' if met else 'MISSED'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
