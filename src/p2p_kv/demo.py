"""``p2p-kv demo``: two local vLLM engines sharing KV through p2p_kv.

Engine A computes a set of shared-prefix prompts; engine B receives the
same prompts with ``remote_kv_source`` naming A and loads A's blocks instead
of recomputing them. For each prompt length the demo reports the blocks B
got from A, the bytes fetched, B's time to first token with the remote hit
against recomputing a prompt of the same length, and whether B's tokens
equal A's. Every engine process is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from p2p_kv.adapter.engines import EngineError, EngineProcess, EngineSpec
from p2p_kv.tiny_model import BENCH, TINY, ModelSpec, ensure_model


@dataclass
class Row:
    tokens: int
    remote_blocks: int
    bytes_fetched: int
    ttft_remote_ms: float
    ttft_recompute_ms: float
    identical: bool

    @property
    def speedup(self) -> float:
        return (
            self.ttft_recompute_ms / self.ttft_remote_ms if self.ttft_remote_ms else 0.0
        )


def _prompts(spec: ModelSpec, length: int, seed: int, prefix: list[int]) -> list[int]:
    rng = random.Random(seed)
    tail = [
        rng.randrange(4, spec.vocab_size) for _ in range(max(0, length - len(prefix)))
    ]
    return (prefix + tail)[:length]


def run(
    *,
    preset: str = "bench",
    model_dir: str | None = None,
    lengths: list[int] | None = None,
    port_a: int = 0,
    port_b: int = 0,
    repeats: int = 3,
    progress: bool = True,
) -> dict[str, Any]:
    spec = BENCH if preset == "bench" else TINY
    lengths = lengths or [256, 1024, 2048]
    console = _console(progress)
    say = console.log if console is not None else (lambda *a, **k: None)
    model = model_dir or str(ensure_model(spec))
    tag = uuid.uuid4().hex[:6]
    dtype = "float32" if spec is BENCH else "auto"
    longest = max(lengths)
    common: dict[str, Any] = dict(
        dtype=dtype,
        max_model_len=max(4096, longest + 64),
        kv_cache_bytes=256 << 20,
        cpu_bytes=512 << 20,
    )
    engines: list[EngineProcess] = []
    rows: list[Row] = []
    try:
        # Port 0 (the default): each tier binds a free port and reports it.
        say(f"starting engine A with {model}")
        a = EngineProcess(
            EngineSpec(model, f"demo-a-{tag}", tier={"port": port_a}, **common)
        )
        engines.append(a)
        port_a = a.tier_port
        say(f"engine A up (p2p_kv on 127.0.0.1:{port_a}); starting engine B")
        b = EngineProcess(
            EngineSpec(model, f"demo-b-{tag}", tier={"port": port_b}, **common)
        )
        engines.append(b)
        say(f"engine B up (p2p_kv on 127.0.0.1:{b.tier_port})")
        prefix = _prompts(spec, 128, 7, [])  # a shared "system prompt"
        source = {"remote_host": "127.0.0.1", "remote_port": port_a}
        for n, length in enumerate(lengths):
            say(f"workload: {length}-token prompts")
            remote_ms: list[float] = []
            local_ms: list[float] = []
            identical = True
            blocks = fetched = 0
            for r in range(repeats):
                seed = 1000 * n + r
                ids = _prompts(spec, length, seed, prefix)
                out_a = a.generate(ids, max_tokens=8)
                a.call({"cmd": "idle", "seconds": 0.2})  # A stores its blocks
                state = b.state()
                before = state["counters"].get("bytes_loaded", 0)
                block_bytes = state["block_bytes"] or 1
                hit = b.generate(
                    ids,
                    params={
                        "remote_kv_source": {"kv_request_id": f"demo-{seed}", **source}
                    },
                    max_tokens=8,
                )
                got = b.state()["counters"]["bytes_loaded"] - before
                fetched += got
                blocks += got // block_bytes
                identical = identical and hit["tokens"] == out_a["tokens"]
                # TTFT: one token, remote hit vs recomputing a same-length
                # prompt B has never seen (no prefix in common).
                ids2 = _prompts(spec, length, seed + 500_000, [])
                a.generate(ids2, max_tokens=1)
                a.call({"cmd": "idle", "seconds": 0.2})
                t = b.generate(
                    ids2,
                    params={
                        "remote_kv_source": {"kv_request_id": f"ttft-{seed}", **source}
                    },
                    max_tokens=1,
                )
                remote_ms.append(t["elapsed_s"] * 1000)
                ids3 = _prompts(spec, length, seed + 900_000, [])
                local_ms.append(b.generate(ids3, max_tokens=1)["elapsed_s"] * 1000)
            rows.append(
                Row(
                    tokens=length,
                    remote_blocks=blocks // repeats,
                    bytes_fetched=fetched // repeats,
                    ttft_remote_ms=sorted(remote_ms)[len(remote_ms) // 2],
                    ttft_recompute_ms=sorted(local_ms)[len(local_ms) // 2],
                    identical=identical,
                )
            )
        for e in (a, b):
            e.call({"cmd": "idle", "seconds": 0.3})  # collect the last results
        residue = {
            name: {k: v for k, v in e.state()["report"].items() if v}
            for name, e in (("A", a), ("B", b))
        }
    finally:
        for engine in reversed(engines):
            engine.close()
    return {
        "model": model,
        # per repeat: A computes two prompts; B loads one (8 tokens), loads
        # one for TTFT and recomputes one
        "requests": 5 * repeats * len(lengths),
        "rows": [asdict(r) | {"speedup": round(r.speedup, 2)} for r in rows],
        "remote_hit_blocks": sum(r.remote_blocks * repeats for r in rows),
        "bytes_fetched": sum(r.bytes_fetched * repeats for r in rows),
        "outputs_identical": all(r.identical for r in rows),
        "residue": residue,
    }


def _console(progress: bool) -> Any:
    if not progress:
        return None
    try:
        from rich.console import Console
    except ImportError:  # pragma: no cover
        return None
    return Console(stderr=True)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="p2p_kv demo: engine B loads what engine A computed")
    # "blocks from A" counts primary-tier chunks B fetched (blocks B already
    # held from an earlier prompt of the shared prefix are not fetched again)
    for col in (
        "prompt tokens",
        "blocks from A",
        "MiB fetched",
        "TTFT remote hit",
        "TTFT recompute",
        "speedup",
        "tokens identical",
    ):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(
            str(r["tokens"]),
            str(r["remote_blocks"]),
            f"{r['bytes_fetched'] / 2**20:.1f}",
            f"{r['ttft_remote_ms']:.0f} ms",
            f"{r['ttft_recompute_ms']:.0f} ms",
            f"{r['speedup']:.1f}x",
            "yes" if r["identical"] else "NO",
        )
    console = Console()
    console.print(table)
    console.print(
        f"requests: {result['requests']}, remote hit blocks: {result['remote_hit_blocks']}, "
        f"bytes fetched: {result['bytes_fetched']:,}, outputs identical: "
        f"{'yes' if result['outputs_identical'] else 'NO'}, leftover state: "
        f"{result['residue'] or 'none'}"
    )


def _lengths(text: str) -> list[int]:
    """``--lengths``: a usage error names a bad entry (it was a traceback
    from inside the demo)."""
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of token counts"
        ) from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts of 1 or more")
    return lengths


def _int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: an int in ``low..high``, or a usage error naming
    ``what``. Checked before any engine starts: ``--repeats 0`` divided by
    zero, a negative count indexed past a list, and a port past 65535 was
    refused by the engine's config, each a traceback after both engines
    had loaded their model."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2p-kv demo", description=__doc__)
    parser.add_argument(
        "--model",
        choices=("bench", "tiny"),
        default="bench",
        help="locally generated model preset (bench: prefill costs real time)",
    )
    parser.add_argument("--model-dir", help="use this model directory instead")
    parser.add_argument(
        "--lengths",
        type=_lengths,
        default="256,1024,2048",
        help="prompt lengths in tokens, comma-separated",
    )
    parser.add_argument(
        "--repeats", type=_int_in(1, 1 << 20, "a count of 1 or more"), default=3
    )
    port = _int_in(0, 65535, "a port in 0..65535")
    parser.add_argument(
        "--port-a", type=port, default=0, help="A's control port (0: a free one)"
    )
    parser.add_argument(
        "--port-b", type=port, default=0, help="B's control port (0: a free one)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    if args.port_a and args.port_a == args.port_b:
        parser.error(f"--port-a and --port-b are both {args.port_a}")
    t0 = time.monotonic()
    try:
        result = run(
            preset=args.model,
            model_dir=args.model_dir,
            lengths=args.lengths,
            port_a=args.port_a,
            port_b=args.port_b,
            repeats=args.repeats,
            progress=not args.json,
        )
    except KeyboardInterrupt:
        print("interrupted: engines stopped", file=sys.stderr)
        return 130
    except EngineError as exc:  # it names the engine's log
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    ok = result["outputs_identical"] and result["remote_hit_blocks"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
