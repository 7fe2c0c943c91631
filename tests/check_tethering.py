"""Every test file must be reachable from a CI step ("test tethering").

The Buildkite step runs ``make test``, which runs pytest over ``tests/``; a
test file outside the three suites, or not named ``test_*.py``, would be
silently skipped, so it is an error here.
"""

from __future__ import annotations

import sys
from pathlib import Path

SUITES = ("unit", "integration", "e2e")


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
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
