"""tests/README.md names every module of src/p2p_kv/ and only test files
that exist, so a module added, moved or renamed shows up there or fails."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "tests" / "README.md").read_text()
PACKAGE = ROOT / "src" / "p2p_kv"
ROWS = re.findall(r"^\| `([^`]+)` \| (.+) \|$", README, re.M)


def test_every_module_has_a_row() -> None:
    named = {m for m, _ in ROWS}
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py" and rel.parent != Path("doctor"):
            continue
        key = f"{rel.parent}/" if rel.parent == Path("doctor") else str(rel)
        if key not in named:
            missing.append(str(rel))
    assert not missing, f"tests/README.md has no row for {missing}"


def test_every_test_file_it_names_exists() -> None:
    assert len(ROWS) > 40
    gone = [
        f
        for _, tests in ROWS
        for f in re.findall(r"`((?:unit|integration|e2e|support)/[\w/]+\.py)`", tests)
        if not (ROOT / "tests" / f).is_file()
    ]
    assert not gone, f"tests/README.md names test files that do not exist: {gone}"


def test_every_module_it_names_exists() -> None:
    gone = [m for m, _ in ROWS if m.endswith(".py") and not (PACKAGE / m).is_file()]
    assert not gone, f"tests/README.md names modules that do not exist: {gone}"
