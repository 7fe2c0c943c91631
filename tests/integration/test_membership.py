"""Membership over real sockets: with ``peers`` set, only members are dialled.

The consumer is a :class:`~p2p_kv.runtime.standalone.StandalonePeer` in this
process (real runtime, TCP control plane, NIXL); the producer a peer
process (:mod:`tests.support.agent`) holding blocks. A non-member address
is a plain listening socket that records every connection it accepts: a
request naming it must recompute at once, counted, without one accept
(and, without ``peers``, the same request does connect to it, so the
listener can tell). Names are resolved by the runtime's resolver thread;
an injected resolve function stands in for DNS where the test changes
what a name resolves to.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from tests.support.procs import PeerProc

from p2p_kv.node.membership import NOT_A_MEMBER
from p2p_kv.runtime.standalone import StandalonePeer, make_key

BLOCK = 4096
KEYS = [make_key(k) for k in range(4)]


class Listener:
    """A TCP port that records who connects to it (and speaks nothing)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.05)
        self.port = int(self.sock.getsockname()[1])
        self.accepted: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(addr)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture(scope="module")
def producer() -> Iterator[PeerProc]:
    p = PeerProc(
        {
            "engine_id": f"member-{os.getpid()}",
            "num_blocks": 8,
            "block_bytes": BLOCK,
            "fill": len(KEYS),
        }
    )
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def listener() -> Iterator[Listener]:
    listening = Listener()
    try:
        yield listening
    finally:
        listening.close()


def _consumer(name: str, **kw: object) -> StandalonePeer:
    return StandalonePeer(8, BLOCK, engine_id=f"{name}-{os.getpid()}", **kw)  # type: ignore[arg-type]


def _wait_rounds(peer: StandalonePeer, rounds: int) -> None:
    """Until the resolver finished ``rounds`` more rounds, then a pump hands
    the membership what it found (as the engine's next step does)."""
    resolver = peer.runtime.resolver
    assert resolver is not None
    target = resolver.rounds + rounds
    end = time.monotonic() + 10
    while resolver.rounds < target:
        assert time.monotonic() < end, "the resolver made no round in 10 s"
        time.sleep(0.01)
    peer.runtime.pump()


def test_a_non_member_is_never_dialled_and_the_request_recomputes_at_once(
    producer: PeerProc, listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    c = _consumer("c-members", peers=[producer.address])
    try:
        target = f"127.0.0.1:{listener.port}"
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="vllm.p2p_kv"):
            out = c.fetch(target, "kv-stranger", KEYS, [0, 1, 2, 3], timeout_s=5)
            elapsed = time.monotonic() - t0
            again = c.fetch(target, "kv-stranger-2", KEYS, [0, 1, 2, 3])
        assert out.hits == 0 and not out.job_done and again.hits == 0
        assert elapsed < 0.5, elapsed  # no lookup round, no dial, no wait
        lines = [r.getMessage() for r in caplog.records]
        named = [m for m in lines if "not in the tier's peers" in m]
        assert len(named) == 1 and target in named[0], lines  # once an address
        for _ in range(20):  # engine steps: nothing may dial it later either
            c.step()
        time.sleep(0.2)
        assert listener.accepted == []
        assert c.manager.limit_refusals == {NOT_A_MEMBER: 2}
        # The only session is the member's: the directory keeps one with
        # each member, and none with anyone else.
        assert [s.peer for s in c.manager.sessions()] in ([], [producer.address])
        # A member, in the same engine, loads.
        ok = c.fetch(producer.address, "kv-member", KEYS, [4, 5, 6, 7])
        assert ok.hits == len(KEYS) and ok.ok, ok
        c.step()
        assert not any(c.manager.state_report().values()), c.manager.state_report()
    finally:
        c.close()


def test_without_peers_the_same_request_does_dial(listener: Listener) -> None:
    """The control: the listener sees a dial when nothing forbids one."""
    c = _consumer("c-open")
    try:
        target = f"127.0.0.1:{listener.port}"
        c.fetch(target, "kv-open", KEYS, [0, 1, 2, 3], timeout_s=1)
        end = time.monotonic() + 5
        while not listener.accepted and time.monotonic() < end:
            c.step()
        assert listener.accepted, "no dial reached the listener"
        assert c.manager.limit_refusals.get(NOT_A_MEMBER, 0) == 0
    finally:
        c.close()


def test_a_name_is_resolved_again_and_its_members_follow(producer: PeerProc) -> None:
    """A name (a headless Service) resolved every ``peers_refresh_s``: a pod
    gone from it is no longer dialled, one that appears is."""
    host, _, port = producer.address.rpartition(":")
    answers: dict[str, list[str]] = {"fleet.test": ["10.255.0.1"]}
    asked: list[tuple[str, int]] = []

    def resolve(name: str, p: int) -> list[str]:
        asked.append((name, p))
        return list(answers[name])

    c = _consumer(
        "c-follow", peers=[f"fleet.test:{port}"], peers_refresh_s=0.05, resolve=resolve
    )
    try:
        _wait_rounds(c, 1)
        assert asked[0] == ("fleet.test", int(port))
        assert c.manager.membership.members == {
            f"fleet.test:{port}",
            f"10.255.0.1:{port}",
        }
        before = c.manager.limit_refusals.get(NOT_A_MEMBER, 0)
        out = c.fetch(producer.address, "kv-before", KEYS, [0, 1, 2, 3])
        assert out.hits == 0
        assert c.manager.limit_refusals[NOT_A_MEMBER] == before + 1
        # The producer's pod joins the Service.
        answers["fleet.test"] = ["10.255.0.1", host]
        _wait_rounds(c, 2)
        out = c.fetch(producer.address, "kv-joined", KEYS, [0, 1, 2, 3])
        assert out.hits == len(KEYS) and out.ok, out
        # It leaves: requests naming it recompute again, with no dial.
        answers["fleet.test"] = ["10.255.0.1"]
        _wait_rounds(c, 2)
        out = c.fetch(producer.address, "kv-left", KEYS, [0, 1, 2, 3])
        assert out.hits == 0
        assert c.manager.limit_refusals[NOT_A_MEMBER] == before + 2
        c.step()
        assert not any(c.manager.state_report().values())
    finally:
        c.close()
    assert c.runtime.resolver is not None
    assert not c.runtime.resolver.thread.is_alive()  # close() ended it


def test_a_real_name_resolves_to_each_of_its_addresses(producer: PeerProc) -> None:
    """``localhost`` through the system's resolver: every address it
    resolves to (127.0.0.1, and ::1 where the host lists it) is a member."""
    _, _, port = producer.address.rpartition(":")
    infos = socket.getaddrinfo("localhost", int(port), type=socket.SOCK_STREAM)
    expected = {
        f"[{a}]:{port}" if ":" in a else f"{a}:{port}"
        for a in {str(i[4][0]) for i in infos}
    }
    c = _consumer("c-localhost", peers=[f"localhost:{port}"], peers_refresh_s=0.05)
    try:
        _wait_rounds(c, 1)
        assert c.manager.membership.members == expected | {f"localhost:{port}"}
        out = c.fetch(f"127.0.0.1:{port}", "kv-localhost", KEYS, [0, 1, 2, 3])
        assert out.hits == len(KEYS) and out.ok, out
    finally:
        c.close()


def test_a_resolver_failure_keeps_the_last_members_and_a_gone_name_drops_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DNS down (an error) is no reason to empty the fleet; a name that no
    longer exists (no address) is."""
    state = {"fail": False, "addresses": ["10.255.0.2"]}

    def resolve(name: str, port: int) -> list[str]:
        if state["fail"]:
            raise OSError("Temporary failure in name resolution")
        return list(state["addresses"])  # type: ignore[call-overload]

    c = _consumer(
        "c-dnsdown", peers=["fleet.test:7777"], peers_refresh_s=0.05, resolve=resolve
    )
    try:
        _wait_rounds(c, 1)
        assert "10.255.0.2:7777" in c.manager.membership.members
        state["fail"] = True
        with caplog.at_level("WARNING", logger="vllm.p2p_kv"):
            _wait_rounds(c, 3)
        assert "10.255.0.2:7777" in c.manager.membership.members
        lines = [r for r in caplog.records if "could not resolve" in r.getMessage()]
        assert len(lines) == 1, lines  # at a bounded rate, not once a round
        state["fail"], state["addresses"] = False, []
        _wait_rounds(c, 2)
        assert c.manager.membership.members == {"fleet.test:7777"}
    finally:
        c.close()
