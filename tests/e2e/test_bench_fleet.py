"""``p2p-kv bench fleet`` as docs/benchmarks.md runs it, smaller: three
real ``vllm serve`` engines behind the real ``vllm-router``, the hot set,
the four arms and the fault arm.

What must hold whatever the machine's speed: every request of the four
arms completes; only the arms with p2p_kv pull prompt tokens from a peer,
and round robin with p2p_kv pulls (a router that names no source: the
directory found them); in the fault arm no request sent once the router
knew the engine was gone failed for it, none timed out, and each survivor's
request_state ends at 0; the TTFT CDF is a PNG.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

ARMS = (
    "round robin, off",
    "cache-aware, off",
    "round robin, p2p_kv",
    "cache-aware, p2p_kv",
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    png = tmp_path_factory.mktemp("fleet") / "ttft.png"
    exe = Path(sys.executable).with_name("p2p-kv")
    cmd = [str(exe), "bench", "fleet", "--engines", "3"]
    cmd += ["--workloads", "hot", "--seconds", "30", "--rate", "0.5"]
    cmd += ["--prefixes", "6", "--prefix-tokens", "1024", "--json", "--plot", str(png)]
    done = subprocess.run(
        cmd, cwd=png.parent, capture_output=True, text=True, timeout=1400, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["png"] = png
    return out  # type: ignore[no-any-return]


def test_every_arm_completes_and_only_p2p_kv_arms_pull(result: dict) -> None:  # type: ignore[type-arg]
    arms = result["arms"]["hot"]
    assert list(arms) == list(ARMS)
    for label, r in arms.items():
        assert r["sent"] >= 10, (label, r)
        assert r["completed"] == r["sent"], (label, r)
        assert r["errors"] == r["timeouts"] == 0, (label, r)
        assert r["tokens"]["prompt"] > 0, (label, r)
        if label.endswith("off"):
            assert r["tokens"]["p2p"] == 0, (label, r["tokens"])
    # Round robin names no source: what it pulled, the directory found.
    assert arms["round robin, p2p_kv"]["tokens"]["p2p"] > 0, arms


def test_a_killed_engine_costs_only_its_own_requests_and_leaves_nothing(
    result: dict,  # type: ignore[type-arg]
) -> None:
    fault = result["fault"]
    f = fault["fault"]
    assert fault["timeouts"] == 0, fault
    # Requests fail only for the engine that died: those in flight on it,
    # or sent to it before the router saw it go.
    assert f["failed"] <= f["in_flight_at_kill"] + fault["sent"] // 3, f
    assert fault["completed"] >= fault["sent"] // 2, fault
    assert f["survivors_request_state"] == [0.0, 0.0], f


def test_the_ttft_cdf_is_written_as_a_png(result: dict) -> None:  # type: ignore[type-arg]
    assert result["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
