"""A remote hit against its floor, in real engines.

No remote hit can be faster than two things it cannot avoid: what a hit
from the engine's own primary tier costs (the copy of the blocks into the
engine's KV cache and the forward of the last token) and moving the hit's
bytes at the machine's raw NIXL READ rate. So per prompt length, in one run:

* **primary-tier hit**: engine B runs a prompt whose blocks sit in its own
  primary tier (the tiering connector's host-memory tier p2p_kv is
  secondary to) and nowhere else: B ran it as a remote hit, then its device
  prefix cache was reset (``LLM.reset_prefix_cache()``, the connector kept),
  so the same prompt again must load every block back from the primary
  tier. Proven per sample by vLLM's own metrics: every cached token counted
  under ``source=host`` (none ``device``), every block a ``0:primary``
  chunk hit, no secondary tier asked, nothing read from one; tokens equal
  to A's.
* **bytes** of the hit (vLLM's tiering metrics, as ``vs_intree``) and the
  **raw NIXL READ** of that many blocks of that size between two processes
  (``benchmarks.raw_nixl``), measured in each round.
* **floor** = primary-hit TTFT + bytes / raw READ rate.
* **remote hits**: producer A (cpu0) computes the prompt, consumer B (cpu1)
  runs it with ``remote_kv_source`` naming A (``max_tokens=1``), on
  p2p_kv's *NIXL path* (B with ``same_host_copy: false``: NIXL READ, read
  staging, slots; proven by B's ``same_host_reads`` staying 0), its
  *same-host path* (the default: a copy out of A's shared region; proven by
  ``same_host_reads`` growing), its *directory* path (B names no source:
  A and B list each other in ``peers``, and B's directory answers every
  lookup at once, where a named source answers RETRY first and costs an
  engine step; then the NIXL path's READ) and, beside them, vLLM's
  in-tree ``p2p`` tier.

Rounds interleave the paths (the NIXL and same-host B swap order each
round), so the machine's noise falls on all of them alike; each number is
the median over rounds. The in-tree pair is started for each round and
stopped after it: its idle engines keep a core busy (``vs_intree``), which
would slow every other path's numbers. The target: p2p_kv's hit within
1.2x of its floor from 1,024 tokens.

    p2p-kv bench floor [--lengths 1024,2048,4096] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from typing import Any

from benchmarks.harness import met
from benchmarks.raw_nixl import RawNixlPair
from benchmarks.vs_intree import (
    engine_common,
    hit,
    hit_phases,
    median,
    produce,
    producer_port,
    prompt,
    remote_source,
    say,
    tier_metric,
    tier_spec,
)
from p2p_kv.adapter.engines import ENGINE_BLOCK, EngineProcess, free_port
from p2p_kv.tiny_model import BENCH, TINY, ensure_model

LENGTHS = "1024,2048,4096"
#: the issue's target: a remote hit at most this many times its floor,
#: from this many tokens on
TARGET_RATIO, TARGET_FROM_TOKENS = 1.2, 1024
#: p2p_kv's load paths (B's extra tier config) and vLLM's in-tree tier
P2P_PATHS: dict[str, dict[str, Any]] = {
    "nixl": {"same_host_copy": False},
    "same_host": {},
    # No source named: B finds A's blocks in its directory (A and B list
    # each other in ``peers``), then READs them as the NIXL path does.
    "directory": {"same_host_copy": False},
}
PATHS = (*P2P_PATHS, "intree")
LABELS = {
    "nixl": "NIXL path",
    "same_host": "same-host",
    "directory": "directory",
    "intree": "in-tree",
}
#: How long a directory hit waits for B to hear of A's new blocks (A sends
#: them at its next step, B takes them at its next poll).
DIRECTORY_WAIT_S = 5.0
#: timed READs per raw measurement (after two warm-ups)
RAW_REPEATS = 10

CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
CHUNK_QUERIES = "vllm:kv_offload_tiering_chunk_queries"
READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
SAME_HOST_READS = "vllm:kv_offload_p2p_same_host_reads"


def _metric(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(name + "{"))


def cached_by_source(metrics: dict[str, float]) -> dict[str, int]:
    """Cached prompt tokens per source (device, host, p2p, ...), as vLLM
    counts them at admission."""
    out: dict[str, int] = {}
    for k, v in metrics.items():
        if k.startswith(CACHED_BY_SOURCE + "{") and v:
            source = k.rsplit("source=", 1)[1].rstrip("}")
            out[source] = out.get(source, 0) + int(v)
    return out


def primary_proof(primary: dict[str, Any], remote: dict[str, Any]) -> dict[str, Any]:
    """What shows that a sample was a hit from B's own primary tier, after
    ``remote``, the remote hit of the same prompt, had put it there."""
    m = primary["metrics"]
    return {
        "cached_by_source": cached_by_source(m),
        "primary_chunk_hits": int(tier_metric(m, CHUNK_HITS, primary=True)),
        "secondary_queries": int(tier_metric(m, CHUNK_QUERIES)),
        "secondary_read_bytes": int(tier_metric(m, READ_BYTES)),
        "ok": (
            primary["cached"] > 0
            and cached_by_source(m) == {"host": primary["cached"]}
            and primary["cached"] == remote["cached"]
            and int(tier_metric(m, CHUNK_HITS, primary=True)) == remote["blocks"]
            and tier_metric(m, CHUNK_QUERIES) == 0
            and tier_metric(m, READ_BYTES) == 0
            and primary["tokens"] == remote["tokens"]
        ),
    }


class _Samples:
    """Every measurement of one length, over the rounds."""

    def __init__(self) -> None:
        self.primary: list[dict[str, Any]] = []
        self.proofs: list[dict[str, Any]] = []
        self.raw: list[dict[str, Any]] = []
        self.hits: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
        self.identical = True
        self.path_proven = True


def _p2p_round(
    a: EngineProcess,
    consumers: dict[str, EngineProcess],
    raw: RawNixlPair,
    prompts: dict[int, list[int]],
    samples: dict[int, _Samples],
    round_no: int,
    progress: bool,
) -> None:
    """One round of p2p_kv's paths and the raw READ: per length, A computes
    the prompt; each B hits it remotely, then from its primary tier; then
    raw NIXL READs the same blocks."""
    order = list(consumers) if round_no % 2 == 0 else list(reversed(consumers))
    port = producer_port(a)
    for length, ids in prompts.items():
        say(progress, f"round {round_no + 1}: p2p_kv, {length} tokens")
        s = samples[length]
        a_tokens = produce(a, ids)
        for path in order:
            b = consumers[path]
            kv_id = f"floor-{path}-{length}-{round_no}-{uuid.uuid4().hex[:6]}"
            if path == "directory":
                heard(b, a, length // ENGINE_BLOCK - 1)
                remote = hit(b, ids, None)
            else:
                remote = hit(b, ids, remote_source(kv_id, port))
            reads = _metric(remote["metrics"], SAME_HOST_READS)
            same_host = P2P_PATHS[path].get("same_host_copy", True)
            s.path_proven &= remote["blocks"] > 0 and (
                reads > 0 if same_host else reads == 0
            )
            s.identical &= remote["tokens"] == a_tokens
            s.hits[path].append(remote)
            if not b.call({"cmd": "reset"})["ok"]:
                raise RuntimeError(f"{path}: B's prefix cache did not reset")
            primary = hit(b, ids, None)
            s.primary.append(primary)
            s.proofs.append(primary_proof(primary, remote))
        first = s.hits[order[0]][-1]
        blocks = first["blocks"]
        if blocks:
            s.raw.append(
                raw.measure(first["bytes"] // blocks, blocks, RAW_REPEATS, op="READ")
            )


def heard(b: EngineProcess, a: EngineProcess, blocks: int) -> None:
    """Wait (outside any timing) until B's directory lists at least
    ``blocks`` more of A's blocks than A's last prompt left there."""
    member = f"127.0.0.1:{a.tier_port}"
    want = getattr(b, "_floor_heard", 0) + blocks
    end = time.monotonic() + DIRECTORY_WAIT_S
    while True:
        b.call({"cmd": "idle", "seconds": 0.02})
        got = int(b.state()["counters"]["directory"].get(member, 0))
        if got >= want or time.monotonic() > end:
            b._floor_heard = got  # type: ignore[attr-defined]
            return


def warm_prompt(vocab: int, lengths: list[int]) -> list[int]:
    """The prompt of a pair's warm-up hit: as long as the longest measured,
    so the first hit's costs (the session's handshake and NIXL metadata,
    first touches of read staging and of the memory UCX maps) fall on no
    measured hit. With 256 tokens, one NIXL-path hit of 1,024 tokens in
    the first round took 54 ms against 15 in the next two."""
    return prompt(vocab, max(lengths), 77)


def _intree_round(
    model: str,
    common: dict[str, Any],
    prompts: dict[int, list[int]],
    samples: dict[int, _Samples],
    vocab: int,
    round_no: int,
    progress: bool,
) -> None:
    """One round of vLLM's in-tree tier: a fresh pair, a warm-up hit
    (:func:`warm_prompt`), one hit per length, the pair stopped."""
    tag = uuid.uuid4().hex[:6]
    say(progress, f"round {round_no + 1}: in-tree, starting A (cpu0) and B (cpu1)")
    engines: list[EngineProcess] = []
    try:
        a = EngineProcess(tier_spec("intree", model, f"floor-it-a-{tag}", 0, common))
        engines.append(a)
        b = EngineProcess(tier_spec("intree", model, f"floor-it-b-{tag}", 1, common))
        engines.append(b)
        port = producer_port(a)
        warm = warm_prompt(vocab, list(prompts))
        produce(a, warm)
        hit(b, warm, remote_source(f"floor-it-warm-{tag}", port))
        for length, ids in prompts.items():
            say(progress, f"round {round_no + 1}: in-tree, {length} tokens")
            a_tokens = produce(a, ids)
            h = hit(b, ids, remote_source(f"floor-it-{length}-{tag}", port))
            samples[length].hits["intree"].append(h)
            samples[length].identical &= h["tokens"] == a_tokens
    finally:
        for e in reversed(engines):
            e.close()


def _phases(hits: list[dict[str, Any]]) -> dict[str, float]:
    """Median time per phase of ``hits`` (engine B's timestamps), ms."""
    keys = hit_phases(hits[0])
    return {k: round(median([hit_phases(h).get(k, 0) for h in hits]), 2) for k in keys}


def _row(length: int, s: _Samples) -> dict[str, Any]:
    """One length's medians, floor, ratios and verdicts."""
    primary_ms = median([p["ms"] for p in s.primary])
    nbytes = int(median([h["bytes"] for h in s.hits["nixl"]]))
    blocks = int(median([h["blocks"] for h in s.hits["nixl"]]))
    gbps = median([r["gbps"] for r in s.raw])
    read_ms = nbytes / (gbps * 1e9) * 1000 if gbps else 0.0
    floor_ms = primary_ms + read_ms
    applies = length >= TARGET_FROM_TOKENS
    paths: dict[str, Any] = {}
    for path in PATHS:
        hits = s.hits[path]
        ms = median([h["ms"] for h in hits])
        ratio = ms / floor_ms if floor_ms else 0.0
        paths[path] = {
            "ttft_ms": round(ms, 2),
            "ratio": round(ratio, 3),
            # None: below the target's lengths, or vLLM's tier (shown beside)
            "target_met": ratio <= TARGET_RATIO
            if applies and path != "intree"
            else None,
            "ttft_ms_rounds": [round(h["ms"], 2) for h in hits],
            "bytes": int(median([h["bytes"] for h in hits])),
            "blocks": int(median([h["blocks"] for h in hits])),
            "cached_tokens": int(median([h["cached"] for h in hits])),
            "cached_by_source": cached_by_source(hits[-1]["metrics"]),
            "same_host_reads": int(
                median([_metric(h["metrics"], SAME_HOST_READS) for h in hits])
            ),
            "phases_ms": _phases(hits),
        }
    return {
        "tokens": length,
        "blocks": blocks,
        "bytes": nbytes,
        "primary_ms": round(primary_ms, 2),
        "primary_ms_samples": [round(p["ms"], 2) for p in s.primary],
        "primary_phases_ms": _phases(s.primary),
        "primary_proof": s.proofs[-1] | {"ok": all(p["ok"] for p in s.proofs)},
        "raw_read_gbps": round(gbps, 3),
        "raw_read_gbps_rounds": [round(r["gbps"], 3) for r in s.raw],
        "raw_read_descriptors": s.raw[-1]["descriptors"] if s.raw else 0,
        "read_ms": round(read_ms, 2),
        "floor_ms": round(floor_ms, 2),
        "paths": paths,
        "checks": {
            "primary_hit_from_primary_tier": all(p["ok"] for p in s.proofs),
            "paths_as_configured": s.path_proven,
            "bytes_equal": len({p["bytes"] for p in paths.values()}) == 1,
            "tokens_identical": s.identical,
        },
    }


def run(
    *,
    preset: str = "bench",
    lengths: list[int] | None = None,
    repeats: int = 3,
    progress: bool = True,
) -> dict[str, Any]:
    spec = BENCH if preset == "bench" else TINY
    lengths = lengths or [int(x) for x in LENGTHS.split(",")]
    model = str(ensure_model(spec))
    common = engine_common(spec, lengths)
    # Distinct prompts per round: B must never have seen one before its hit.
    prompts = [
        {
            n: prompt(spec.vocab_size, n, 20_000 * i + 100 + r)
            for i, n in enumerate(lengths)
        }
        for r in range(repeats)
    ]
    samples = {n: _Samples() for n in lengths}
    tag = uuid.uuid4().hex[:6]
    say(progress, "starting raw NIXL workers, A (cpu0) and both B (cpu1)")
    engines: list[EngineProcess] = []
    with RawNixlPair() as raw:
        try:
            # A and the directory's B list each other in ``peers``.
            fleet = {"a": free_port(), "directory": free_port()}
            peers = {"peers": [f"127.0.0.1:{p}" for p in fleet.values()]}
            a = EngineProcess(
                tier_spec(
                    "p2p_kv",
                    model,
                    f"floor-a-{tag}",
                    0,
                    common,
                    port=fleet["a"],
                    **peers,
                )
            )
            engines.append(a)
            consumers: dict[str, EngineProcess] = {}
            for path, options in P2P_PATHS.items():
                name = f"floor-b-{path}-{tag}"
                if path == "directory":
                    options = {**options, "port": fleet["directory"], **peers}
                consumers[path] = EngineProcess(
                    tier_spec("p2p_kv", model, name, 1, common, **options)
                )
                engines.append(consumers[path])
            # Warm-up: open each session and take each B through a
            # primary-tier hit once.
            warm = warm_prompt(spec.vocab_size, lengths)
            produce(a, warm)
            for path, b in consumers.items():
                if path == "directory":
                    heard(b, a, len(warm) // ENGINE_BLOCK - 1)
                    hit(b, warm, None)
                    continue
                hit(
                    b, warm, remote_source(f"floor-warm-{path}-{tag}", producer_port(a))
                )
                b.call({"cmd": "reset"})
                hit(b, warm, None)
            for r in range(repeats):
                _p2p_round(a, consumers, raw, prompts[r], samples, r, progress)
                _intree_round(
                    model, common, prompts[r], samples, spec.vocab_size, r, progress
                )
        finally:
            for e in reversed(engines):
                e.close()
    rows = [_row(n, samples[n]) for n in lengths]
    return {
        "model": spec.name,
        "lengths": lengths,
        "repeats": repeats,
        "target": {"ratio": TARGET_RATIO, "from_tokens": TARGET_FROM_TOKENS},
        "rows": rows,
        "targets": _targets(rows),
    }


def _targets(rows: list[dict[str, Any]]) -> dict[str, bool | None]:
    """Per p2p_kv path: every length from the target's on within the ratio
    (None: no such length was run, so nothing was measured)."""
    out: dict[str, bool | None] = {}
    for path in P2P_PATHS:
        verdicts = [
            r["paths"][path]["target_met"]
            for r in rows
            if r["paths"][path]["target_met"] is not None
        ]
        out[path] = all(verdicts) if verdicts else None
    return out


def print_table(result: dict[str, Any]) -> None:
    head = (
        f"{'tokens':>6} {'blocks':>6} {'MiB':>6} {'primary ms':>10} "
        f"{'raw READ GB/s':>13} {'READ ms':>7} {'floor ms':>8}"
    )
    for path in PATHS:
        head += f" | {LABELS[path] + ' ms':>13} {'x floor':>7}"
        head += f" {'<= ' + format(result['target']['ratio'], 'g') + 'x':>8}"
    print(head)
    for r in result["rows"]:
        line = (
            f"{r['tokens']:>6} {r['blocks']:>6} {r['bytes'] / 2**20:>6.1f} "
            f"{r['primary_ms']:>10.2f} {r['raw_read_gbps']:>13.2f} "
            f"{r['read_ms']:>7.2f} {r['floor_ms']:>8.2f}"
        )
        for path in PATHS:
            c = r["paths"][path]
            verdict = c["target_met"]
            # "-": vLLM's tier (beside, no target) or a length below the target's
            word = "-" if verdict is None else met(verdict)
            line += f" | {c['ttft_ms']:>13.2f} {c['ratio']:>6.2f}x {word:>8}"
        print(line)
    print(
        "\nfloor = primary-tier hit TTFT + bytes at the raw NIXL READ rate "
        "(same run, medians)"
    )
    print("where the time goes (ms, median; engine B's timestamps):")
    for r in result["rows"]:
        cells = {"primary": r["primary_phases_ms"]}
        cells |= {p: r["paths"][p]["phases_ms"] for p in PATHS}
        for name, ph in cells.items():
            text = " ".join(f"{k}={v:g}" for k, v in ph.items())
            print(f"  {r['tokens']:>5} {LABELS.get(name, name):>9}: {text}")
    print()
    for r in result["rows"]:
        proof = r["primary_proof"]
        checks = ", ".join(
            f"{k} {'yes' if v else 'NO'}" for k, v in r["checks"].items()
        )
        print(
            f"{r['tokens']} tokens: primary-tier hit cached {proof['cached_by_source']}, "
            f"{proof['primary_chunk_hits']} primary chunk hits, "
            f"{proof['secondary_queries']} secondary lookups; {checks}"
        )
    target = result["target"]
    for path, verdict in result["targets"].items():
        ratios = ", ".join(
            f"{r['tokens']}: {r['paths'][path]['ratio']:.2f}x"
            for r in result["rows"]
            if r["paths"][path]["target_met"] is not None
        )
        word = "not measured (no such length run)" if verdict is None else met(verdict)
        print(
            f"target: p2p_kv {LABELS[path]} hit <= {target['ratio']:g}x floor from "
            f"{target['from_tokens']:,} tokens: {word}"
            + (f" ({ratios})" if ratios else "")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2p-kv bench floor", description=__doc__)
    parser.add_argument("--lengths", default=LENGTHS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=("bench", "tiny"), default="bench")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(
            f"argument --repeats: {args.repeats!r} is not a count of 1 or more"
        )
    os.environ.setdefault("PYTHONHASHSEED", "0")  # engines must agree on hashes
    t0 = time.monotonic()
    result = run(
        preset=args.model,
        lengths=[int(x) for x in args.lengths.split(",") if x],
        repeats=args.repeats,
        progress=not args.json,
    )
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    ok = all(all(r["checks"].values()) for r in result["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
