"""`p2p-kv demo --json` on small sizes: real engines, real transfers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_json_reports_identical_outputs_and_remote_hits() -> None:
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2p_kv.demo",
            "--model",
            "tiny",
            "--lengths",
            "64,256",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["outputs_identical"] is True
    assert result["remote_hit_blocks"] > 0 and result["bytes_fetched"] > 0
    assert result["residue"] == {"A": {}, "B": {}}
    assert [r["tokens"] for r in result["rows"]] == [64, 256]
