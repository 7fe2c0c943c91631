"""The shell commands a docs page shows, for tests that run them as written.

A page's ``bash`` blocks each carry a mark on the line before them:
``<!-- run -->`` or ``<!-- run: ROLE -->`` (a test runs it, exactly as
written, in the role it names: a host, a client) or ``<!-- not run: WHY
-->`` (the page says why, e.g. a GPU command on machines without one). An
unmarked block is an error, so no command on a marked page goes untried.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(
    r"(?:<!-- (run(?:: [\w-]+)?|not run: [^>]+) -->\n)?```bash\n(.*?)```", re.S
)


def marked_blocks(page: str) -> list[tuple[str, str]]:
    """``(mark, body)`` of every ``bash`` block of ``docs/<page>``, in order:
    mark ``run``, ``run: ROLE`` or ``not run: WHY``."""
    text = (REPO / "docs" / page).read_text()
    found = []
    for mark, body in _BLOCK.findall(text):
        assert mark, f"docs/{page}: a bash block with no run mark:\n{body}"
        found.append((mark, body))
    return found


def venv_env(home: Path) -> dict[str, str]:
    """A shell with ``make install``'s venv active, as the pages assume,
    and none of this process's ``P2P_KV_*`` or ``UCX_*`` settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("P2P_KV_", "VLLM_P2P_KV_", "UCX_"))
    }
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env['PATH']}"
    env["VIRTUAL_ENV"] = str(REPO / ".venv")
    env["HOME"] = str(home)
    return env
