"""benchmarks/vs_intree.py on tiny sizes: both tiers really hit, in real engines.

Not a performance test (CI's two cores give no stable numbers): it keeps the
benchmark runnable and proves that what it compares is real -- both tiers
loaded the blocks from A, moved the same bytes for them, and produced the
tokens an engine without any tier computes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_vs_intree_json_both_tiers_hit_with_reference_tokens() -> None:
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "vs_intree.py"),
            *("--model", "tiny", "--lengths", "32,256", "--repeats", "1"),
            *("--idle-s", "0.5", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["tokens"] for r in result["rows"]] == [32, 256]
    assert set(result["tiers"]) == {"intree", "p2p_kv"}
    for row in result["rows"]:
        assert row["recompute_ms"] > 0
        assert row["p2p_kv_speedup_vs_intree"] > 0
        for tier in ("intree", "p2p_kv"):
            cell = row[tier]
            assert cell["identical"] is True, (tier, row)
            # every full block of the prompt came from A
            assert cell["blocks"] == row["tokens"] // 32, (tier, row)
            assert cell["bytes"] > 0 and cell["ttft_ms"] > 0
            assert {"lookup", "fetch", "copy_in"} <= set(cell["phases_ms"]), cell
        assert row["p2p_kv"]["bytes_per_block"] == row["intree"]["bytes_per_block"]
    for tier in ("intree", "p2p_kv"):
        info = result["tiers"][tier]
        assert info["first_hit_new_session"]["blocks"] > 0
        assert info["hit_after_idle"]["blocks"] > 0
        assert set(info["idle"]) == {"A", "B"}
        for engine in info["idle"].values():
            assert engine["cpu_core"] >= 0 and engine["steps_per_s"] >= 0
    assert set(result["targets"]) >= {"idle_cpu_under_5pct", "bytes_per_block_equal"}
