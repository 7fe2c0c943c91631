"""Two engines that cannot share KV say so at first contact, between real
runtimes (TCP control, NIXL agents) in this process: the consumer, whose
requests would otherwise recompute without a word, logs the refusal once
naming the field, both values and the fix, counts it in the refusals
metric by that field, and its request misses at once, far inside the
lookup deadline it would otherwise wait out."""

from __future__ import annotations

import logging
import os
import threading
import time

import nixl._api  # noqa: F401  (fail, not skip, without NIXL)
import pytest
from tests.unit.test_metrics import Sink

from p2p_kv.peer import Timeouts
from p2p_kv.runtime.metrics import REFUSALS, MetricsExporter
from p2p_kv.runtime.standalone import StandalonePeer, make_key

pytestmark = pytest.mark.timeout(60)

KIB = 1024
#: The tier's layout string of a one-worker engine (adapter.tier._identity):
#: model, KV dtype, KV groups (tokens per block, layers), one worker's
#: bytes per KV block, blocks per chunk, TP, PP.
OURS = "tiny-llama|torch.float32|[(16, 2)]|4096|1|1|1"
#: Deadlines long enough that a request waiting on one is plain to see.
SLOW = Timeouts(handshake_s=8.0, lookup_s=8.0, fetch_floor_s=8.0)

CASES = [
    (
        "tiny-llama|torch.float32|[(32, 2)]|8192|1|1|1",
        "layout_block_size",
        "peer's blocks hold 16 tokens (block_size), ours 32",
        "--block-size",
    ),
    (
        "tiny-llama|torch.float32|[(16, 2)]|2048|1|2|1",
        "layout_tp",
        "peer runs tensor_parallel_size 1, we 2",
        "--tensor-parallel-size",
    ),
]


@pytest.mark.parametrize(
    ("theirs", "reason", "said", "fix"), CASES, ids=[c[1] for c in CASES]
)
@pytest.mark.parametrize("probe", [True, False], ids=["source", "prefiller"])
def test_a_pair_of_two_layouts_refuses_at_first_contact_and_recomputes_at_once(
    theirs: str,
    reason: str,
    said: str,
    fix: str,
    probe: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bs, keys = 64 * KIB, [make_key(i) for i in range(4)]
    pid = os.getpid()
    prod = StandalonePeer(16, bs, engine_id=f"lrp-{pid}", layout=OURS, timeouts=SLOW)
    cons = StandalonePeer(16, bs, engine_id=f"lrc-{pid}", layout=theirs, timeouts=SLOW)
    stop = threading.Event()
    server = threading.Thread(target=prod.serve_until, args=(stop,), daemon=True)
    server.start()
    try:
        prod.fill(keys, [1, 2, 3, 4])
        caplog.set_level(logging.INFO, logger="vllm.p2p_kv")
        t0 = time.monotonic()
        outcome = cons.fetch(
            prod.address, "kv1", keys, [5, 6, 7, 8], probe=probe, timeout_s=20
        )
        took = time.monotonic() - t0
        assert not outcome.ok
        if probe:
            assert outcome.hits == 0
        else:  # a prefiller's blocks are taken for there; the load fails
            assert outcome.job_done
        # Well inside the lookup deadline (8 s) it would otherwise wait.
        assert took < 1.0, took
        sink = Sink()
        cons.runtime.collect_metrics(MetricsExporter(), sink)  # type: ignore[arg-type]
        assert sink.counters[REFUSALS] == {(prod.address, reason): 1}
        lines = [
            r.getMessage()
            for r in caplog.records
            if "handshake refused" in r.getMessage() and prod.address in r.getMessage()
        ]
        assert len(lines) == 1, caplog.text
        assert f"{reason}: {said}" in lines[0] and "fix: " in lines[0]
        assert fix in lines[0]
    finally:
        stop.set()
        server.join(5)
        cons.close()
        prod.close()
