"""Residue reports derived from the objects that hold per-request state.

A residue check (the soak, the stateful test) asks: once work drained, is
anything left? Listing containers by hand missed the ones added later, so
each holder reports every container it has, found by looking, and names
only the few that may stay full at rest (per-peer state, counters, heaps
of stale timer entries). A container added later is residue by default.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterator
from typing import Any, Protocol

#: What a residue report counts: the containers, never a string.
_CONTAINERS = (dict, list, set, frozenset, deque)


def containers_of(holder: object) -> dict[str, Collection[object]]:
    """The containers among ``holder``'s attributes (instance ``__dict__``
    and ``__slots__``), by name without leading underscores."""
    names = [*getattr(holder, "__dict__", {})]
    for cls in type(holder).__mro__:
        names += [n for n in getattr(cls, "__slots__", ()) if n not in names]
    found: dict[str, Collection[object]] = {}
    for name in names:
        value = getattr(holder, name, None)
        if isinstance(value, _CONTAINERS):
            found[name.lstrip("_")] = value
    return found


def residue_of(
    holder: object,
    prefix: str = "",
    at_rest: Collection[str] = (),
    timers: Collection[str] = (),
    ticked: float = -math.inf,
) -> dict[str, int]:
    """``{prefix + name: size}`` of every container of ``holder`` but those
    named in ``at_rest`` (which may stay full once work drained). A timer
    container (a heap of ``(when, ...)`` tuples, or a dict of deadlines)
    counts only what it holds past due at the holder's last tick
    (``ticked``): a timer not yet due is no residue; one overdue is a
    timer that should have fired."""
    found = containers_of(holder)
    unknown = (set(at_rest) | set(timers)) - set(found)
    if unknown:
        raise ValueError(f"no container named {sorted(unknown)}")
    report = {}
    for name, items in found.items():
        if name in timers:
            report[prefix + name] = sum(1 for when in _due(items) if when <= ticked)
        elif name not in at_rest:
            report[prefix + name] = len(items)
    return report


def _due(timer: Collection[Any]) -> Iterator[float]:
    """When each entry of a timer container is due."""
    if isinstance(timer, dict):
        yield from timer.values()
    else:
        yield from (item[0] for item in timer)


class Holder(Protocol):
    """A sub-object holding state: it reports its own residue."""

    def residue(self) -> dict[str, int]: ...


def holders_of(owner: object) -> dict[str, Holder]:
    """The sub-objects among ``owner``'s attributes that report residue,
    by attribute name: found, not listed, so one added later is covered."""
    return {
        name: value
        for name, value in vars(owner).items()
        if callable(getattr(value, "residue", None))
    }


def sizes_of(owner: object) -> dict[str, int]:
    """Every container of ``owner`` and of its holders, residue or not."""
    objects: dict[str, object] = {"self": owner, **holders_of(owner)}
    return {
        f"{holder}.{name}": len(items)
        for holder, obj in objects.items()
        for name, items in containers_of(obj).items()
    }
