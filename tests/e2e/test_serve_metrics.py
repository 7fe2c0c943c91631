"""Two `vllm serve` engines (vLLM's default 3-process engine, OpenAI API):
B loads A's KV through p2p_kv via the request body's kv_transfer_params, and
B's /metrics endpoint carries p2p_kv's per-peer series, and every metric
the shipped dashboard, alert rules and docs/observability.md name."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.unit.test_observability import SUFFIXES, referenced

from p2p_kv.adapter.engines import EngineSpec, free_port, kv_transfer_config
from p2p_kv.tiny_model import TINY, ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


class Server:
    def __init__(self, model: str, name: str, tier_port: int) -> None:
        self.model = model
        self.port = free_port()
        self.engine_id = f"serve-{name}-{uuid.uuid4().hex[:6]}"
        ktc = kv_transfer_config(
            EngineSpec(
                model, self.engine_id, tier={"port": tier_port}, cpu_bytes=64 << 20
            )
        )
        env = dict(os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.log = open(f"/tmp/p2p_kv-{self.engine_id}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model,
                "--port",
                str(self.port),
                "--host",
                "127.0.0.1",
                "--block-size",
                "32",
                "--kv-cache-memory-bytes",
                str(64 << 20),
                "--max-model-len",
                "1024",
                "--enforce-eager",
                "--seed",
                "0",
                "--kv-transfer-config",
                json.dumps(ktc),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout_s: float = 240) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.tail()
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url("/health"), timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(1)
        raise TimeoutError(self.tail())

    def tail(self) -> str:
        return Path(self.log.name).read_text()[-4000:]

    def complete(self, ids: list[int], params: dict[str, Any] | None = None) -> Any:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 4,
            "temperature": 0,
        }
        if params:
            body["kv_transfer_params"] = params
        req = urllib.request.Request(
            self.url("/v1/completions"),
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as r:
            return str(r.read().decode())

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/vllm_offload_{self.engine_id}.mmap")


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server, int]]:
    model = str(ensure_model(TINY, REPO / ".cache"))
    # One at a time: two 3-process engines starting at once on two cores
    # were seen to stall a worker at start-up.
    # Each port is chosen just before its server starts (a port chosen
    # earlier can be taken by the other engine's start-up meanwhile).
    pa = free_port()
    a = Server(model, "a", pa)
    servers = [a]
    try:
        a.wait_ready()
        b = Server(model, "b", free_port())
        servers.append(b)
        b.wait_ready()
        yield a, b, pa
    finally:
        for server in reversed(servers):
            server.close()


def test_remote_hit_through_openai_api_and_metrics_endpoint(
    servers: tuple[Server, Server, int],
) -> None:
    a, b, pa = servers
    rng = random.Random(3)
    ids = [rng.randrange(4, TINY.vocab_size) for _ in range(200)]
    out_a = a.complete(ids)
    time.sleep(1.0)  # A's engine stores its blocks at its next steps
    params = {
        "remote_kv_source": {
            "kv_request_id": "serve-1",
            "remote_host": "127.0.0.1",
            "remote_port": pa,
        }
    }
    out_b = b.complete(ids, params)
    assert out_b["choices"][0]["text"] == out_a["choices"][0]["text"]
    text = wait_loaded_past(a, b, pa, 0.0)
    peer = f'peer="127.0.0.1:{pa}"'
    hits = [
        ln
        for ln in text.splitlines()
        if ln.startswith("vllm:kv_offload_p2p_lookup_hit_blocks") and peer in ln
    ]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 4, hits


def exported_series(text: str) -> set[str]:
    """Series names a /metrics text exports: those with samples, and those
    a metric with no sample yet will have (its # TYPE line only)."""
    names: set[str] = set()
    for ln in text.splitlines():
        if ln.startswith("# TYPE "):
            family, kind = ln.split()[2:4]
            if kind == "counter":
                family = family.removesuffix("_total")
            names.update(family + s for s in SUFFIXES.get(kind, ("",)))
        elif ln and not ln.startswith("#"):
            names.add(ln.split("{", 1)[0].split(" ", 1)[0])
    return names


def test_every_metric_the_dashboard_and_alerts_name_is_exported(
    servers: tuple[Server, Server, int],
) -> None:
    """The Grafana dashboard, the alert rules and the docs' PromQL query
    what a real engine exports at /metrics, with vLLM's spelling."""
    for server in servers[:2]:
        exported = exported_series(server.metrics())
        for source, names in referenced().items():
            missing = sorted(names - exported)
            assert not missing, f"{server.engine_id} lacks {missing} ({source})"


def loaded_bytes(text: str, pa: int) -> float:
    """B's bytes loaded from the peer at port ``pa``, from /metrics text."""
    peer = f'peer="127.0.0.1:{pa}"'
    for ln in text.splitlines():
        if ln.startswith("vllm:kv_offload_p2p_loaded_bytes") and peer in ln:
            return float(ln.rsplit(" ", 1)[1])
    return 0.0


def wait_loaded_past(
    a: Server, b: Server, pa: int, before: float, reach: float = 0.0
) -> str:
    """B's /metrics text once its bytes loaded from A exceed ``before``,
    and reach ``reach`` if given (stats reach the API server every few
    seconds, so one request's loads may show in two reports); else fail
    saying why."""
    deadline = time.monotonic() + 30
    while True:
        text = b.metrics()
        loaded = loaded_bytes(text, pa)
        if loaded > before and loaded >= reach:
            return text
        if time.monotonic() >= deadline:
            p2p = [
                ln for ln in text.splitlines() if ln.startswith("vllm:kv_offload_p2p_")
            ]
            raise AssertionError(
                f"B loaded {loaded:.0f} bytes from A (wanted past {before:.0f}"
                f" and at least {reach:.0f}); B's p2p metrics:\n"
                + "\n".join(p2p)
                + f"\n--- A's log tail ---\n{a.tail()}\n--- B's log tail ---\n"
                + b.tail()
            )
        time.sleep(1)


def cpu_of(server: Server, seconds: float) -> float:
    """Cores' worth of CPU that all of a server's processes used."""
    import psutil

    root = psutil.Process(server.proc.pid)
    procs = [root, *root.children(recursive=True)]
    before = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    time.sleep(seconds)
    return sum(sum(p.cpu_times()[:2]) - before[p.pid] for p in procs) / seconds


def test_disaggregated_prefill_parks_while_idle_then_serves(
    servers: tuple[Server, Server, int],
) -> None:
    """A prefills for B (``remote_decoder``) and holds the stores parked for
    it: vLLM counts them as jobs in flight and kept A's engine (and so its
    worker) stepping flat out; A must idle meanwhile, and B's Fetch must
    still be served by A's sleeping engine."""
    a, b, pa = servers
    rng = random.Random(11)
    ids = [rng.randrange(4, TINY.vocab_size) for _ in range(160)]
    decoder = {"remote_decoder": {"kv_request_id": "serve-pd"}}
    prefiller = {
        "remote_prefiller": {
            "kv_request_id": "serve-pd",
            "remote_host": "127.0.0.1",
            "remote_port": pa,
        }
    }
    before = loaded_bytes(b.metrics(), pa)
    out_a = a.complete(ids, decoder)
    time.sleep(1.5)  # the worker's one-second spin after A's last step
    used = cpu_of(a, 2.0)
    print(f"A holding a parked store, all processes: {used:.1%} of a core")
    # A spin detector (without the sleep at a step: 131.5%), not a speed
    # target: a CI runner may take twice this machine's 1-2%.
    assert used < 0.25, f"{used:.1%} of a core"
    out_b = b.complete(ids, prefiller)
    assert out_b["choices"][0]["text"] == out_a["choices"][0]["text"]
    wait_loaded_past(a, b, pa, before)


def test_idle_three_process_engine_stays_idle(
    servers: tuple[Server, Server, int],
) -> None:
    """vLLM's default engine: the worker busy-loops for a second after every
    engine step, so a tier that keeps the engine stepping costs a core. Ours
    lets it sleep and answers peers from its own thread."""
    a, b, pa = servers
    time.sleep(2.0)  # let the last request's work settle
    used = cpu_of(a, 4.0)
    print(f"idle vllm serve with p2p_kv, all processes: {used:.1%} of a core")
    # Kept stepping, the worker's busy loop costs about a core (105%); idle,
    # 4-5.5% here (vLLM's own processes included), so 5% failed on noise,
    # and a CI runner may take twice that: this bound detects the spin.
    # The idle figure itself is measured by `p2p-kv bench vs_intree`.
    assert used < 0.25, f"{used:.1%} of a core"
    # ...and it still answers a peer at once: B's lookup is served by A's waker.
    rng = random.Random(4)
    ids = [rng.randrange(4, TINY.vocab_size) for _ in range(100)]
    a.complete(ids)
    time.sleep(1.0)
    t0 = time.monotonic()
    out = b.complete(
        ids,
        {
            "remote_kv_source": {
                "kv_request_id": "serve-idle",
                "remote_host": "127.0.0.1",
                "remote_port": pa,
            }
        },
    )
    assert out["choices"][0]["text"]
    print(f"B's request with a remote hit from idle A: {time.monotonic() - t0:.3f} s")
