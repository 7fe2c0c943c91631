"""``p2p-kv``: the operator's entry point.

``p2p-kv bench NAME [args]`` runs a benchmark from the source
tree's ``benchmarks/`` (they are not shipped in the wheel: they measure the
machine and need the tree's baselines); ``p2p-kv model`` builds the local
test model; ``p2p-kv demo`` runs two local engines sharing KV; ``p2p-kv
doctor`` checks a machine and a peer before serving.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

BENCHES = (
    "step",
    "transfer",
    "raw_nixl",
    "ttft",
    "vs_intree",
    "floor",
    "directory",
    "first_pull",
    "fallback",
    "gpu",
    "waker",
    "connections",
    "round_trip",
    "fleet",
    "walk",
)


def _bench(name: str, rest: list[str]) -> int:
    root = Path(__file__).resolve().parents[2]
    path = root / "benchmarks" / f"{name}.py"
    if not path.exists():
        print(f"p2p-kv: {path} not found: run from a source checkout", file=sys.stderr)
        return 2
    sys.argv = [str(path), *rest]
    # Imported as benchmarks.NAME from the checkout's root (not run as a
    # script): the benchmarks start worker processes, and a spawned child
    # finds a worker function only through a module it can import by name,
    # on the sys.path it inherits (benchmarks/__init__.py says more).
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    main = getattr(importlib.import_module(f"benchmarks.{name}"), "main", None)
    if main is None:
        print(f"p2p-kv: {path} has no main()", file=sys.stderr)
        return 2
    return int(main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2p-kv", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    # No help of its own: "bench fallback --help" is the benchmark's.
    bench = sub.add_parser(
        "bench",
        help=f"run a benchmark: one of {', '.join(BENCHES)} "
        "(p2p-kv bench NAME --help: its options)",
        add_help=False,
    )
    bench.add_argument("name", nargs="?", choices=BENCHES)
    model = sub.add_parser(
        "model", help="build the local test model and print its path"
    )
    model.add_argument("--preset", choices=("tiny", "bench"), default="tiny")
    from p2p_kv import doctor

    doctor.add_arguments(
        sub.add_parser("doctor", help="check this machine (and a peer) before serving")
    )
    sub.add_parser(
        "demo", help="two local engines sharing KV (p2p-kv demo --help)", add_help=False
    )
    args, rest = parser.parse_known_args(argv)
    if rest and args.cmd not in ("demo", "bench"):
        # Only those pass arguments on; elsewhere a typo ("--presets")
        # must not run with the defaults.
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "demo":
        from p2p_kv import demo

        return demo.main(rest)
    if args.cmd == "bench":
        if args.name is None:
            # "p2p-kv bench --help" (or no name): which benchmarks there are.
            asked = bool({"-h", "--help"} & set(rest))
            print(
                f"usage: p2p-kv bench {{{','.join(BENCHES)}}} [options]\n"
                "p2p-kv bench NAME --help lists a benchmark's options",
                file=sys.stdout if asked else sys.stderr,
            )
            return 0 if asked else 2
        return _bench(args.name, rest)
    if args.cmd == "model":
        from p2p_kv.tiny_model import BENCH, TINY, ensure_model

        print(ensure_model(TINY if args.preset == "tiny" else BENCH))
        return 0
    if args.cmd == "doctor":
        return doctor.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
