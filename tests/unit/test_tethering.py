"""The tethering check itself runs in the suite, so CI enforces it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_every_test_file_is_run_by_ci() -> None:
    script = Path(__file__).parents[1] / "check_tethering.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
