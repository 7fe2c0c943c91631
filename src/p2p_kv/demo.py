"""``p2p-kv demo``: two local vLLM engines sharing KV through p2p_kv.

Engine A computes a set of shared-prefix prompts; engine B receives the
same prompts with ``remote_kv_source`` naming A and loads A's blocks instead
of recomputing them. For each prompt length the demo reports the blocks B
got from A, the bytes fetched, B's time to first token with the remote hit
against recomputing a prompt of the same length (the median of the repeats
and their spread, with a flag where the repeats disagree), a bar of the
speedup, and whether B's tokens equal A's. Every engine process is stopped
on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from p2p_kv.adapter.engines import EngineError, EngineProcess, EngineSpec
from p2p_kv.tiny_model import BENCH, TINY, ModelSpec, ensure_model

#: Repeats disagree when a TTFT's spread exceeds this share of its median.
UNSTEADY_SPREAD = 0.25
#: From this many repeats on, the spread is p10-p90 (else min-max).
PERCENTILE_FROM = 10
BAR_WIDTH = 16


@dataclass
class Row:
    tokens: int
    remote_blocks: int
    bytes_fetched: int
    ttft_remote_ms: float
    ttft_recompute_ms: float
    identical: bool
    #: each repeat's TTFTs, in order (a remote hit and a recompute each)
    ttft_remote_samples_ms: list[float] = field(default_factory=list)
    ttft_recompute_samples_ms: list[float] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return (
            self.ttft_recompute_ms / self.ttft_remote_ms if self.ttft_remote_ms else 0.0
        )

    def to_dict(self) -> dict[str, Any]:
        """The row for ``--json``: its fields, the speedup, each measure's
        spread over the repeats, and why they disagree ("" when they agree)."""
        remote, local = self.ttft_remote_samples_ms, self.ttft_recompute_samples_ms
        return asdict(self) | {
            "speedup": round(self.speedup, 2),
            "ttft_remote_ms_range": _rounded(spread(remote), 1),
            "ttft_recompute_ms_range": _rounded(spread(local), 1),
            "speedup_range": _rounded(spread(speedups(remote, local)), 2),
            "disagree": disagreement(remote, local),
        }


# ---------------------------------------------------------------------------
# the report's pieces (pure)
# ---------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    """The middle value (the upper one of an even count); 0 for none."""
    return sorted(values)[len(values) // 2] if values else 0.0


def spread(values: Sequence[float]) -> tuple[float, float]:
    """The range of the repeats: min-max, or p10-p90 (nearest rank) from
    :data:`PERCENTILE_FROM` values on, where one outlier says little."""
    if not values:
        return (0.0, 0.0)
    ordered = sorted(values)
    if len(ordered) < PERCENTILE_FROM:
        return (ordered[0], ordered[-1])
    last = len(ordered) - 1
    return (ordered[round(0.1 * last)], ordered[round(0.9 * last)])


def speedups(remote_ms: Sequence[float], recompute_ms: Sequence[float]) -> list[float]:
    """Each repeat's own speedup: its recompute over its remote hit, both
    measured back to back."""
    return [b / a for a, b in zip(remote_ms, recompute_ms, strict=True) if a > 0]


def disagreement(remote_ms: Sequence[float], recompute_ms: Sequence[float]) -> str:
    """Why the repeats of one length disagree, or "": the repeats' speedups
    fall on both sides of 1.0x, or a TTFT's spread is over
    :data:`UNSTEADY_SPREAD` of its median (a busy machine, most often)."""
    if len(remote_ms) < 2:
        return ""
    low, high = spread(speedups(remote_ms, recompute_ms))
    if low < 1.0 < high:
        return f"speedup {low:.2f}x-{high:.2f}x, both sides of 1.0x"
    for what, values in (("remote hit", remote_ms), ("recompute", recompute_ms)):
        low, high = spread(values)
        mid = median(values)
        if mid > 0 and high - low > UNSTEADY_SPREAD * mid:
            return (
                f"{what} TTFT {low:.0f}-{high:.0f} ms, spread over "
                f"{UNSTEADY_SPREAD:.0%} of its median {mid:.0f} ms"
            )
    return ""


def bar(value: float, top: float, width: int = BAR_WIDTH) -> str:
    """``value`` as a bar of block characters, ``top`` filling ``width``
    (in eighths of a character)."""
    if top <= 0 or value <= 0:
        return ""
    eighths = round(min(value, top) / top * width * 8)
    full, part = divmod(eighths, 8)
    return "\u2588" * full + ("" if part == 0 else chr(0x2590 - part))


def residue_text(residue: Mapping[str, Mapping[str, Any]]) -> str:
    """The per-request state left on the engines: ``none`` when every
    engine's report is empty, else each engine's non-zero entries."""
    left = {name: state for name, state in residue.items() if state}
    if not left:
        return "none"
    return "; ".join(
        f"{name}: " + ", ".join(f"{k}={v}" for k, v in state.items())
        for name, state in left.items()
    )


def _rounded(pair: tuple[float, float], digits: int) -> list[float]:
    return [round(pair[0], digits), round(pair[1], digits)]


def _range(pair: Sequence[float], fmt: str, unit: str) -> str:
    low, high = pair
    return f"{low:{fmt}}-{high:{fmt}}{unit}"


def speedup_lines(rows: Sequence[Mapping[str, Any]], repeats: int) -> list[str]:
    """Below the table: per prompt length a bar of the speedup, with the
    spread of the repeats' speedups and TTFTs, ``!`` on a row whose repeats
    disagree; then what each flagged row's repeats disagree on."""
    if not rows:
        return []
    several = repeats > 1
    top = max(max(r["speedup"], r["speedup_range"][1]) for r in rows)
    what = "min-max" if repeats < PERCENTILE_FROM else "p10-p90"
    lines = [
        "speedup = recompute TTFT / remote-hit TTFT"
        + (f"; median of {repeats} repeats ({what} in brackets)" if several else "")
    ]
    width = max(len(f"{r['tokens']:,}") for r in rows)
    for r in rows:
        text = f"{r['speedup']:.1f}x"
        if several:
            text += (
                f" ({_range(r['speedup_range'], '.2f', '')})  hit "
                f"{_range(r['ttft_remote_ms_range'], '.0f', '')} ms, recompute "
                f"{_range(r['ttft_recompute_ms_range'], '.0f', '')} ms"
            )
        flag = " !" if r["disagree"] else ""
        lines.append(
            f"  {r['tokens']:>{width},}  {bar(r['speedup'], top):<{BAR_WIDTH}}  "
            f"{text}{flag}"
        )
    flagged = [r for r in rows if r["disagree"]]
    for r in flagged:
        lines.append(f"! {r['tokens']:,} tokens: repeats disagree: {r['disagree']}")
    if flagged:
        lines.append(
            "! a busy machine shows as spread: rerun with more --repeats (or "
            "on a quieter machine) before trusting a flagged row"
        )
    return lines


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
                    ttft_remote_ms=median(remote_ms),
                    ttft_recompute_ms=median(local_ms),
                    identical=identical,
                    ttft_remote_samples_ms=[round(x, 2) for x in remote_ms],
                    ttft_recompute_samples_ms=[round(x, 2) for x in local_ms],
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
        "repeats": repeats,
        "rows": [r.to_dict() for r in rows],
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


def table_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """The table's cells: the medians of the repeats, ``!`` after the
    speedup of a row whose repeats disagree (their spread follows the
    table, in :func:`speedup_lines`)."""
    return [
        [
            f"{r['tokens']:,}",
            str(r["remote_blocks"]),
            f"{r['bytes_fetched'] / 2**20:.1f}",
            f"{r['ttft_remote_ms']:.0f} ms",
            f"{r['ttft_recompute_ms']:.0f} ms",
            f"{r['speedup']:.1f}x" + (" !" if r["disagree"] else ""),
            "yes" if r["identical"] else "NO",
        ]
        for r in result["rows"]
    ]


def summary_line(result: Mapping[str, Any]) -> str:
    return (
        f"requests: {result['requests']}, remote hit blocks: "
        f"{result['remote_hit_blocks']}, bytes fetched: "
        f"{result['bytes_fetched']:,}, outputs identical: "
        f"{'yes' if result['outputs_identical'] else 'NO'}, leftover state: "
        f"{residue_text(result['residue'])}"
    )


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
    for cells in table_rows(result):
        table.add_row(*cells)
    Console(highlight=False).print(table)
    for line in speedup_lines(result["rows"], result.get("repeats", 1)):
        print(line)
    print(summary_line(result))


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
