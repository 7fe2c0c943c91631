"""Test-side handle of a :mod:`tests.support.agent` process.

Used by the soak, security and network-namespace tests and by the fallback
benchmark; the same handle runs a peer on loopback or, with ``netns``,
inside a network namespace through ``ip netns exec``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class AgentError(AssertionError):
    pass


class PeerProc:
    def __init__(
        self,
        cfg: dict[str, Any],
        *,
        netns: str | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 60.0,
    ) -> None:
        self.cfg = cfg
        cmd = [sys.executable, "-m", "tests.support.agent", json.dumps(cfg)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), full_env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        full_env.setdefault("PYTHONHASHSEED", "0")
        full_env.update(env or {})
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix=f"p2p_kv-agent-{cfg.get('engine_id', 'x')}-", suffix=".log"
        )
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=ROOT,
            env=full_env,
        )
        self._lines: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        first = self._next(ready_timeout)
        if "ready" not in first:
            raise AgentError(f"agent failed to start:\n{first.get('error')}")
        self.address: str = first["address"]
        self.pid: int = first["pid"]
        self.agent_name: str = first["agent"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def stderr_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return Path(self.log.name).read_text(errors="replace")[-n:]
        return ""

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AgentError(
                f"agent {self.cfg.get('engine_id')} silent for {timeout} s; "
                f"stderr:\n{self.stderr_tail()}"
            ) from None
        if msg is None:
            raise AgentError(
                f"agent {self.cfg.get('engine_id')} exited "
                f"({self.proc.poll()}); stderr:\n{self.stderr_tail()}"
            )
        return msg

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout: float = 60.0) -> Any:
        msg = self._next(timeout)
        if "error" in msg:
            raise AgentError(f"agent command failed:\n{msg['error']}")
        return msg.get("ok")

    def call(self, op: str, timeout: float = 60.0, **kw: Any) -> Any:
        self.send(op, **kw)
        return self.reply(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("stop")
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()
        self.log.close()
