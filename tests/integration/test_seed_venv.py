"""packaging/seed_venv.py, which hard-links .venv's copies of the pinned
distributions into the vLLM 0.33/0.34 venvs (Makefile) so that three venvs
fit CI's disk. On two small venvs and a tiny wheel made here (no network):
the seeded distribution is the one pip would have installed, byte for byte
(its console and ``#!python`` scripts included, for a short, a long and a
spaced interpreter path), pip finds it installed, and the links are safe:
pip uninstalling it in the seeded venv or upgrading it in the source venv
leaves the other venv's copy as it was. What the script must not seed (another
version, a file changed since pip installed it) it leaves to pip."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NAME = "seedtoy"


def _load() -> ModuleType:
    # packaging/ is no package (and `packaging` is PyPI's): load it by path.
    spec = importlib.util.spec_from_file_location(
        "seed_venv", REPO / "packaging" / "seed_venv.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


seed_venv = _load()


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def _wheel(outdir: Path, name: str, version: str, files: dict[str, str]) -> None:
    """A pure-Python wheel of ``files`` (paths in the wheel) and metadata."""
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test_seed_venv\n"
            "Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + files.pop("METADATA", "")
    )
    if "entry_points.txt" in files:
        files[f"{info}/entry_points.txt"] = files.pop("entry_points.txt")
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(outdir / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            data = text.encode()
            info_ = zipfile.ZipInfo(path)
            mode = 0o755 if "/scripts/" in path else 0o644
            info_.external_attr = (stat.S_IFREG | mode) << 16
            z.writestr(info_, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            writer.writerow([path, f"sha256={digest.rstrip(b'=').decode()}", len(data)])
        writer.writerow([f"{info}/RECORD", "", ""])
        z.writestr(f"{info}/RECORD", record.getvalue())


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """seedtoy 1.0 and 2.0: a module, a console script and a ``#!python``
    script; seedtop 1.0, which requires seedtoy 1.0."""
    outdir = tmp_path_factory.mktemp("wheels")
    for version in ("1.0", "2.0"):
        _wheel(
            outdir,
            NAME,
            version,
            {
                f"{NAME}/__init__.py": (
                    f"VALUE = {version!r}\n\n\ndef main() -> None:\n"
                    "    import sys\n\n    print(sys.executable, VALUE)\n"
                ),
                f"{NAME}-{version}.data/scripts/{NAME}-raw": (
                    f"#!python\nimport {NAME}\n\n{NAME}.main()\n"
                ),
                "entry_points.txt": f"[console_scripts]\n{NAME} = {NAME}:main\n",
            },
        )
    _wheel(outdir, "seedtop", "1.0", {"METADATA": f"Requires-Dist: {NAME}==1.0\n"})
    return outdir


def _venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    return path


def _pip(venv: Path, *args: str) -> str:
    return _run(
        [
            *(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")),
            *("--disable-pip-version-check", *args),
        ]
    )


def _install(venv: Path, wheels: Path, version: str) -> None:
    # From an index-like directory, as make's installs are: a wheel given by
    # path gets a direct_url.json, which seed_venv rightly declines.
    _pip(
        venv,
        *("install", "--no-index", "--find-links", str(wheels), "--no-deps"),
        f"{NAME}=={version}",
    )


def _site(venv: Path) -> Path:
    (site,) = venv.glob("lib/python*/site-packages")
    return site


def _snapshot(venv: Path) -> dict[str, bytes]:
    """Every file of the installed seedtoy by its RECORD path, and RECORD's
    rows; .pyc files left out (they name the path they were compiled at)."""
    site = _site(venv)
    (info,) = site.glob(f"{NAME}-*.dist-info")
    rows = sorted(
        ",".join(row)
        for row in csv.reader(io.StringIO((info / "RECORD").read_text()))
        if row and not row[0].endswith(".pyc")
    )
    files = {"RECORD rows": "\n".join(rows).encode()}
    for row in rows:
        entry = row.split(",")[0]
        if not entry.endswith("/RECORD"):
            files[entry] = (site / entry).read_bytes()
    return files


def _seed(source: Path, target: Path, *pins: str) -> object:
    return seed_venv.seed(source, target, seed_venv.read_pins([], pins))


def _runs(venv: Path, version: str) -> None:
    """Both scripts start, under this venv's interpreter, with that version."""
    for script in (NAME, f"{NAME}-raw"):
        out = _run([str(venv / "bin" / script)])
        assert out.split() == [str(venv / "bin" / "python"), version]


def test_seeded_links_survive_pip_in_either_venv(tmp_path: Path, wheels: Path) -> None:
    source, target = _venv(tmp_path / "src"), _venv(tmp_path / "dst")
    _install(source, wheels, "1.0")
    before = _snapshot(source)

    report = _seed(source, target, f"{NAME}==1.0")
    assert report.seeded == [f"{NAME}==1.0"] and not report.left
    module = Path(NAME) / "__init__.py"
    assert os.path.samefile(_site(source) / module, _site(target) / module)
    seeded = _snapshot(target)
    _runs(target, "1.0")
    out = _pip(target, "install", "--no-index", f"{NAME}==1.0")
    assert "already satisfied" in out

    # pip uninstalling the seeded copy leaves the source's.
    _pip(target, "uninstall", "-y", NAME)
    assert not (_site(target) / module).exists()
    assert _snapshot(source) == before
    _runs(source, "1.0")

    # pip upgrading the source's leaves the seeded copy.
    assert _seed(source, target, f"{NAME}==1.0").seeded == [f"{NAME}==1.0"]
    _install(source, wheels, "2.0")
    _runs(source, "2.0")
    assert _snapshot(target) == seeded
    _runs(target, "1.0")


@pytest.mark.parametrize(
    ("dirname", "as_dependency"),
    [
        ("dst", False),
        ("d" * 120, False),  # past 127 characters a console script goes via /bin/sh
        ("with space", False),
        # pip marks what it is asked for REQUESTED, not what it pulls in
        ("dst", True),
    ],
)
def test_seeded_is_what_pip_installs(
    tmp_path: Path, wheels: Path, dirname: str, as_dependency: bool
) -> None:
    source, target = _venv(tmp_path / "src"), _venv(tmp_path / dirname)
    if as_dependency:
        _pip(source, "install", "--no-index", "--find-links", str(wheels), "seedtop")
        assert not list(_site(source).glob(f"{NAME}-*.dist-info/REQUESTED"))
    else:
        _install(source, wheels, "1.0")
    assert _seed(source, target, f"{NAME}==1.0").seeded == [f"{NAME}==1.0"]
    seeded = _snapshot(target)
    _pip(target, "uninstall", "-y", NAME)
    _install(target, wheels, "1.0")
    assert seeded == _snapshot(target)


def test_left_to_pip(tmp_path: Path, wheels: Path) -> None:
    source, target = _venv(tmp_path / "src"), _venv(tmp_path / "dst")
    _install(source, wheels, "1.0")
    assert not _seed(source, target, f"{NAME}==2.0").seeded
    assert not _seed(source, target, f"{NAME}>=1.0").seeded  # not exact
    assert not _seed(source, target, "other==1.0").seeded
    module = _site(source) / NAME / "__init__.py"
    module.write_text(module.read_text().replace("1.0", "9.9"))
    report = _seed(source, target, f"{NAME}==1.0")
    assert not report.seeded
    assert "changed since pip installed it" in report.left[f"{NAME}==1.0"]
    assert not list(_site(target).glob(f"{NAME}*"))
