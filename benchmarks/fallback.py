"""Time to fallback: how long a load waits once its producer is gone.

Two ways to lose a producer, N trials each, every peer in its own network
namespace (``tests.support.netns``; UCX over TCP on the veth):

* ``kill``: the producer process is SIGKILLed while the load's transfer is
  in flight (its kernel closes the sockets: the consumer hears a FIN);
* ``partition``: the producer's link goes dark (``ip link set down`` on the
  bridge side: no FIN, no RST; only heartbeats can tell).

Time to fallback = from the kill / link-down to the failed job result in
the consumer's poll loop. The target (issue 6) is two heartbeat intervals.
Percentiles p50 / p90 / max per scenario, and the consumer's longest poll
step during each trial (the loop must never hang while it waits).

Needs root and iproute2. Run: ``p2p-kv bench fallback [--trials N]
[--heartbeat S] [--json]`` (or ``python -m benchmarks.fallback`` from the
checkout: it imports ``tests.support``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.netns import UCX_ENV, Hosts
from tests.support.procs import PeerProc

BLOCK = 64 * 1024
PORT = 5910


def _cfg(hosts: Hosts, i: int, name: str, hb: float, events: Path) -> dict[str, Any]:
    return {
        "engine_id": name,
        "host": hosts.addrs[i],
        "port": PORT,
        "num_blocks": 64,
        "block_bytes": BLOCK,
        "fill": 32 if i == 0 else 0,
        "timeouts": {"heartbeat_interval_s": hb, "pin_ttl_s": 3.0},
        "events_path": str(events),
        "data_faults": {"stall_s": 30.0, "stall_p": 1.0},
        "seed": i,
    }


def _one(
    hosts: Hosts, prod: PeerProc, cons: PeerProc, events: Path, how: str, n: int
) -> dict[str, float]:
    events.write_text("")
    cons.send(
        "fetch",
        peer=prod.address,
        kv_id=f"{how}-{n}-{time.monotonic()}",
        keys=list(range(8)),
        slots=list(range(8)),
        timeout_s=20.0,
    )
    end = time.monotonic() + 10
    while not events.read_text():
        if time.monotonic() > end:
            raise RuntimeError("no transfer went in flight")
        time.sleep(0.001)
    if how == "kill":
        t0 = time.monotonic()
        prod.kill()
    else:
        hosts.down(0)
        t0 = time.monotonic()
    out = cons.reply(timeout=30)
    if out["ok"] or not out["job_done"]:
        raise RuntimeError(f"the load did not fail: {out}")
    return {"fallback_s": out["t_result"] - t0, "max_step_s": out["max_step_s"]}


def _wait_ready(hosts: Hosts, prod: PeerProc, cons: PeerProc) -> None:
    """After a partition heals, the consumer redials (with backoff)."""
    end = time.monotonic() + 20
    cons.call("faults", control=None, data={})
    try:
        while time.monotonic() < end:
            out = cons.call(
                "fetch",
                peer=prod.address,
                kv_id=f"probe-{time.monotonic()}",
                keys=[20],
                slots=[40],
                timeout_s=3.0,
            )
            if out["ok"]:
                if out["bad_slots"]:
                    raise RuntimeError(f"a successful load had wrong bytes: {out}")
                return
            time.sleep(0.2)
        raise RuntimeError("consumer never got its producer back")
    finally:
        cons.call("faults", control=None, data={"stall_s": 30.0, "stall_p": 1.0})


def run(trials: int, hb: float) -> dict[str, Any]:
    rows: dict[str, list[dict[str, float]]] = {"kill": [], "partition": []}
    with Hosts(2) as hosts, tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "events"
        events.touch()
        cons = PeerProc(
            _cfg(hosts, 1, "cons", hb, events), netns=hosts.names[1], env=UCX_ENV
        )
        prod: PeerProc | None = None
        try:
            for how in ("kill", "partition"):
                for n in range(trials):
                    if prod is None:
                        prod = PeerProc(
                            _cfg(hosts, 0, "prod", hb, events),
                            netns=hosts.names[0],
                            env=UCX_ENV,
                        )
                        _wait_ready(hosts, prod, cons)
                    rows[how].append(_one(hosts, prod, cons, events, how, n))
                    if how == "kill":
                        prod.stop()
                        prod = None
                    else:
                        hosts.up(0)
                        _wait_ready(hosts, prod, cons)
        finally:
            cons.stop()
            if prod is not None:
                prod.stop()
    return {"heartbeat_s": hb, "target_s": 2 * hb, "trials": trials, **_summary(rows)}


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def _summary(rows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for how, trials in rows.items():
        f = [t["fallback_s"] for t in trials]
        out[how] = {
            "p50_s": statistics.median(f),
            "p90_s": _pct(f, 90),
            "max_s": max(f),
            "min_s": min(f),
            "max_step_s": max(t["max_step_s"] for t in trials),
            "samples_s": f,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--heartbeat", type=float, default=0.2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run(args.trials, args.heartbeat)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    target = res["target_s"]
    print(
        f"time to fallback, {args.trials} trials each, heartbeat "
        f"{1e3 * args.heartbeat:.0f} ms (target {1e3 * target:.0f} ms)"
    )
    print(f"{'scenario':<10} {'p50':>8} {'p90':>8} {'max':>8} {'step max':>9}  target")
    for how in ("kill", "partition"):
        r = res[how]
        print(
            f"{how:<10} {1e3 * r['p50_s']:>6.0f}ms {1e3 * r['p90_s']:>6.0f}ms "
            f"{1e3 * r['max_s']:>6.0f}ms {1e3 * r['max_step_s']:>7.1f}ms  "
            f"{'met' if r['max_s'] <= target else 'MISSED'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
