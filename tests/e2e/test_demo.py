"""`p2p-kv demo --json` on small sizes: real engines, real transfers; the
text report rendered from the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from p2p_kv.demo import print_table

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_json_reports_identical_outputs_and_remote_hits(
    capsys: pytest.CaptureFixture[str],
) -> None:
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
            "2",
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
    assert result["repeats"] == 2
    assert [r["tokens"] for r in result["rows"]] == [64, 256]
    for row in result["rows"]:
        # Each row: its repeats, their spread, and whether they disagree.
        assert len(row["ttft_remote_samples_ms"]) == 2
        assert len(row["ttft_recompute_samples_ms"]) == 2
        for what in ("remote", "recompute"):
            samples = sorted(row[f"ttft_{what}_samples_ms"])
            low, high = row[f"ttft_{what}_ms_range"]
            assert [low, high] == pytest.approx(samples, abs=0.06), row
            # (the range is of the samples as reported, to 0.01 ms, then
            # rounded to 0.1: 9.454 is reported 9.45, whose range ends at
            # 9.4)
            assert low - 0.06 <= row[f"ttft_{what}_ms"] <= high + 0.06, row
        low, high = row["speedup_range"]
        assert 0 < low <= high, row
        assert isinstance(row["disagree"], str)

    print_table(result)
    out = capsys.readouterr().out.splitlines()
    assert out[-1].endswith("leftover state: none"), out
    head = next(i for i, line in enumerate(out) if line.startswith("speedup = "))
    assert out[head].endswith("median of 2 repeats (min-max in brackets)")
    bars = out[head + 1 : head + 3]
    assert [line.split()[0] for line in bars] == ["64", "256"]
    blocks = {chr(c) for c in range(0x2588, 0x2590)}  # a bar's characters
    assert all(blocks & set(line) and " hit " in line for line in bars), bars
    flagged = [r["tokens"] for r in result["rows"] if r["disagree"]]
    assert [b.endswith(" !") for b in bars] == [
        r["tokens"] in flagged for r in result["rows"]
    ]
