"""The control plane over IPv4, IPv6 and host names (real ZeroMQ and NIXL,
two peers in one process; the data plane is the same as in test_transport)."""

from __future__ import annotations

import socket
import threading

import nixl._api  # noqa: F401  (fail, not skip, without NIXL)
import pytest

from p2p_kv.session import Timeouts
from p2p_kv.standalone import StandalonePeer, make_key

BLOCK = 4096


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_fetch_over_each_address_family(host: str) -> None:
    if host == "::1":
        # The sandbox may have no IPv6 loopback; that is the machine, not us.
        assert _has_ipv6_loopback(), "this machine has no IPv6 loopback (::1)"
    producer = StandalonePeer(
        16,
        BLOCK,
        engine_id=f"p-{host}",
        host=host,
        timeouts=Timeouts(heartbeat_interval_s=0.2),
    )
    consumer = StandalonePeer(
        16, BLOCK, engine_id=f"c-{host}", timeouts=Timeouts(heartbeat_interval_s=0.2)
    )
    keys = [make_key(i) for i in range(4)]
    producer.fill(keys, [1, 3, 5, 7])
    stop = threading.Event()
    server = threading.Thread(target=producer.serve_until, args=(stop,), daemon=True)
    server.start()
    try:
        peer = producer.address
        if host == "localhost":
            peer = f"localhost:{producer.runtime.control.port}"
        outcome = consumer.fetch(peer, "kv-addr", keys, [0, 2, 4, 6])
        assert outcome.hits == 4 and outcome.ok, outcome
        for src, dst in zip([1, 3, 5, 7], [0, 2, 4, 6], strict=True):
            assert bytes(consumer.block(dst)) == bytes(producer.block(src))
    finally:
        stop.set()
        server.join(5)
        consumer.close()
        producer.close()
