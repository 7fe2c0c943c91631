"""The directory at fleet scale: memory, update traffic and lookup cost.

What each engine pays to know what every member holds, measured on this
machine with the directory's own code (no engines: the directory is pure),
at ``--blocks`` blocks per member (100,000 by default) and ``--members``
members (8):

* **memory**: bytes per (block, member) entry (target: at most 16);
* **update traffic**: the bytes a member sends per stored block, as a
  sealed ``Holdings`` frame on the wire, batched per engine step (1, 32
  and 1,000 blocks a step), and the snapshot a new subscriber gets;
* **update cost**: the engine thread's time to apply one step's batch to a
  member already holding ``--blocks``;
* **lookup cost**: one vLLM lookup (a key checked against every member),
  and a 64-block prefix narrowed as vLLM asks it.

It then projects, from those measured unit costs, what one engine pays in
a fleet of 8, 64 and 1,000 engines, each holding ``--blocks`` blocks and
storing ``--store-rate`` new blocks a second: the bound that breaks first
is where a fleet should hand the choice of source to a router that keeps
one index for all (llm-d's), ``docs/architecture.md`` says why.

    p2p-kv bench directory [--members 8] [--blocks 100000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from benchmarks.harness import met
from p2p_kv.control.connection import HEADER
from p2p_kv.node.directory import Directory, OwnHoldings, fingerprint, pack
from p2p_kv.protocol import Holdings, encode

#: the issue's bound on memory per (block, member) entry
TARGET_BYTES_PER_ENTRY = 16
#: what a frame costs on the wire beside its message: the length prefix,
#: and with a secret the seal's marker byte and 16-byte AES-GCM tag
HEADER_BYTES_SEALED = HEADER + 1 + 16
FLEETS = (8, 64, 1000)


def _timed(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def wire_bytes(blocks: int) -> int:
    """A step's Holdings of ``blocks`` new blocks, sealed, with its length
    prefix: what one subscriber receives."""
    frame = encode(Holdings(add=pack(range(blocks))))
    return len(frame) + HEADER_BYTES_SEALED


def run(members: int, blocks: int, store_rate: float) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    d = Directory()
    t0 = time.perf_counter()
    for m in range(members):
        d.join(f"m{m}", blocks)
        for i in range(0, blocks, 10_000):
            d.update(
                f"m{m}",
                rng.integers(0, 2**63, min(10_000, blocks - i), dtype=np.uint64),
                np.empty(0, np.uint64),
            )
    fill_s = time.perf_counter() - t0
    per_entry = d.nbytes() / d.entries()
    step_cost = {
        n: _timed(
            lambda n=n: d.update(
                "m0",
                rng.integers(0, 2**63, n, dtype=np.uint64),
                np.empty(0, np.uint64),
            ),
            20,
        )
        for n in (1, 32, 1000)
    }
    held = int(d.members["m1"].held_in_order()[blocks // 2])
    lookup_s = _timed(lambda: d.holders(held), 2000)
    prefix = [int(x) for x in d.members["m1"].held_in_order()[:64]]

    def narrow() -> None:
        holders = d.holders(prefix[0])
        for fp in prefix[1:]:
            holders = d.holders(fp, holders)

    prefix_s = _timed(narrow, 200)
    fp_s = _timed(lambda: fingerprint(b"k" * 36), 5000)
    own = OwnHoldings(blocks)
    own.stored(os.urandom(36) for _ in range(blocks))
    own.take()
    snapshot_bytes = sum(
        len(encode(m)) + HEADER_BYTES_SEALED
        for m in [Holdings(add=pack(own.snapshot().tolist()))]
    )
    traffic = {n: wire_bytes(n) / n for n in (1, 32, 1000)}
    fleet = []
    for n in FLEETS:
        others = n - 1
        fleet.append(
            {
                "engines": n,
                "directory_mib": round(others * blocks * per_entry / 2**20, 1),
                "sessions": 2 * others,
                # every member's stores reach us, ours go to every member
                "update_kib_s_in": round(others * store_rate * traffic[32] / 1024, 1),
                "update_kib_s_out": round(others * store_rate * traffic[32] / 1024, 1),
                "update_cpu_share": round(others * store_rate / 32 * step_cost[32], 4),
                "lookup_us_per_key": round(others / members * lookup_s * 1e6, 1),
                "snapshot_mib_on_join": round(others * snapshot_bytes / 2**20, 1),
            }
        )
    return {
        "members": members,
        "blocks_per_member": blocks,
        "store_rate_blocks_s": store_rate,
        "fill_s": round(fill_s, 2),
        "bytes_per_entry": round(per_entry, 2),
        "target_bytes_per_entry": TARGET_BYTES_PER_ENTRY,
        "met": per_entry <= TARGET_BYTES_PER_ENTRY,
        "update_bytes_per_block": {n: round(v, 2) for n, v in traffic.items()},
        "update_apply_us": {n: round(v * 1e6, 1) for n, v in step_cost.items()},
        "snapshot_bytes": snapshot_bytes,
        "fingerprint_us": round(fp_s * 1e6, 2),
        "lookup_us": round(lookup_s * 1e6, 2),
        "prefix64_us": round(prefix_s * 1e6, 1),
        "fleet": fleet,
    }


def print_table(r: dict[str, Any]) -> None:
    print(
        f"{r['members']} members x {r['blocks_per_member']:,} blocks: "
        f"{r['bytes_per_entry']} bytes per (block, member) entry "
        f"(target <= {r['target_bytes_per_entry']}: {met(r['met'])})"
    )
    print(
        "update traffic per stored block, sealed frame included: "
        + ", ".join(
            f"{v} B at {n} a step" for n, v in r["update_bytes_per_block"].items()
        )
        + f"; a new subscriber's snapshot: {r['snapshot_bytes'] / 2**20:.2f} MiB"
    )
    print(
        "engine thread per step's batch at one member of "
        f"{r['blocks_per_member']:,}: "
        + ", ".join(f"{v} us for {n}" for n, v in r["update_apply_us"].items())
    )
    print(
        f"lookup: {r['fingerprint_us']} us to fingerprint a key, "
        f"{r['lookup_us']} us to check it against {r['members']} members, "
        f"{r['prefix64_us']} us for a 64-block prefix"
    )
    print(
        f"\nprojected per engine, each member holding {r['blocks_per_member']:,} "
        f"blocks and storing {r['store_rate_blocks_s']:g} blocks/s (32 a step):"
    )
    print(
        f"{'engines':>8} {'directory MiB':>13} {'sessions':>8} "
        f"{'updates in KiB/s':>16} {'update CPU':>10} {'lookup us/key':>13} "
        f"{'snapshots on join MiB':>21}"
    )
    for f in r["fleet"]:
        print(
            f"{f['engines']:>8} {f['directory_mib']:>13} {f['sessions']:>8} "
            f"{f['update_kib_s_in']:>16} {f['update_cpu_share']:>9.1%} "
            f"{f['lookup_us_per_key']:>13} {f['snapshot_mib_on_join']:>21}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2p-kv bench directory", description=__doc__)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--store-rate", type=float, default=1000.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.members < 2 or args.blocks < 1000:
        parser.error("--members must be at least 2 and --blocks at least 1000")
    result = run(args.members, args.blocks, args.store_rate)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
