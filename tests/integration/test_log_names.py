"""Log lines name a peer by the address its metrics carry.

Metrics label a peer by its address (``host:port``); a line that named it
by our connection's own name (``in:N``) could not be matched to them. An
inbound peer that proved itself is named as its ``peer`` label (the address
it is dialled at, from its engine id); one that has not, by the far end of
its connection.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
from tests.support.wire import RawConn

from p2p_kv.runtime.metrics import session_peer
from p2p_kv.runtime.standalone import StandalonePeer


def test_a_bad_frame_line_names_the_connections_far_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    peer = StandalonePeer(4, 4096, engine_id=f"names-{os.getpid()}")
    raw = RawConn(peer.address)
    try:
        far_end = "{}:{}".format(*raw.sock.getsockname()[:2])
        with caplog.at_level(logging.WARNING, logger="vllm.p2p_kv"):
            raw.send(b"\xc1junk")
            end = time.monotonic() + 10
            while not peer.manager.protocol_errors.get("decode"):
                assert time.monotonic() < end, "the bad frame was never read"
                peer.step(wait=False)
        lines = [
            r.getMessage() for r in caplog.records if "bad frame" in r.getMessage()
        ]
        assert len(lines) == 1, caplog.text
        assert f"p2p_kv: '{far_end}': " in lines[0], lines
        assert "in:" not in lines[0], lines
    finally:
        raw.sock.close()
        peer.close()


def test_a_proven_inbound_peers_line_names_its_metrics_label(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pid = os.getpid()
    producer = StandalonePeer(4, 4096, engine_id=f"producer-{pid}")
    consumer = StandalonePeer(4, 4096, engine_id=f"consumer-{pid}/agent")
    closed = False
    try:
        consumer.open("req", producer.address, "kv")
        end = time.monotonic() + 10
        while not (sessions := list(producer.manager.sessions())) or not all(
            s.link.ready for s in sessions
        ):
            assert time.monotonic() < end, "no session came up"
            consumer.step(wait=False)
            producer.step(wait=False)
        (session,) = sessions
        label = session_peer(session)
        assert label == f"consumer-{pid}"
        with caplog.at_level(logging.INFO, logger="vllm.p2p_kv"):
            consumer.close()
            closed = True
            while not session.link.closed or producer.manager.session(session.peer):
                assert time.monotonic() < end, "the session never closed"
                producer.step(wait=False)
        lines = [
            r.getMessage() for r in caplog.records if "session closed" in r.getMessage()
        ]
        # The consumer's own line names the producer's address; the
        # producer's names the consumer by its label.
        theirs = [line for line in lines if "peer said goodbye" in line]
        assert len(theirs) == 1, lines
        assert f"p2p_kv: '{label}': " in theirs[0], lines
        assert not any("'in:" in line for line in lines), lines
    finally:
        if not closed:
            consumer.close()
        producer.close()
