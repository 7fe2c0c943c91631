"""docs/two_hosts.md, run as written between two "hosts".

Two network namespaces on a bridge stand in for the hosts: each has one
link named ``eth0`` with the page's address (``10.0.0.5``, ``10.0.0.6``;
they exist only inside the namespaces). Every ``bash`` block of the page
is marked either ``<!-- run: NAME -->`` (run here, as written, by the
block's role) or ``<!-- not run: WHY -->`` (the GPU variant); an unmarked
one fails the test, so no command on the page goes untried.

What it shows: engine B loads A's blocks over the veth (the tier's
counters at B's ``/metrics`` name ``10.0.0.5:5800``, and no same-host copy
was made: namespaces cannot prove a shared-memory peer), both answers are
the same text, and every TCP port the engines listen on, other than on
loopback, is one the page's table names. Needs root for the namespaces,
as the other namespace tests: fails without it, never skips.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support.docs import marked_blocks, venv_env
from tests.support.netns import Hosts

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "two_hosts.md"
ADDRS = ("10.0.0.5", "10.0.0.6")
#: Ports the page's table names: control, the UCX range, the API.
NAMED = {5800, 8000, *range(40000, 40100)}


def blocks() -> dict[str, str]:
    """The page's ``bash`` blocks to run, by role; every one is marked."""
    return {
        mark.removeprefix("run: "): body
        for mark, body in marked_blocks("two_hosts.md")
        if mark.startswith("run: ")
    }


def test_every_block_is_run_or_says_why_not() -> None:
    assert set(blocks()) == {"secret", "host-a", "host-b", "client", "metrics"}
    text = PAGE.read_text()
    assert "<!-- not run: GPU -->" in text
    for port in ("5800", "40000", "8000", "UCX_TCP_PORT_RANGE", "UCX_NET_DEVICES"):
        assert port in text


class Engine:
    """A host block run in its namespace (doctor, then ``vllm serve``)."""

    def __init__(self, ns: str, script: str, cwd: Path, env: dict[str, str]) -> None:
        self.log = cwd / f"{ns}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, "bash", "-e", "-c", script],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C, as the page says
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def in_ns(hosts: Hosts, i: int, script: str, cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(
        ["ip", "netns", "exec", hosts.names[i], "bash", "-e", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, f"{script!r} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def wait_ready(hosts: Hosts, i: int, engine: Engine, env: dict[str, str]) -> None:
    url = f"http://{ADDRS[i]}:8000/health"
    end = time.monotonic() + 300
    while time.monotonic() < end:
        ok = subprocess.run(
            ["ip", "netns", "exec", hosts.names[i], "curl", "-sf", url],
            capture_output=True,
            env=env,
            check=False,
        )
        if ok.returncode == 0:
            return
        assert engine.proc.poll() is None, f"engine exited:\n{engine.tail()}"
        time.sleep(1)
    raise AssertionError(f"engine did not start in 300 s:\n{engine.tail()}")


def listening(hosts: Hosts, i: int) -> set[int]:
    """TCP ports listened on in namespace ``i`` other than on loopback."""
    out = subprocess.run(
        ["ip", "netns", "exec", hosts.names[i], "ss", "-tlnH"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ports = set()
    for line in out.splitlines():
        local = line.split()[3]
        addr, port = local.rsplit(":", 1)
        if addr.strip("[]").split("%")[0] in ("127.0.0.1", "::1"):
            continue
        ports.add(int(port))
    return ports


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with Hosts(2, subnet="10.0.0", first=5, ifname="eth0") as made:
        yield made


def test_the_walkthrough_runs_as_written(hosts: Hosts) -> None:
    steps = blocks()
    engines: list[Engine] = []
    with tempfile.TemporaryDirectory(prefix="p2p_kv-two-hosts-") as tmp_name:
        tmp = Path(tmp_name)
        env = venv_env(tmp)
        try:
            subprocess.run(["bash", "-e", "-c", steps["secret"]], cwd=tmp, check=True)
            assert len((tmp / "p2p_kv.secret").read_text().strip()) == 64
            for i, role in enumerate(("host-a", "host-b")):
                engine = Engine(hosts.names[i], steps[role], tmp, env)
                engines.append(engine)
                wait_ready(
                    hosts, i, engine, env
                )  # one at a time, as a small host needs
                assert "all checks passed" in engine.log.read_text(), engine.tail()
            answers = in_ns(hosts, 1, steps["client"], tmp, env)
            texts = re.findall(r'"text":\s*"((?:[^"\\]|\\.)*)"', answers)
            assert len(texts) == 2 and texts[0] == texts[1], answers
            end = time.monotonic() + 60
            while True:
                got = subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        hosts.names[1],
                        "bash",
                        "-c",
                        steps["metrics"],
                    ],
                    cwd=tmp,
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout
                if "loaded_bytes" in got or time.monotonic() > end:
                    break
                time.sleep(2)
            print(f"\n{got}")
            series = dict(
                re.findall(
                    r'^(vllm:\S+)\{.*peer="10\.0\.0\.5:5800".*\} (\S+)$', got, re.M
                )
            )
            assert float(series["vllm:kv_offload_p2p_loaded_bytes_total"]) > 0, got
            assert float(series["vllm:kv_offload_p2p_lookup_hit_blocks_total"]) > 0, got
            full = in_ns(hosts, 1, "curl -s http://10.0.0.6:8000/metrics", tmp, env)
            same_host = re.findall(
                r"^vllm:kv_offload_p2p_same_host_reads_total\{.*\} (\S+)$", full, re.M
            )
            assert all(float(v) == 0 for v in same_host), same_host
            for i in range(2):
                assert listening(hosts, i) <= NAMED, (i, listening(hosts, i))
            assert 5800 in listening(hosts, 0) and 8000 in listening(hosts, 0)
            assert listening(hosts, 0) & set(range(40000, 40100)), listening(hosts, 0)
        finally:
            for engine in reversed(engines):
                engine.stop()
            ports_after = [listening(hosts, i) for i in range(2)]
            left_in_shm = [
                name
                for name in ("host-a", "host-b")
                if Path(f"/dev/shm/vllm_offload_{name}.mmap").exists()
            ]
            for name in ("host-a", "host-b"):
                Path(f"/dev/shm/vllm_offload_{name}.mmap").unlink(missing_ok=True)

    # Ctrl-C, as the page says: no engine left, no file, no port held.
    for engine in engines:
        assert engine.proc.returncode is not None
    assert left_in_shm == [], left_in_shm
    assert ports_after == [set(), set()], ports_after
