"""``p2p-kv bench floor`` on a tiny configuration, in real engines.

Not a performance test (two shared cores give no stable numbers): it keeps
the benchmark runnable from the CLI and proves that what it compares is
real -- the primary-tier hit came from B's primary tier, the NIXL path went
through NIXL and the same-host path did not, every path moved the same
bytes and produced A's tokens -- and that the floor and the ratios are what
their parts say.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PATHS = ("nixl", "same_host", "directory", "intree")


def test_bench_floor_measures_every_path_against_its_floor(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("p2p-kv")
    out = subprocess.run(
        [
            *(str(exe), "bench", "floor", "--model", "tiny"),
            *("--lengths", "256", "--repeats", "1", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # not the checkout: the CLI finds benchmarks/ itself
        env=dict(os.environ, PYTHONHASHSEED="0"),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["target"] == {"ratio": 1.2, "from_tokens": 1024}
    (row,) = result["rows"]
    assert row["tokens"] == 256 and row["blocks"] == 256 // 32, row
    assert row["bytes"] > 0 and row["bytes"] % row["blocks"] == 0, row
    assert all(row["checks"].values()), row["checks"]
    # The primary-tier hit: every cached token from host memory, every
    # block a hit of the primary tier, no secondary tier asked.
    proof = row["primary_proof"]
    assert proof["ok"] and proof["cached_by_source"] == {"host": 256}, proof
    assert proof["primary_chunk_hits"] == row["blocks"], proof
    assert proof["secondary_queries"] == proof["secondary_read_bytes"] == 0, proof
    assert row["primary_ms"] > 0 and row["raw_read_gbps"] > 0, row
    assert row["floor_ms"] == pytest.approx(
        row["primary_ms"] + row["read_ms"], abs=0.02
    )
    assert row["read_ms"] == pytest.approx(
        row["bytes"] / (row["raw_read_gbps"] * 1e9) * 1000, rel=0.01, abs=0.01
    )
    assert set(row["paths"]) == set(PATHS)
    for path in PATHS:
        cell = row["paths"][path]
        assert cell["bytes"] == row["bytes"] and cell["blocks"] == row["blocks"]
        assert cell["ttft_ms"] > 0, cell
        assert cell["ratio"] == pytest.approx(
            cell["ttft_ms"] / row["floor_ms"], rel=0.01
        )
        assert cell["target_met"] is None, cell  # 256 tokens: below the target's
    assert row["paths"]["nixl"]["same_host_reads"] == 0
    assert row["paths"]["same_host"]["same_host_reads"] > 0
    assert row["paths"]["nixl"]["cached_by_source"] == {"p2p": 256}
    assert result["targets"] == {"nixl": None, "same_host": None, "directory": None}
    # The fetch phase split by the engine's own timestamps: the NIXL path
    # READs (posts timed) into staging and copies out of it; the same-host
    # path copies out of A's region and posts nothing.
    nixl, same = (
        row["paths"]["nixl"]["phases_ms"],
        row["paths"]["same_host"]["phases_ms"],
    )
    for ph in (nixl, same):
        assert ph["fetch"] > 0 and ph["in_submit"] > 0 and ph["to_result"] >= 0, ph
        assert ph["in_submit"] <= ph["fetch"] + 0.01, ph
    assert nixl["read_posts"] > 0 and nixl["staging_copy"] > 0, nixl
    assert "same_host_copy" not in nixl, nixl
    assert same["same_host_copy"] > 0 and "read_posts" not in same, same
    # A request naming no source is answered from the directory: no lookup
    # answered RETRY (a named source's first answer is), so no step waits
    # on a round trip before vLLM allocates the hit's slots.
    found = row["paths"]["directory"]["phases_ms"]
    assert "lookup" in nixl and "lookup" not in found, (nixl, found)
    assert row["paths"]["directory"]["same_host_reads"] == 0
    assert row["paths"]["directory"]["cached_by_source"] == {"p2p": 256}

    # The table prints the same result.
    from benchmarks.floor import print_table

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_table(result)
    table = text.getvalue()
    for field in ("primary ms", "raw READ GB/s", "floor ms", "NIXL path ms"):
        assert field in table, table
    assert "same-host ms" in table and "in-tree ms" in table and "x floor" in table
    assert "not measured (no such length run)" in table, table
    assert "primary_hit_from_primary_tier yes" in table, table
