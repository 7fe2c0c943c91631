"""No engine leaves its files in ``/dev/shm``, however it stops.

Real engines, each stopped one way, with ``/dev/shm`` listed around it:

- one SIGKILLed in the middle of its start, after its worker made the
  region's file and before its scheduler mapped it: the one moment a file
  can be left, which the next engine to start removes (``p2p_kv.data.shm_file.sweep``)
  while a file some live process holds stays;
- an OpenAI server (``python -m vllm.entrypoints.openai.api_server``, vLLM's
  three processes) stopped by SIGTERM to its pid alone, which vLLM answers
  by SIGKILLing its engine processes a moment later;
- an in-process engine stopped as the tests stop it (``EngineProcess``),
  after loading the server's blocks through the same-host copy, which opens
  the server's region through ``/proc`` with its name already gone.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2p_kv.adapter.engines import (
    EngineError,
    EngineProcess,
    EngineSpec,
    free_port,
    kv_transfer_config,
)
from p2p_kv.data.shm_file import offload_path
from p2p_kv.tiny_model import TINY, ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def listing() -> dict[str, int]:
    """``/dev/shm``: name to size."""
    out: dict[str, int] = {}
    for entry in os.scandir(SHM):
        with contextlib.suppress(OSError):
            out[entry.name] = entry.stat(follow_symlinks=False).st_size
    return out


def group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(name)) == pgid:
                    pids.append(int(name))
    return pids


def named_shm_files(pgid: int) -> set[str]:
    """Every file under ``/dev/shm`` that still has a name and that a
    process of group ``pgid`` holds open or mapped."""
    found: set[str] = set()
    for pid in group(pgid):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            found.update(line.split(maxsplit=5)[-1].strip() for line in f)
    return {p for p in found if p.startswith(f"{SHM}/") and not p.endswith(")")}


def wait_group_gone(pgid: int, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while group(pgid):
        assert time.monotonic() < end, f"group {pgid} still runs: {group(pgid)}"
        time.sleep(0.1)


#: Engines of :class:`_Starting`, as they send their start.
_starting: list[EngineProcess] = []


class _Starting(EngineProcess):
    """An engine whose handle is known before its start returns."""

    def call(self, msg: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        if msg["cmd"] == "start":
            _starting.append(self)
        return super().call(msg, timeout_s)


def kill_while_starting(model: str, engine_id: str) -> dict[str, int]:
    """Start an engine and SIGKILL it the moment its region's file appears;
    ``/dev/shm`` right after."""
    path = offload_path(engine_id)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            _Starting(EngineSpec(model, engine_id, tier={"port": 0})).close()
        except EngineError as exc:
            errors.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        assert starter.is_alive() and time.monotonic() < deadline, errors
        time.sleep(0.001)
    (engine,) = _starting
    os.killpg(engine.proc.pid, signal.SIGKILL)
    starter.join()
    assert errors, "the engine finished starting though it was killed"
    return listing()


@contextlib.contextmanager
def held_file(name: str) -> Iterator[Path]:
    """A file like an engine's, mapped by a live process for the block."""
    path = SHM / name
    code = (
        "import mmap, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)\n"
        f"os.ftruncate(fd, {mmap.PAGESIZE}); m = mmap.mmap(fd, {mmap.PAGESIZE})\n"
        "os.close(fd); print('ready', flush=True); time.sleep(600)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        yield path
    finally:
        child.kill()
        child.wait()
        path.unlink(missing_ok=True)


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` with p2p_kv."""

    def __init__(self, model: str, engine_id: str, tier_port: int) -> None:
        self.model = model
        self.engine_id = engine_id
        self.port = free_port()
        ktc = kv_transfer_config(
            EngineSpec(model, engine_id, tier={"port": tier_port}, cpu_bytes=64 << 20)
        )
        env = dict(os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.log_path = Path(f"/tmp/p2p_kv-{engine_id}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
                    *("--model", model, "--host", "127.0.0.1"),
                    *("--port", str(self.port), "--block-size", "32"),
                    *("--kv-cache-memory-bytes", str(64 << 20)),
                    *("--max-model-len", "1024", "--enforce-eager", "--seed", "0"),
                    *("--kv-transfer-config", json.dumps(ktc)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 240) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log_path.read_text()[-4000:]
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/health", timeout=2
                ) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(1)
        raise TimeoutError(self.log_path.read_text()[-4000:])

    def complete(self, ids: list[int]) -> Any:
        body = {"model": self.model, "prompt": ids, "max_tokens": 4, "temperature": 0}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def test_no_engine_leaves_its_files_in_shared_memory() -> None:
    model = str(ensure_model(TINY, REPO / ".cache"))
    tag = uuid.uuid4().hex[:6]
    killed_id, server_id, engine_id = (
        f"p2pkv-shm-{what}-{tag}" for what in ("killed", "serve", "engine")
    )
    killed = Path(offload_path(killed_id)).name

    # 1. SIGKILL during the start: the file stays, for the next start.
    before = listing()
    after_kill = kill_while_starting(model, killed_id)
    print(f"\nSIGKILL at start: before {before}\n  after {after_kill}")
    assert killed in after_kill, after_kill
    # (its size is 0 when the kill came before the worker sized it: the
    # sweep must take such a stub too)

    with held_file(f"vllm_offload_p2pkv-shm-held-{tag}.mmap") as held:
        # 2. The next start removes it, saying so; the held file stays.
        pa = free_port()
        server = Server(model, server_id, pa)
        try:
            server.wait_ready()
            running = listing()
            print(f"server running: {running}")
            assert killed not in running, running
            assert held.name in running, running
            log = server.log_path.read_text()
            removed = [ln for ln in log.splitlines() if "p2p_kv: removed" in ln]
            assert len(removed) >= 1, log[-4000:]
            assert any(
                f"removed {SHM / killed} ({after_kill[killed] / (1 << 20):.1f} MiB)"
                in ln
                for ln in removed
            ), removed
            assert not any(held.name in ln for ln in removed), removed
            # The server's region has no name once its processes all map it.
            assert Path(offload_path(server_id)).name not in running, running
            server_files = named_shm_files(server.proc.pid)

            # 3. An engine loads the server's blocks out of its nameless
            # region (same host), then stops as the tests stop engines.
            rng = random.Random(5)
            ids = [rng.randrange(4, TINY.vocab_size) for _ in range(200)]
            server.complete(ids)
            time.sleep(1.0)  # the server stores its blocks at its next steps
            spec = EngineSpec(model, engine_id, tier={"port": 0})
            with EngineProcess(spec) as engine:
                source = {
                    "kv_request_id": f"shm-{tag}",
                    "remote_host": "127.0.0.1",
                    "remote_port": pa,
                }
                out = engine.generate(
                    ids, params={"remote_kv_source": source}, max_tokens=4
                )
                metrics = engine.state()["metrics"]
                engine_files = named_shm_files(engine.proc.pid)
                assert Path(offload_path(engine_id)).name not in listing()
                pgid = engine.proc.pid
            after_stop = listing()
            print(f"engine stopped: {after_stop}")
            wait_group_gone(pgid)
            assert out["cached"] >= 128, out
            reads = sum(
                v
                for k, v in metrics.items()
                if k.startswith("vllm:kv_offload_p2p_same_host_reads")
            )
            assert reads >= 1, metrics
            assert not engine_files & set(f"{SHM}/{n}" for n in after_stop), (
                engine_files,
                after_stop,
            )

            # 4. SIGTERM to the server's pid alone.
            os.kill(server.proc.pid, signal.SIGTERM)
            server.proc.wait(60)
            wait_group_gone(server.proc.pid)
            after_term = listing()
            print(f"server SIGTERM: {after_term}")
            assert Path(offload_path(server_id)).name not in after_term
            assert not server_files & set(f"{SHM}/{n}" for n in after_term), (
                server_files,
                after_term,
            )
        finally:
            server.kill()
        assert held.exists()
