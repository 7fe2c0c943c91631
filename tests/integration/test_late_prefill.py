"""A decode sent before its prefill was admitted, between real runtimes
(TCP control, NIXL data plane) in this process: the producer holds the
decoder's Fetch for a ``remote_decoder`` request it has not seen yet and
says so (FetchWait, every heartbeat interval), so the decoder waits past
its fetch deadline, up to its parked_ttl_s, and loads the right bytes when
the prefill comes 10 s later (routers that send both legs at once, or a
prefiller that queues the prefill under load)."""

from __future__ import annotations

import os
import time

import nixl._api  # noqa: F401  (fail, not skip, without NIXL)
import pytest

from p2p_kv.node.roles import Roles, Source
from p2p_kv.runtime.standalone import StandalonePeer, block_pattern, make_key

pytestmark = pytest.mark.timeout(120)

KIB = 1024


def _drain(cons: StandalonePeer, prod: StandalonePeer) -> None:
    end = time.monotonic() + 5
    while time.monotonic() < end and (
        any(cons.manager.state_report().values())
        or any(prod.manager.state_report().values())
    ):
        cons.step(wait=False)
        prod.step(wait=False)
    assert not any(cons.manager.state_report().values())
    assert not any(prod.manager.state_report().values())


def test_a_prefill_admitted_10_s_after_its_decoder_is_loaded() -> None:
    bs, keys = 64 * KIB, [make_key(i) for i in range(8)]
    prod = StandalonePeer(16, bs, engine_id=f"lpp-{os.getpid()}")
    cons = StandalonePeer(32, bs, engine_id=f"lpc-{os.getpid()}")
    try:
        src, dst = [3, 5, 6, 7, 9, 10, 12, 15], list(range(20, 28))
        prod.fill(keys, src)
        prt, rt = prod.runtime, cons.runtime
        rt.start_request("d1", Roles(Source("kv-late", prod.address, probe=False)))
        rt.submit_load(1, "d1", keys, dst)
        t0 = time.monotonic()
        # The prefill's request is not at the producer for 10 s: five
        # times the decoder's fetch deadline.
        while time.monotonic() - t0 < 10.0:
            assert 1 not in cons.results, cons.results[1]
            cons.step(wait=False)
            prod.step(wait=False)
            time.sleep(0.005)
        prt.start_request("p1", Roles(dest_kv_id="kv-late"))
        prod.manager.submit_store(77, "p1", keys, src, prt.clock())
        prt.end_request("p1")
        end = time.monotonic() + 10
        while 1 not in cons.results or 77 not in prod.results:
            assert time.monotonic() < end, "the parked load did not end"
            cons.step(wait=False)
            prod.step(wait=False)
        assert cons.results.pop(1).success
        assert prod.results.pop(77).success
        for k, d in zip(keys, dst, strict=True):
            assert bytes(cons.block(d)) == bytes(block_pattern(k, bs))
        rt.end_request("d1")
        _drain(cons, prod)
    finally:
        cons.close()
        prod.close()
