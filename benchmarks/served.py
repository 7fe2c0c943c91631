"""``vllm serve`` engines and a ``vllm-router`` in front of them, as child
processes, the way a fleet runs them: each engine is vLLM's OpenAI server
(its API process, engine core and worker), the router is the Rust binary
of the ``vllm-router`` package, unmodified.

Used by the fleet benchmark (:mod:`benchmarks.fleet`) and its test. The
engines start one at a time: two 3-process engines starting at once on two
cores were seen to stall a worker at start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from p2p_kv.adapter.engines import (
    EngineSpec,
    free_port,
    kv_transfer_config,
    signal_group,
)

REPO = Path(__file__).resolve().parents[1]
#: The folder of the diagnostic that shortens vLLM's queue readers' spin,
#: the variable its ``sitecustomize`` reads (seconds), and what each patched
#: process writes to the engine's log.
SPIN_PATCH = REPO / "benchmarks" / "vllm_spin"
SPIN_ENV = "FLEET_BENCH_VLLM_SPIN_S"
SPIN_MARK = "p2p_kv bench: vLLM's queue readers busy-wait"
#: Where the engines' and the router's logs go unless told (one file each).
LOG_DIR = Path("/tmp/p2p_kv-fleet")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, tuple[tuple[str, str], ...]]


def parse_metrics(text: str) -> dict[Sample, float]:
    """A Prometheus text exposition as ``{(name, labels): value}``."""
    out: dict[Sample, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        with contextlib.suppress(ValueError):
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(samples: dict[Sample, float], name: str, **match: str) -> float:
    """The sum of ``name``'s samples whose labels include ``match``."""
    return sum(
        v
        for (n, labels), v in samples.items()
        if n == name and all((k, w) in labels for k, w in match.items())
    )


def by_label(samples: dict[Sample, float], name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed by one label's value."""
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def _get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


class _Child:
    """A child process in its own session (so a kill takes its whole
    group: vLLM's engine core and worker, the router's threads), its
    output in a log file."""

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], logs: Path
    ) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = logs / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_http(self, url: str, timeout_s: float) -> None:
        """Until ``url`` answers 200; fail with the log's tail if the
        process exits or the time runs out."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            with contextlib.suppress(OSError):
                _get(url, 2.0)
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not answer {url}:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the whole group, as a crashed host or OOM kill would."""
        signal_group(self.proc, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; always closes the log."""
        if self.proc.poll() is None:
            signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        # What the group left (a worker that outlived its API process).
        signal_group(self.proc, signal.SIGKILL)
        self._log.close()


class ServedEngine(_Child):
    """One ``vllm serve`` engine of the generated model, with p2p_kv's tier
    (``tier``: its keys) or with the connector and its CPU tier alone
    (``tier`` None: the same engine with the tier absent). ``vllm_spin_s``:
    how long vLLM's queue readers busy-wait after a message (vLLM's own
    second where None; :mod:`benchmarks.vllm_spin.sitecustomize` says why)."""

    def __init__(
        self,
        model: str,
        name: str,
        *,
        tier: dict[str, Any] | None,
        kv_cache_bytes: int,
        cpu_bytes: int,
        max_model_len: int,
        served_name: str,
        logs: Path = LOG_DIR,
        vllm_spin_s: float | None = None,
    ) -> None:
        self.port = free_port()
        self.engine_id = f"{name}-{os.getpid()}"
        self.tier_port = int(tier["port"]) if tier else 0
        spec = EngineSpec(model, self.engine_id, tier=tier, cpu_bytes=cpu_bytes)
        env = engine_env(vllm_spin_s)
        self.vllm_spin_s = vllm_spin_s
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", model, "--served-model-name", served_name]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--block-size", "32", "--kv-cache-memory-bytes", str(kv_cache_bytes)]
        cmd += ["--max-model-len", str(max_model_len), "--dtype", "float32"]
        cmd += ["--enforce-eager", "--seed", "0"]
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec))]
        super().__init__(name, cmd, env, logs)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until it serves; then, if its queue readers' spin was set, that
        the patch took in its processes (they say so in its log)."""
        self.wait_http(self.url + "/health", timeout_s)
        log = self.log_path.read_text(errors="replace")
        if self.vllm_spin_s is not None and SPIN_MARK not in log:
            raise RuntimeError(
                f"{self.name}: --vllm-spin-ms did not take ({SPIN_PATCH}'s "
                f"sitecustomize did not run, or no longer finds vLLM's "
                f"SpinCondition): see {self.log_path}"
            )

    def metrics(self) -> dict[Sample, float]:
        return parse_metrics(_get(self.url + "/metrics", 10.0))

    def cpu_s(self) -> float:
        """CPU seconds of the engine's processes (API server, engine core,
        worker), children included."""
        import psutil

        spent = 0.0
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    spent += t.user + t.system
        return spent

    def close(self) -> None:
        super().close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/vllm_offload_{self.engine_id}.mmap")


def engine_env(vllm_spin_s: float | None = None) -> dict[str, str]:
    """The environment of a ``vllm serve`` engine: the repository's
    ``src`` on ``PYTHONPATH``; with ``vllm_spin_s``, also
    ``benchmarks/vllm_spin``, whose ``sitecustomize`` makes vLLM's queue
    readers busy-wait that long after a message instead of a second."""
    env = dict(os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    env.pop(SPIN_ENV, None)
    paths = [str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])]
    if vllm_spin_s is not None:
        paths.insert(0, str(SPIN_PATCH))
        env[SPIN_ENV] = str(vllm_spin_s)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def router_binary() -> str:
    """The ``vllm-router`` binary beside this Python (``make install``
    installs it), else on PATH."""
    here = Path(sys.executable).with_name("vllm-router")
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if not found:
        raise RuntimeError(
            "vllm-router is not installed: run `make install` (the dev extra "
            "pins vllm-router, the router's own binary)"
        )
    return found


class Router(_Child):
    """``vllm-router --worker-urls ... --policy POLICY``: what a fleet runs
    in front of its engines, unmodified."""

    def __init__(
        self, name: str, policy: str, workers: list[str], logs: Path = LOG_DIR
    ) -> None:
        self.port = free_port()
        cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--policy", policy, "--worker-urls", *workers]
        cmd += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
        super().__init__(name, cmd, dict(os.environ), logs)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        self.wait_http(self.url + "/health", timeout_s)
