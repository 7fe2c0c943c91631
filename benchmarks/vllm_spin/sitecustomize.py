"""A diagnostic for benchmarks only (``p2p-kv bench fleet --vllm-spin-ms``),
never loaded by p2p_kv itself: it changes how long vLLM's shared-memory
queue readers busy-wait after each message.

vLLM's multiprocess executor passes each step between the engine core and
its worker through ``MessageQueue``. After a message a reader spins on
``sched_yield`` for one second (``SpinCondition``'s ``busy_loop_s``, no
setting in vLLM 0.32-0.34) before it sleeps on a socket. Where an engine's
processes have a core each that costs nothing but that core. Where they
share cores, as four engines do on two, the spinners starve the one
process with work until their second ends: a pull into a ``vllm serve``
engine took about 1.06 s in half the tries instead of 45-150 ms. With
this file on ``PYTHONPATH`` and ``FLEET_BENCH_VLLM_SPIN_S`` set (by
``benchmarks.served.engine_env``), every process of the engine (vLLM spawns
its engine core and worker with the same environment) patches the reader's
spin as the module loads, so a run can show what the fleet does when the
spin does not starve it. Both arms of a run get the same engines.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


#: Printed by each process whose readers it patched: the fleet checks the
#: engine's log for it (``benchmarks.served.ServedEngine.wait_ready``).
MARK = "p2p_kv bench: vLLM's queue readers busy-wait"


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Stays on ``sys.meta_path`` and finds vLLM's module itself, through
    the path finder (so no other finder is re-entered and the list is
    never changed under an import), handing back a spec whose loading
    patches ``SpinCondition`` readers to busy-wait ``spin_s``. Every other
    module: not ours (None)."""

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname != _MODULE:
            return None
        spec = PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        load = loader.exec_module
        spin_s = self.spin_s

        def exec_module(module: ModuleType) -> None:
            load(module)
            cls: Any = module.SpinCondition
            init = cls.__init__

            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                init(self, *args, **kwargs)
                if self.is_reader:
                    self.busy_loop_s = spin_s

            cls.__init__ = __init__
            print(f"{MARK} {spin_s * 1000:g} ms", file=sys.stderr, flush=True)

        loader.exec_module = exec_module
        return spec


_spin = os.environ.get("FLEET_BENCH_VLLM_SPIN_S")
if _spin:
    sys.meta_path.insert(0, _PatchOnLoad(float(_spin)))
