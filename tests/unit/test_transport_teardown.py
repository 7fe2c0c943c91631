"""A transport's NIXL agent goes when the transport does, never later with
the collector.

On the GPU machine a NIXL agent torn down by a garbage collection, at a
moment nobody chose and after the peer it had written to was gone,
crashed the process (SIGSEGV in ``ucp_worker_destroy``, purging a TCP
send of a transfer released while it ran). These run with the real NIXL
and no GPU: what they check is when and in which order an agent goes.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from p2p_kv.data import NixlDataTransport
from p2p_kv.data.agent import load_nixl

BS = 4096
N = 16


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Only reference counting frees anything while the test runs."""
    load_nixl()  # importing NIXL keeps its importer's frames: not inside a test
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _pair() -> tuple[NixlDataTransport, NixlDataTransport]:
    a = NixlDataTransport(np.zeros(N * BS, np.uint8), BS, name="a", same_host=False)
    b = NixlDataTransport(np.ones(N * BS, np.uint8), BS, name="b", same_host=False)
    a.add_peer(b.local_region())
    b.add_peer(a.local_region())
    return a, b


def _settle(a: NixlDataTransport, b: NixlDataTransport, tid: int) -> None:
    for _ in range(2000):
        b.poll_notifs()
        if any(t == tid for t, _ in a.poll_completions()):
            return
    raise TimeoutError(f"transfer {tid} did not end")


@pytest.mark.usefixtures("no_collector")
def test_a_transport_dropped_without_close_goes_at_once_with_its_agent() -> None:
    """No part of a transport refers back to it, so the last reference
    going frees it, and its ``__del__`` closes it then: its agent goes
    there and then, not at some later collection."""
    a, b = _pair()
    _settle(a, b, a.post_read(b.agent_name, [0, 1], [2, 3]))  # staged
    _settle(a, b, a.post_write(b.agent_name, [4], [5]))
    ours, agent = weakref.ref(a), weakref.ref(a._agent)
    del a
    assert ours() is None, "a reference cycle keeps the transport"
    assert agent() is None, "the agent outlived its transport"
    b.close()


def test_a_transport_its_owner_keeps_in_a_cycle_is_closed_before_it_is_cleared() -> (
    None
):
    """An owner's cycle (a callback that refers to its owner, say) leaves
    the transport to the collector. The collector runs ``__del__`` before
    it clears anything in the cycle: close() then still finds the agent
    and releases everything in its order, and the agent goes inside it."""
    load_nixl()
    events: list[tuple[str, bool]] = []

    class Owned(NixlDataTransport):
        def close(self) -> None:
            events.append(("close", self._agent is not None))
            super().close()

    t = Owned(np.zeros(N * BS, np.uint8), BS, name="owned", same_host=False)
    t.owner: Any = t  # type: ignore[attr-defined]
    agent = weakref.ref(t._agent)
    del t
    gc.collect()
    assert events == [("close", True)]
    assert agent() is None
