"""A fleet under a workload: ``vllm serve`` engines of the generated model
behind ``vllm-router``, four arms side by side in one run, each workload
the same seeded requests in every arm:

* round robin, p2p_kv off (the baseline every ratio is against);
* cache-aware, p2p_kv off;
* round robin, p2p_kv on (``peers``: the fleet, found in the directory);
* cache-aware, p2p_kv on.

Off is the same engines with the tier absent (the connector and its CPU
tier stay). Each arm and workload runs under its own ``cache_salt``, so no
arm finds what an earlier one computed; the router starts afresh per arm.
Per arm: TTFT p50/p99, completed requests a second at the offered load,
prompt tokens by where they came from (vLLM's
``prompt_tokens_cached_by_source``: the engine's own cache, its CPU tier,
a peer; the rest recomputed), p2p_kv's fallbacks by reason, client errors
and timeouts, and CPU seconds per engine. The fault arm (round robin,
p2p_kv on, the hot set) SIGKILLs one engine halfway: what failed, how long
requests took after, and each survivor's ``request_state`` once idle.

    p2p-kv bench fleet [--engines 4] [--workloads hot,multiturn,uniform]
        [--seconds 60] [--rate 1.5] [--seed 0] [--no-fault] [--plot PNG] [--json]
        [--vllm-spin-ms MS]

``--vllm-spin-ms`` is a diagnostic, not a setting users have: vLLM's
engine core and worker each busy-wait a second after every message they
read, and where engines share cores (four on two here) those spinners
starve the process with work (:mod:`benchmarks.vllm_spin.sitecustomize`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.served import LOG_DIR, Router, ServedEngine, by_label, total
from benchmarks.workloads import WORKLOADS, Stream, Workload, hot, multiturn, uniform
from p2p_kv.tiny_model import BENCH, ensure_model

SERVED_NAME = "fleet"
ARMS = (
    ("round robin, off", "round_robin", False),
    ("cache-aware, off", "cache_aware", False),
    ("round robin, p2p_kv", "round_robin", True),
    ("cache-aware, p2p_kv", "cache_aware", True),
)
#: The tier's lookup deadline in the fleet (``lookup_timeout_s``).
LOOKUP_S = 1.0
REQUEST_TIMEOUT_S = 120.0
FALLBACKS = "vllm:kv_offload_p2p_fallbacks_total"
REQUEST_STATE = "vllm:kv_offload_p2p_request_state"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


@dataclass
class Sent:
    """One request as the client saw it."""

    at: float
    ttft_s: float | None = None
    end: float = 0.0
    error: str = ""
    answer: str = ""


def _send(url: str, prompt: str, salt: str, max_tokens: int) -> Sent:
    """A streamed completion; its time to the first token."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "cache_salt": salt,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    sent = Sent(time.monotonic())
    parts: list[str] = []
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    sent.error = "error"
                    break
                choices = chunk.get("choices") or [{}]
                if sent.ttft_s is None:
                    sent.ttft_s = time.monotonic() - sent.at
                parts.append(choices[0].get("text", ""))
    except TimeoutError:
        sent.error = "timeout"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        sent.error = "timeout" if "timed out" in str(exc) else "error"
    sent.end = time.monotonic()
    if sent.error:
        sent.ttft_s = None
    sent.answer = "".join(parts)
    return sent


def _client(
    stream: Stream,
    url: str,
    salt: str,
    t0: float,
    until: float,
    max_tokens: int,
    out: list[Sent],
) -> None:
    """Send ``stream``'s turns in order (none after ``until``)."""
    time.sleep(max(0.0, t0 + stream.start_s - time.monotonic()))
    prompt = ""
    for i, text in enumerate(stream.turns):
        if i and time.monotonic() >= until:
            return
        prompt = f"{prompt} {text}" if stream.carry and prompt else text
        sent = _send(url, prompt, salt, max_tokens)
        out.append(sent)
        if sent.error:
            return
        if stream.carry:
            prompt += sent.answer
        if i < len(stream.think_s):
            time.sleep(stream.think_s[i])


def drive(url: str, workload: Workload, salt: str, max_tokens: int) -> list[Sent]:
    """Every stream of ``workload`` at its times, through ``url``."""
    out: list[Sent] = []
    t0 = time.monotonic()
    until = t0 + float(workload.params["seconds"])
    threads = [
        threading.Thread(
            target=_client,
            args=(s, url, salt, t0, until, max_tokens, out),
            daemon=True,
        )
        for s in workload.streams
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, until + REQUEST_TIMEOUT_S - time.monotonic()))
    return out


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile, in ms."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return 1e3 * s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def _snapshot(engines: list[ServedEngine]) -> list[dict[str, Any]]:
    snaps = []
    for e in engines:
        if e.proc.poll() is not None:
            snaps.append({"alive": False})
            continue
        m = e.metrics()
        snaps.append(
            {
                "alive": True,
                "prompt": total(m, PROMPT_TOKENS),
                "cached": by_label(m, CACHED_BY_SOURCE, "source"),
                "fallbacks": by_label(m, FALLBACKS, "reason"),
                "cpu_s": e.cpu_s(),
            }
        )
    return snaps


def _settle() -> None:
    """vLLM's stats reach the API server's /metrics every few seconds."""
    time.sleep(6.0)


def summarize(
    sent: list[Sent], before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> dict[str, Any]:
    ok = [s for s in sent if not s.error]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    span = (max(s.end for s in sent) - min(s.at for s in sent)) if sent else 0.0
    tokens = {"prompt": 0.0, "device": 0.0, "host": 0.0, "p2p": 0.0}
    fallbacks: dict[str, float] = {}
    cpu = []
    for b, a in zip(before, after, strict=True):
        if not (b["alive"] and a["alive"]):
            cpu.append(None)
            continue
        tokens["prompt"] += a["prompt"] - b["prompt"]
        for src in ("device", "host", "p2p"):
            tokens[src] += a["cached"].get(src, 0.0) - b["cached"].get(src, 0.0)
        for reason, n in a["fallbacks"].items():
            d = n - b["fallbacks"].get(reason, 0.0)
            if d:
                fallbacks[reason] = fallbacks.get(reason, 0.0) + d
        cpu.append(round(a["cpu_s"] - b["cpu_s"], 1))
    tokens["recomputed"] = tokens["prompt"] - tokens["device"] - tokens["host"]
    tokens["recomputed"] -= tokens["p2p"]
    return {
        "sent": len(sent),
        "completed": len(ok),
        "errors": sum(s.error == "error" for s in sent),
        "timeouts": sum(s.error == "timeout" for s in sent),
        "ttft_p50_ms": _pct(ttft, 0.50),
        "ttft_p99_ms": _pct(ttft, 0.99),
        "ttft_ms": [round(1e3 * t, 2) for t in ttft],
        "completed_per_s": len(ok) / span if span else 0.0,
        "tokens": {k: int(v) for k, v in tokens.items()},
        "fallbacks": {k: int(v) for k, v in fallbacks.items()},
        "cpu_s_per_engine": cpu,
    }


class Fleet:
    """``n`` engines, with the tier (each listing all in ``peers``) or
    without; started one at a time; closed always."""

    def __init__(
        self,
        model: str,
        n: int,
        p2p: bool,
        progress: bool,
        logs: Path,
        vllm_spin_s: float | None = None,
    ) -> None:
        from p2p_kv.adapter.engines import free_port

        self.logs = logs
        self.engines: list[ServedEngine] = []
        ports = [free_port() for _ in range(n)]
        peers = [f"127.0.0.1:{p}" for p in ports]
        try:
            for i, port in enumerate(ports):
                tier = (
                    {"port": port, "peers": peers, "lookup_timeout_s": LOOKUP_S}
                    if p2p
                    else None
                )
                e = ServedEngine(
                    model,
                    f"fleet-{'on' if p2p else 'off'}-{i}",
                    tier=tier,
                    kv_cache_bytes=128 << 20,
                    cpu_bytes=256 << 20,
                    max_model_len=2048,
                    served_name=SERVED_NAME,
                    logs=logs,
                    vllm_spin_s=vllm_spin_s,
                )
                self.engines.append(e)
                e.wait_ready()
                if progress:
                    print(f"  engine {e.name} up at {e.url}", file=sys.stderr)
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def close(self) -> None:
        for e in self.engines:
            e.close()


def run_arm(
    fleet: Fleet,
    policy: str,
    workload: Workload,
    salt: str,
    max_tokens: int,
    kill_at_s: float | None = None,
) -> dict[str, Any]:
    """One arm on one workload: a fresh router, the workload, the deltas."""
    router = Router(f"router-{salt}", policy, fleet.urls, fleet.logs)
    try:
        router.wait_ready()
        before = _snapshot(fleet.engines)
        killer = None
        if kill_at_s is not None:
            victim = fleet.engines[-1]
            killer = threading.Timer(kill_at_s, victim.kill)
            killer.start()
        t0 = time.monotonic()
        sent = drive(router.url, workload, salt, max_tokens)
        _settle()
        after = _snapshot(fleet.engines)
    finally:
        router.close()
    out = summarize(sent, before, after)
    if kill_at_s is not None:
        out["fault"] = _fault(fleet, sent, t0 + kill_at_s)
    return out


def _gauge(engine: ServedEngine, name: str) -> float | None:
    """A gauge's value summed over its series; None where the engine does
    not export it (so a check of it cannot pass for want of the metric)."""
    found = [v for (n, _), v in engine.metrics().items() if n == name]
    return sum(found) if found else None


def _fault(fleet: Fleet, sent: list[Sent], killed_at: float) -> dict[str, Any]:
    """What the kill cost: failures, those in flight at the kill, the
    slowest request sent after it, and each survivor's request_state once
    idle (0: nothing left behind)."""
    in_flight = [s for s in sent if s.at <= killed_at < s.end]
    failed = [s for s in sent if s.error]
    later = [s for s in sent if s.at > killed_at]
    survivors = fleet.engines[:-1]
    state: list[float | None] = []
    end = time.monotonic() + 30
    while True:
        state = [_gauge(e, REQUEST_STATE) for e in survivors]
        if all(v == 0 for v in state) or time.monotonic() > end:
            break
        time.sleep(1.0)
    return {
        "in_flight_at_kill": len(in_flight),
        "failed": len(failed),
        "failed_in_flight_at_kill": sum(1 for s in failed if s in in_flight),
        "failed_sent_after_kill": sum(1 for s in failed if s.at > killed_at),
        "sent_after_kill": len(later),
        "slowest_ttft_after_kill_ms": max(
            (1e3 * s.ttft_s for s in later if s.ttft_s is not None), default=0.0
        ),
        "survivors_request_state": state,
    }


def build(model: str, names: list[str], args: argparse.Namespace) -> list[Workload]:
    common = {"seed": args.seed, "rate": args.rate, "seconds": args.seconds}
    made = {
        "hot": lambda: hot(
            model,
            **common,
            prefixes=args.prefixes,
            prefix_tokens=args.prefix_tokens,
            suffix_tokens=32,
        ),
        "multiturn": lambda: multiturn(
            model, **common, first_tokens=1024, turn_tokens=96, turns=6
        ),
        "uniform": lambda: uniform(model, **common, tokens=args.prefix_tokens + 32),
    }
    return [made[n]() for n in names]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = str(ensure_model(BENCH))
    names = [w for w in args.workloads.split(",") if w]
    workloads = build(model, names, args)
    say = (lambda m: print(m, file=sys.stderr)) if not args.json else (lambda m: None)
    spin_s = None if args.vllm_spin_ms is None else args.vllm_spin_ms / 1000
    if spin_s is not None:
        say(
            f"vLLM's queue readers spin {args.vllm_spin_ms:g} ms after a message "
            "(vLLM's own: 1 s), in every arm"
        )
    for w in workloads:
        say(f"workload {w.describe()}")
    results: dict[str, dict[str, Any]] = {w.name: {} for w in workloads}
    fault: dict[str, Any] | None = None
    for p2p in (False, True):
        say(f"starting {args.engines} engines, p2p_kv {'on' if p2p else 'off'}")
        fleet = Fleet(model, args.engines, p2p, not args.json, Path(args.logs), spin_s)
        try:
            for label, policy, on in ARMS:
                if on != p2p:
                    continue
                for w in workloads:
                    salt = f"{w.name}-{policy}-{p2p}-{args.seed}"
                    say(f"  {label}: {w.name}")
                    results[w.name][label] = run_arm(
                        fleet, policy, w, salt, args.max_tokens
                    )
            if p2p and not args.no_fault and "hot" in names:
                w = next(x for x in workloads if x.name == "hot")
                say("  fault: round robin, p2p_kv, hot set, one engine killed")
                fault = run_arm(
                    fleet,
                    "round_robin",
                    w,
                    f"fault-{args.seed}",
                    args.max_tokens,
                    kill_at_s=args.seconds / 2,
                )
        finally:
            fleet.close()
    return {
        "engines": args.engines,
        "model": "bench-llama (4 layers, hidden 512, fp32)",
        "lookup_timeout_s": LOOKUP_S,
        "vllm_spin_ms": args.vllm_spin_ms,
        "workloads": {w.name: w.params for w in workloads},
        "arms": results,
        "fault": fault,
    }


def table(name: str, arms: dict[str, dict[str, Any]]) -> str:
    base = arms.get(ARMS[0][0])
    against = f": ratios (p50, p99) against '{ARMS[0][0]}', same run" if base else ""
    rows = [
        name + against,
        "| arm | TTFT p50 ms | TTFT p99 ms | completed/s | local tokens "
        "| pulled | recomputed | fallbacks | errors/timeouts | CPU s per engine |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in arms.items():
        t = r["tokens"]
        ratio = ""
        if base and label != ARMS[0][0] and r["ttft_p99_ms"]:
            ratio = (
                f" ({base['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}x, "
                f"{base['ttft_p99_ms'] / r['ttft_p99_ms']:.2f}x)"
            )
        rows.append(
            f"| {label} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f}{ratio} "
            f"| {r['completed_per_s']:.2f} | {t['device'] + t['host']:,} "
            f"| {t['p2p']:,} | {t['recomputed']:,} "
            f"| {', '.join(f'{k} {v}' for k, v in r['fallbacks'].items()) or 0} "
            f"| {r['errors']}/{r['timeouts']} "
            f"| {', '.join(str(c) for c in r['cpu_s_per_engine'])} |"
        )
    return "\n".join(rows)


def plot(result: dict[str, Any], path: str) -> None:
    """TTFT CDF per arm, one panel per workload, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result["arms"]
    fig, axes = plt.subplots(1, len(arms), figsize=(5 * len(arms), 4), squeeze=False)
    for ax, (name, by_arm) in zip(axes[0], arms.items(), strict=True):
        for label, r in by_arm.items():
            xs = sorted(r["ttft_ms"])
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT, ms (log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name}, {result['engines']} engines")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="p2p-kv bench fleet", description=__doc__)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=1.5, help="requests a second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefixes", type=int, default=24)
    p.add_argument("--prefix-tokens", type=int, default=1536)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--no-fault", action="store_true")
    p.add_argument(
        "--vllm-spin-ms",
        type=float,
        default=None,
        help="a diagnostic: vLLM's queue readers busy-wait this long after a "
        "message instead of 1 s, in every arm (benchmarks/vllm_spin)",
    )
    p.add_argument("--plot", default="", help="write the TTFT CDF to this PNG")
    p.add_argument("--json", action="store_true")
    p.add_argument("--logs", default=str(LOG_DIR), help="engines' and routers' logs")
    args = p.parse_args(argv)
    if args.vllm_spin_ms is not None and not 0 <= args.vllm_spin_ms < 1e6:
        p.error(f"--vllm-spin-ms {args.vllm_spin_ms}: give milliseconds, 0 or more")
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}: choose from {WORKLOADS}")
    result = run(args)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
        return 0
    if result["vllm_spin_ms"] is not None:
        print(
            f"vLLM modified for diagnosis, in every arm: its queue readers "
            f"spin {result['vllm_spin_ms']:g} ms after a message, not 1 s\n"
        )
    for name, arms in result["arms"].items():
        print(table(name, arms) + "\n")
    if result["fault"]:
        f = result["fault"]
        print(
            "fault (round robin, p2p_kv, hot set; one engine SIGKILLed halfway): "
            + json.dumps(f["fault"])
        )
        print(table("fault arm", {"round robin, p2p_kv, one killed": f}))
    if args.plot:
        print(f"TTFT CDF: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
