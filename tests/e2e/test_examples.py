"""The recipes in docs/recipes.md, run with the command the page gives,
from the repository root, exactly as a reader would type it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def commands() -> list[str]:
    """Every command in a ```bash block of docs/recipes.md that runs a
    script under examples/ (the listings of the scripts themselves are
    included files, not commands)."""
    text = (REPO / "docs" / "recipes.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if "examples/" in line and not line.lstrip().startswith("--8<--")
    ]


def test_every_recipe_runs_a_script_that_exists() -> None:
    found = commands()
    assert found, "docs/recipes.md names no command"
    for cmd in found:
        for path in re.findall(r"examples/[\w./-]+", cmd):
            assert (REPO / path).is_file(), f"{cmd!r}: {path} is not in the repository"


def run(cmd: str, timeout_s: float = 900) -> str:
    out = subprocess.run(
        ["bash", "-c", cmd],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert out.returncode == 0, (
        f"{cmd!r} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out.stdout


def test_two_engines_on_one_host_share_a_prompts_kv() -> None:
    (cmd,) = [c for c in commands() if "two_engines.sh" in c]
    out = run(cmd)
    said = dict(re.findall(r"^(A|B) [^:']+: +(.*)$", out, re.M))
    assert said.keys() == {"A", "B"}, out
    assert said["A"] == said["B"], out  # B loaded A's KV, generated the same
    assert re.search(r'kv_offload_p2p_\w+\{.*peer="127\.0\.0\.1:5801"', out), out


def test_disaggregated_prefill_behind_the_proxy() -> None:
    """The proxy takes the decoder's leg from the prefiller's response
    (P2PKVConnector), and the decoder loads the prefill's KV."""
    (cmd,) = [c for c in commands() if "disaggregated.sh" in c]
    out = run(cmd)
    assert re.search(r"^Through the proxy .*: \".+\"$", out, re.M), out
    assert re.search(r'kv_offload_p2p_\w+\{.*peer="127\.0\.0\.1:5811"', out), out
