"""A StandalonePeer in its own process, driven by JSON lines on stdin.

Run as ``python -m tests.support.agent '<config json>'``, possibly under
``ip netns exec``: that is why this is a command and not a multiprocessing
target (a spawned child cannot be started inside another network
namespace). The process steps its peer continuously, the way an engine
does, and answers one command at a time between steps; replies go to the
original stdout, everything else that libraries print goes to stderr.

Config keys: ``engine_id``, ``host``, ``port``, ``num_blocks``, ``nofile``
(``RLIMIT_NOFILE`` to run under),
``block_bytes``, ``fill`` (blocks ``make_key(0..fill-1)``, shuffled slots),
``secret`` (hex), ``timeouts`` (Timeouts fields), ``control_faults`` /
``data_faults`` (see :mod:`tests.support.faults`), ``seed``,
``events_path`` (a file the agent appends a line to whenever it stalls a
transfer, so a test knows a load is in flight while the agent is busy).

Commands (``{"op": ...}``): ``report``, ``faults``, ``fetch``, ``idle``,
``stop``. Every step's duration is recorded, so a test can show that the
poll loop never hung, whatever the network did.
"""

from __future__ import annotations

import json
import os
import resource
import select
import sys
import time
import traceback
import zlib
from typing import Any

import numpy as np

from p2p_kv.peer import Timeouts
from p2p_kv.runtime.standalone import StandalonePeer, block_pattern, make_key
from tests.support.faults import ControlFaults, DataFaults, install


def expected_crc(key_index: int, block_bytes: int) -> int:
    """What a block filled by :meth:`StandalonePeer.fill` checksums to."""
    return zlib.crc32(memoryview(block_pattern(make_key(key_index), block_bytes)))


class Agent:
    def __init__(self, cfg: dict[str, Any]) -> None:
        nofile = cfg.get("nofile")
        if nofile:  # an engine with few descriptors to spare
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
        secret = cfg.get("secret")
        self.peer = StandalonePeer(
            cfg["num_blocks"],
            cfg["block_bytes"],
            engine_id=cfg["engine_id"],
            host=cfg.get("host", "127.0.0.1"),
            port=cfg.get("port", 0),
            secret=bytes.fromhex(secret) if secret else None,
            timeouts=Timeouts(**cfg.get("timeouts", {})),
            idle_wait_s=cfg.get("idle_wait_s", 0.01),
            same_host=cfg.get("same_host", True),
        )
        self.control, self.data = install(
            self.peer.runtime,
            ControlFaults.from_dict(cfg.get("control_faults", {})),
            DataFaults.from_dict(cfg.get("data_faults", {})),
            seed=cfg.get("seed", 0),
        )
        events = cfg.get("events_path")
        if events:

            def note(op: str) -> None:
                with open(events, "a") as f:
                    f.write(f"stall {op} {time.monotonic()}\n")

            self.data.on_stall = note
        fill = cfg.get("fill", 0)
        if fill:
            rng = np.random.default_rng(cfg.get("seed", 0))
            slots = rng.permutation(cfg["num_blocks"])[:fill].tolist()
            self.peer.fill([make_key(k) for k in range(fill)], slots)
        self.max_step_s = 0.0
        self.steps = 0
        self.last_result_t = 0.0
        self._orig_step = self.peer.step
        self.peer.step = self._timed_step  # type: ignore[method-assign]

    def _timed_step(self, wait: bool | None = None) -> list[Any]:
        t0 = time.monotonic()
        results = self._orig_step(wait)
        t1 = time.monotonic()
        self.steps += 1
        self.max_step_s = max(self.max_step_s, t1 - t0)
        if results:
            self.last_result_t = t1
        return results

    # -- commands ---------------------------------------------------------

    def report(self) -> dict[str, Any]:
        m, rt = self.peer.manager, self.peer.runtime
        session_errors: dict[str, int] = {}
        for s in [*m.sessions(), *m.retired_sessions]:
            for k, v in s.link.counters.protocol_errors.items():
                session_errors[k] = session_errors.get(k, 0) + v
        out = {
            "state": m.state_report(),
            "xfers": rt.transfers_in_flight,
            "nixl_in_flight": int(self.data.inner.in_flight()),
            "fault_handles": self.data.handles(),
            "faults": {
                "control": self.control.counts.as_dict(),
                "data": self.data.counts.as_dict(),
            },
            "protocol_errors": dict(m.protocol_errors),
            "session_errors": session_errors,
            "refusals": [[*k, v] for k, v in m.refusals.items()],
            "fallbacks": dict(m.fallbacks),
            "double_results": m.double_results,
            "pinned": len(self.peer.pinner.pinned),
            "max_step_s": self.max_step_s,
            "steps": self.steps,
            "rss": _rss(),
            "fds": len(os.listdir("/proc/self/fd")),
            "can_open": _can_open(),
            "control": dict(self.control.counters),
            "sessions": len(m.sessions()),
            "agents": len(self.data.inner.peers()),
        }
        self.max_step_s = 0.0
        return out

    def faults(self, control: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        if control is not None:
            self.control.faults = ControlFaults.from_dict(control)
        if data is not None:
            self.data.faults = DataFaults.from_dict(data)
        return {}

    def fetch(
        self,
        peer: str,
        kv_id: str,
        keys: list[int],
        slots: list[int],
        timeout_s: float = 10.0,
        probe: bool = True,
    ) -> dict[str, Any]:
        p = self.peer
        self.max_step_s = 0.0
        rows = np.asarray(p.region).reshape(-1, p.block_bytes)
        rows[slots] = 0xAB
        t0 = time.monotonic()
        out = p.fetch(
            peer,
            kv_id,
            [make_key(k) for k in keys],
            slots,
            timeout_s=timeout_s,
            probe=probe,
        )
        bad = [
            s
            for k, s in zip(keys, slots, strict=True)
            if zlib.crc32(memoryview(rows[s])) != expected_crc(k, p.block_bytes)
        ]
        return {
            "hits": out.hits,
            "ok": out.ok,
            "job_done": out.job_done,
            "lookup_s": out.lookup_s,
            "total_s": out.total_s,
            "t_start": t0,
            "t_result": self.last_result_t,
            "t_end": time.monotonic(),
            "bad_slots": bad,
            "max_step_s": self.max_step_s,
        }

    def close_session(self, peer: str) -> dict[str, Any]:
        """Drop our session keyed ``peer`` (an outbound one: the address)."""
        closed = self.peer.manager.peers.close_session(peer, "closed by test")
        self.peer.runtime.pump()
        return {"closed": closed}

    def idle(self, seconds: float) -> dict[str, Any]:
        self.max_step_s = 0.0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.peer.step()
        return {"max_step_s": self.max_step_s}


def _can_open() -> bool:
    """Whether this process can still open a file (its descriptors are not
    all taken)."""
    try:
        os.close(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        return False
    return True


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> int:
    cfg = json.loads(sys.argv[1])
    # Replies get a private copy of stdout; whatever NIXL, UCX or anything
    # else prints goes to stderr instead of corrupting the reply stream.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def say(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")

    try:
        agent = Agent(cfg)
    except BaseException:
        say({"error": traceback.format_exc()})
        return 1
    say(
        {
            "ready": True,
            "address": agent.peer.address,
            "pid": os.getpid(),
            "agent": agent.data.inner.agent_name,
        }
    )
    buf = b""
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], 0)
        if readable:
            chunk = os.read(stdin, 1 << 16)
            if not chunk:
                break  # the test went away
            buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "stop":
                agent.peer.close()
                say({"stopped": True})
                return 0
            try:
                say({"ok": getattr(agent, op)(**cmd)})
            except Exception:
                say({"error": traceback.format_exc()})
        agent.peer.step()
    agent.peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
