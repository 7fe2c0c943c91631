"""Membership, pure: who may be dialled, and what a refused source costs.

The manager is handed addresses (never resolves); a request naming a
source outside the membership keeps its other leg, dials nothing, and
is counted and reported once per address."""

from __future__ import annotations

from p2p_kv.node.manager import Answer, LoadManager
from p2p_kv.node.membership import (
    MAX_REPORTED,
    NOT_A_MEMBER,
    Entry,
    Membership,
    parse_peers,
)
from p2p_kv.node.roles import Roles

from .memnet import identity


def _roles(host: str, port: int, leg: str = "remote_kv_source") -> Roles:
    return Roles.parse(
        {leg: {"kv_request_id": "kv", "remote_host": host, "remote_port": port}}
    )


def test_without_peers_everyone_is_admitted() -> None:
    m = Membership()
    assert m.admits("10.9.9.9:1") and m.admits("[::1]:5800") and m.members == set()


def test_listed_entries_and_resolved_addresses_are_members() -> None:
    ip, name = parse_peers(["10.0.0.5:5800", "Fleet.svc:5801"])
    m = Membership([ip, name])
    assert m.names == (name,)
    assert m.admits("10.0.0.5:5800") and m.admits("fleet.svc:5801")
    assert m.admits("FLEET.svc.:5801")  # one name, however spelt
    assert not m.admits("10.0.0.5:5801")  # the port is part of the member
    assert not m.admits("10.0.0.6:5801")  # not resolved yet
    # A headless Service: each address the name resolves to, at its port.
    assert m.update(name, ["10.0.0.6", "fd00::0001"])
    assert m.admits("10.0.0.6:5801") and m.admits("[fd00::1]:5801")
    assert not m.update(name, ["fd00::1", "10.0.0.6"])  # unchanged
    # A pod gone: resolved again, it is no longer a member.
    assert m.update(name, ["10.0.0.7"])
    assert not m.admits("10.0.0.6:5801") and m.admits("10.0.0.7:5801")
    assert m.update(name, [])  # the name no longer exists
    assert m.members == {"10.0.0.5:5800", "fleet.svc:5801"}


def test_a_refused_address_is_counted_each_time_and_reported_once() -> None:
    m = Membership([Entry("10.0.0.5", 5800)])
    for _ in range(3):
        m.refuse("10.6.6.6:22")
    m.refuse("10.6.6.7:22")
    assert m.refused == {NOT_A_MEMBER: 4}
    assert m.take_reports() == ["10.6.6.6:22", "10.6.6.7:22"]
    m.refuse("10.6.6.6:22")
    assert m.take_reports() == []
    # A client naming a new address per request grows nothing past bounds.
    for i in range(3 * MAX_REPORTED):
        m.refuse(f"10.1.{i // 250}.{i % 250}:1")
    assert len(m.take_reports()) == MAX_REPORTED
    assert len(m._reported) == MAX_REPORTED
    assert m.residue() == {}


def _manager(members: Membership) -> LoadManager:
    return LoadManager(identity("me"), nonces=lambda: b"n" * 16, membership=members)


def test_a_source_outside_the_membership_dials_nothing_and_misses() -> None:
    m = _manager(Membership([Entry("10.0.0.5", 5800)]))
    for leg in ("remote_kv_source", "remote_prefiller"):
        m.on_new_request(leg, _roles("10.6.6.6", 5800, leg), 0.0)
        assert m.lookup(leg, b"k" * 16) is Answer.MISS
        m.loads.flush(0.0)
    assert m.take_events() == []  # no Dial
    assert list(m.sessions()) == []
    assert m.membership.refused == {NOT_A_MEMBER: 2}
    for leg in ("remote_kv_source", "remote_prefiller"):
        m.on_request_finished(leg, 1.0)
    assert not any(m.state_report().values()), m.state_report()


def test_a_refused_source_keeps_the_requests_decoder_leg() -> None:
    """llm-d's P/D prefill leg: ``remote_decoder`` plus a source. A source
    outside the membership still parks the prompt for the decoder."""
    m = _manager(Membership([Entry("10.0.0.5", 5800)]))
    roles = Roles.parse(
        {
            "remote_decoder": {"kv_request_id": "pd"},
            "remote_kv_source": {
                "kv_request_id": "x",
                "remote_host": "10.6.6.6",
                "remote_port": 5800,
            },
        }
    )
    m.on_new_request("r", roles, 0.0)
    assert m.submit_store(1, "r", [b"k" * 16], [0], 0.0)  # parked
    assert m.parked_store_count() == 1 and m.take_events() == []


def test_a_member_is_dialled() -> None:
    m = _manager(Membership(parse_peers(["localhost:5800"])))
    m.on_new_request("r", _roles("localhost", 5800), 0.0)
    assert [peer for peer, _ in m.take_events()] == ["localhost:5800"]
    assert m.membership.refused == {}


def test_without_membership_any_source_is_dialled() -> None:
    m = LoadManager(identity("me"), nonces=lambda: b"n" * 16)
    m.on_new_request("r", _roles("10.6.6.6", 5800), 0.0)
    assert [peer for peer, _ in m.take_events()] == ["10.6.6.6:5800"]


class _Sink:
    def __init__(self) -> None:
        self.counters: dict[tuple[str, tuple[str, ...]], float] = {}

    def increase_counter(
        self, counter_name: str, counter_increase_value: float = 1, labelvalues=()
    ) -> None:
        key = (counter_name, tuple(labelvalues))
        self.counters[key] = self.counters.get(key, 0) + counter_increase_value

    def set_gauge(self, gauge_name: str, gauge_value: float, labelvalues=()) -> None:
        pass

    def observe_histogram(self, name: str, value: float, labelvalues=()) -> None:
        pass


def test_a_refused_source_is_exported_as_a_refusal_by_reason() -> None:
    from p2p_kv.runtime.metrics import REFUSALS, MetricsExporter

    m = _manager(Membership([Entry("10.0.0.5", 5800)]))
    exporter, sink = MetricsExporter(), _Sink()
    for i in range(3):
        m.on_new_request(f"r{i}", _roles("10.6.6.6", 5800), 0.0)
    exporter.collect(m, sink, request_state=0)
    exporter.collect(m, sink, request_state=0)  # increments, not totals
    assert sink.counters[(REFUSALS, ("unknown", NOT_A_MEMBER))] == 3


def test_a_source_that_left_the_fleet_is_not_dialled_again() -> None:
    """A request admitted while its source was a member, whose session is
    then lost, is not re-dialled once the source has left the fleet."""
    name = Entry("fleet.svc", 5800)
    members = Membership([name])
    members.update(name, ["10.0.0.7"])
    m = _manager(members)
    m.on_new_request("r", _roles("10.0.0.7", 5800), 0.0)
    assert [p for p, _ in m.take_events()] == ["10.0.0.7:5800"]
    assert m.lookup("r", b"a" * 16) is Answer.RETRY
    m.connection_lost("10.0.0.7:5800", "lost", 0.1)
    m.take_events()
    m.on_invalidated("10.0.0.7:5800", 0.1)
    assert m.session("10.0.0.7:5800") is None
    members.update(name, [])  # the pod is gone from the Service
    assert m.lookup("r", b"b" * 16) is Answer.RETRY  # asked at the flush
    m.loads.flush(5.0)  # past the reconnect backoff: it would be dialled
    assert [e for e in m.take_events() if type(e[1]).__name__ == "Dial"] == []
    assert members.refused == {NOT_A_MEMBER: 1}
    assert m.lookup("r", b"b" * 16) is Answer.MISS
    assert m.lookup("r", b"c" * 16) is Answer.MISS
    m.loads.flush(6.0)
    assert members.refused == {NOT_A_MEMBER: 1}  # once per request
    m.on_request_finished("r", 7.0)
    m.tick(7.0)
    assert not any(m.state_report().values()), m.state_report()
