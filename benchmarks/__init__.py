"""p2p_kv's benchmarks, a package of the source checkout (not of the wheel:
they measure the machine and need the tree's baselines).

Run one as ``p2p-kv bench NAME`` or, from the checkout's root, as
``python -m benchmarks.NAME``. Either way it is imported as
``benchmarks.NAME`` and shares code through :mod:`benchmarks.harness` with
ordinary imports. A stable module name matters beyond tidiness: the
benchmarks start worker processes with multiprocessing's *spawn*, and a
spawned child finds its target function only by importing the module that
defines it, by name, on the ``sys.path`` it inherits from its parent.

So the checkout's root must be on ``sys.path``: ``python -m`` puts the
current directory there, pytest's ``pythonpath`` setting does for the
tests, and ``p2p-kv bench`` inserts the root once (:mod:`p2p_kv.cli`):
the installed package has no other way to reach a directory it does not
ship. A checkout where p2p_kv is not installed gets its ``src/`` added
below, so ``python -m benchmarks.gpu`` runs on a bare GPU machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("p2p_kv") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
