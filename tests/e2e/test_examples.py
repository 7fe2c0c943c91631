"""The recipes in docs/recipes.md, run with the command the page gives,
from the repository root, exactly as a reader would type it."""

from __future__ import annotations

import re
import socket
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


def engines_left(*engine_ids: str) -> list[str]:
    """Processes still running whose command line names one of the
    scripts' engines (their kv-transfer-config carries the engine id)."""
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "vllm" in cmdline and any(f'"{e}"' in cmdline for e in engine_ids):
            left.append(f"{proc.name}: {cmdline[:120]}")
    return left


def ports_listening(*ports: int) -> list[int]:
    """Those of ``ports`` something still listens on (127.0.0.1)."""
    taken = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return taken


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
    # The script returned only once its engines had exited: a test run
    # right after finds every port free (it used to find them taken).
    assert engines_left("engine-a", "engine-b") == []
    assert ports_listening(8100, 8101, 5801, 5802) == []


def test_disaggregated_prefill_behind_vllm_router() -> None:
    """vllm-router's own binary (--vllm-pd-disaggregation) copies the
    prefiller's kv_transfer_params (P2PKVConnector, in NixlConnector's
    keys) into the decode request, and the decoder loads the prefill's KV
    from the prefiller's tier (its p2p_kv series name 127.0.0.1:5811)."""
    (cmd,) = [c for c in commands() if "disaggregated.sh" in c]
    out = run(cmd)
    assert re.search(r"^Through vllm-router .*: \".+\"$", out, re.M), out
    # Blocks came from the prefiller's tier: a series for it, above zero.
    assert re.search(
        r'kv_offload_p2p_\w+\{.*peer="127\.0\.0\.1:5811".*\} [1-9]', out
    ), out
    assert engines_left("engine-prefiller", "engine-decoder") == []
    assert ports_listening(8110, 8111, 8200, 5811, 5812) == []
