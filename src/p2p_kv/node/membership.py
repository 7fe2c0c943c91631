"""Membership: the engines this one may dial, from the tier's ``peers`` key.

Without ``peers`` every address a request names is dialled, as a router
that names sources expects (llm-d's sidecar). With it, a request's source
(``remote_kv_source``, ``remote_prefiller``) is dialled only when it names
a member: an entry as listed (``host:port``), or an address a listed name
resolved to. A name may resolve to several addresses (a Kubernetes headless
Service names each ready pod), and each is a member with the entry's port.

A source outside the membership costs its request a recompute and nothing
else: no socket is opened toward it, so an API client cannot make the
engine dial an address of its choosing (the exhaustion vLLM advisory
GHSA-frvg-qw88-hww9 was about). It is counted by reason (``refused``), and
each address is reported once (``take_reports``) for the runtime's log.

Pure: names are resolved by the runtime (:mod:`p2p_kv.runtime.resolver`), off the
engine's thread, and handed in with :meth:`Membership.update`; nothing here
touches a socket or a clock.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from p2p_kv.node.indexes import residue_of
from p2p_kv.node.roles import format_peer

#: Reason a source outside the membership is counted under.
NOT_A_MEMBER = "not_a_member"
#: Addresses remembered as already reported: one line each, and a client
#: naming a new address per request cannot grow this past the bound.
MAX_REPORTED = 1024


@dataclass(frozen=True, slots=True)
class Entry:
    """One ``peers`` entry: a host (an IP address or a name) and a port."""

    host: str
    port: int

    @property
    def is_name(self) -> bool:
        """A host name, resolved while the engine runs (not an IP literal)."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return True
        return False

    def __str__(self) -> str:
        return format_peer(self.host, self.port)


def normalize_host(host: str) -> str:
    """The form two spellings of one host share: an IP literal's canonical
    text (``::0001`` is ``::1``), a name in lower case without its final
    dot (DNS names ignore case)."""
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


def parse_entry(text: str) -> Entry:
    """``host:port`` (``[v6]:port`` for an IPv6 literal) as an
    :class:`Entry`; ValueError saying what is wrong and how to write it."""
    if not isinstance(text, str):
        raise ValueError(f"peers entry {text!r} is not a string; write 'host:port'")
    host, sep, port = text.strip().rpartition(":")
    bare = host.strip("[]")
    if (
        not sep
        or not bare
        or not port.isdecimal()
        or not 0 < int(port) < 65536
        or any(c.isspace() or c in "/\\@?#;*," for c in host)
        # an IPv6 literal keeps its port apart only inside brackets
        or (":" in bare and not (host.startswith("[") and host.endswith("]")))
    ):
        raise ValueError(
            f"peers entry {text!r} is not 'host:port' with a port of 1-65535 "
            "(an IPv6 address goes in brackets: '[fd00::5]:5800')"
        )
    return Entry(normalize_host(bare), int(port))


def parse_peers(value: str | Sequence[str]) -> tuple[Entry, ...]:
    """The ``peers`` key (a list of entries) or its environment variable
    (entries separated by commas or spaces), without duplicates."""
    items = value.replace(",", " ").split() if isinstance(value, str) else value
    entries = [parse_entry(item) for item in items]
    if not entries:
        raise ValueError(
            "peers lists no entry: list the fleet as 'host:port' entries, or "
            "leave the key unset to dial whatever a request names"
        )
    return tuple(dict.fromkeys(entries))


def _key(peer: str) -> str:
    """A dial address (``host:port``, as :func:`format_peer` writes it) in
    the form members are kept in."""
    host, _, port = peer.rpartition(":")
    return format_peer(normalize_host(host), int(port)) if port.isdecimal() else peer


class Membership:
    """Who may be dialled. ``entries`` None: anyone (no ``peers`` key)."""

    def __init__(self, entries: Sequence[Entry] | None = None) -> None:
        #: None: no ``peers`` key, every address is admitted
        self.entries: tuple[Entry, ...] | None = (
            None if entries is None else tuple(entries)
        )
        #: the addresses each listed name resolved to, as last handed in
        self._resolved: dict[Entry, frozenset[str]] = {}
        #: every dial address admitted: entries as listed, resolved ones
        self._members: frozenset[str] = frozenset()
        #: sources refused, by reason
        self.refused: dict[str, int] = {}
        #: addresses already reported (insertion order: the oldest go first)
        self._reported: dict[str, None] = {}
        #: addresses refused and not reported yet (the runtime logs them)
        self._to_report: list[str] = []
        self._rebuild()

    @property
    def names(self) -> tuple[Entry, ...]:
        """The entries whose host is a name, to resolve."""
        return tuple(e for e in self.entries or () if e.is_name)

    @property
    def members(self) -> frozenset[str]:
        """Every admitted dial address, ``host:port`` (empty without
        ``peers``: then anyone is admitted)."""
        return self._members

    def update(self, entry: Entry, addresses: Iterable[str]) -> bool:
        """What ``entry``'s name resolves to now (IP addresses; none when
        the name no longer exists); True if the members changed. A name
        resolved again replaces what it resolved to before: a pod gone from
        a headless Service is no longer dialled."""
        new = frozenset(normalize_host(a) for a in addresses)
        if self._resolved.get(entry) == new:
            return False
        self._resolved[entry] = new
        before = self._members
        self._rebuild()
        return self._members != before

    def _rebuild(self) -> None:
        entries = self.entries or ()
        listed = {str(e) for e in entries}
        resolved = {
            format_peer(address, e.port)
            for e, addresses in self._resolved.items()
            for address in addresses
        }
        self._members = frozenset(listed | resolved)

    def dial_targets(self) -> list[str]:
        """The members to keep a session with, for the directory: each
        address an entry lists or a name resolved to (a name itself is not
        dialled: its addresses are). Sorted, so every engine dials in the
        same order."""
        entries = self.entries or ()
        listed = {str(e) for e in entries if not e.is_name}
        resolved = {
            format_peer(address, e.port)
            for e, addresses in self._resolved.items()
            for address in addresses
        }
        return sorted(listed | resolved)

    def admits(self, peer: str) -> bool:
        """Whether a request may have ``peer`` (``host:port``) dialled."""
        return self.entries is None or _key(peer) in self._members

    def refuse(self, peer: str) -> None:
        """Count a source refused for naming ``peer``, and queue ``peer``
        for the log unless it was reported before."""
        self.refused[NOT_A_MEMBER] = self.refused.get(NOT_A_MEMBER, 0) + 1
        if peer in self._reported:
            return
        if len(self._reported) >= MAX_REPORTED:
            del self._reported[next(iter(self._reported))]
        self._reported[peer] = None
        if len(self._to_report) < MAX_REPORTED:
            self._to_report.append(peer)

    def take_reports(self) -> list[str]:
        """Addresses refused for the first time since the last call."""
        reports, self._to_report = self._to_report, []
        return reports

    def residue(self) -> dict[str, int]:
        """Nothing here is per request: the fleet, counters, and a bounded
        record of what was logged. A container added later is residue."""
        return residue_of(
            self,
            "membership_",
            at_rest=("resolved", "members", "refused", "reported", "to_report"),
        )
