"""The waker: how an engine that does not step still answers its peers.

vLLM's 3-process engine sleeps on its input queue when it has no request,
and stepping it costs a core (its worker spins a second after each step).
So the tier keeps a thread of its own (:meth:`TierRuntime.start_waker`)
that handles frames, heartbeats and deadlines, and calls the engine in only
when a peer needs its primary tier: a lookup to serve. Real TCP sockets
and NIXL agents in this process; the "engine" is a thread that steps the
producer only when the waker calls it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tests.support.sockets import TCP_ONLY

from p2p_kv.control.transport import ControlTransport, wait_readable
from p2p_kv.node.manager import Answer
from p2p_kv.peer import Timeouts
from p2p_kv.runtime.standalone import StandalonePeer, make_key
from p2p_kv.runtime.tier_runtime import DATA_TICK_S

#: Far longer than any answer may take: an answer in time can only come
#: from a waker that woke on the frame, not on its timer.
TICK_S = 5.0
IN_TIME_S = 2.0
#: The producer's own heartbeats would end the waker's sleep every 0.5 s
#: (a deadline): so rare here that only a frame can wake it in time.
QUIET = Timeouts(heartbeat_interval_s=10.0)


class SleepingEngine:
    """A producer engine that steps only when its tier's waker asks."""

    def __init__(self, peer: StandalonePeer, lose: int = 0, fail: int = 0) -> None:
        self.peer = peer
        self.calls = 0
        #: calls taken without stepping: as when the call comes while the
        #: engine ends a step of its own and then finds nothing pending
        self.lose = lose
        #: calls that raise, as a call into a closing engine queue may
        self.fail = fail
        self._called = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wake(self) -> None:  # the waker's callback: vLLM's empty abort
        self.calls += 1
        if self.calls <= self.fail:
            raise RuntimeError("engine queue shut down")
        if self.calls > self.lose:
            self._called.set()

    def _run(self) -> None:
        rt = self.peer.runtime
        while not self._stop.is_set():
            if self._called.wait(0.05):
                self._called.clear()
                with rt.lock:
                    rt.waker.engine_stepped()
                    self.peer.step(wait=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


@pytest.fixture(
    params=[(0, 0), (2, 0), (0, 2)], ids=["calls-taken", "calls-lost", "calls-raise"]
)
def pair(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[StandalonePeer, StandalonePeer, SleepingEngine]]:
    pid = os.getpid()
    producer = StandalonePeer(16, 4096, engine_id=f"waker-p-{pid}", timeouts=QUIET)
    consumer = StandalonePeer(16, 4096, engine_id=f"waker-c-{pid}")
    for slot in range(8):
        producer.pinner.table[make_key(slot)] = slot
    lose, fail = request.param
    engine = SleepingEngine(producer, lose=lose, fail=fail)
    producer.runtime.start_waker(engine.wake, interval_s=TICK_S)
    try:
        yield producer, consumer, engine
    finally:
        engine.close()
        consumer.close()
        producer.close()


def test_a_lookup_calls_the_sleeping_engine_in_when_it_arrives(
    pair: tuple[StandalonePeer, StandalonePeer, SleepingEngine],
) -> None:
    producer, consumer, engine = pair
    keys = [make_key(1), make_key(2)]
    for i in range(3):
        time.sleep(0.3)  # the waker is back asleep on its sockets
        t0 = time.monotonic()
        out = consumer.fetch(producer.address, f"kv{i}", keys, [4, 9])
        took = time.monotonic() - t0
        assert out.ok and out.hits == 2, out
        # The first fetch also carries the handshake, which the waker
        # answers by itself (no engine step needed). A call the engine
        # lost, or one that raised, is made again (REWAKE_S), not left
        # pending for good.
        assert took < IN_TIME_S, f"fetch {i} took {took:.2f} s (tick {TICK_S} s)"
    assert engine.calls >= 3  # one serve window per lookup at least
    waker = producer.runtime.waker.thread
    assert waker is not None and waker.is_alive()


def test_close_ends_the_wakers_sleep_at_once_and_is_idempotent(
    pair: tuple[StandalonePeer, StandalonePeer, SleepingEngine],
) -> None:
    producer, _, _ = pair
    time.sleep(0.2)  # asleep for up to TICK_S
    t0 = time.monotonic()
    producer.runtime.close()
    assert time.monotonic() - t0 < IN_TIME_S
    waker = producer.runtime.waker.thread
    assert waker is not None and not waker.is_alive()
    producer.runtime.close()  # the fixture closes it again, too


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_waker_that_dies_hands_the_tier_back_to_the_engine() -> None:
    peer = StandalonePeer(4, 4096, engine_id=f"waker-dies-{os.getpid()}")
    try:
        rt = peer.runtime

        def fatal() -> None:
            raise SystemExit  # not an Exception: nothing in the loop takes it

        with rt.lock:
            rt.start_waker(fatal, interval_s=0.01)
            rt.manager.results_ready = lambda: True  # type: ignore[method-assign]
        assert rt.has_waker
        assert rt.waker.thread is not None
        rt.waker.thread.join(IN_TIME_S)
        assert not rt.waker.thread.is_alive()
        # may_wait and the adapter's has_pending_work read this: the engine
        # steps by itself again instead of waiting on a waker that is gone.
        assert not rt.has_waker
    finally:
        peer.close()


def test_the_waker_ticks_fast_only_while_the_data_plane_has_work() -> None:
    """Data-plane completions wake no descriptor, so the waker looks every
    ``interval_s`` while transfers are in flight or settling; with none it
    sleeps up to ``idle_s`` (its 10 ms tick cost an idle process 1.8% of a
    core)."""
    peer = StandalonePeer(
        4, 4096, engine_id=f"waker-tick-{os.getpid()}", timeouts=QUIET
    )
    try:
        rt = peer.runtime
        passes = 0
        sweep = rt.waker.sweep

        def counted(interval_s: float, idle_s: float) -> tuple[bool, list[int], float]:
            nonlocal passes
            passes += 1
            return sweep(interval_s, idle_s)

        rt.waker.sweep = counted  # type: ignore[method-assign]
        settling = False
        rt.data.settling = lambda: settling  # type: ignore[method-assign]
        rt.start_waker(lambda: None, interval_s=0.01, idle_s=0.25)
        time.sleep(0.2)  # past the first pass
        start = passes
        time.sleep(1.0)
        idle = passes - start
        settling = True
        rt.control.wake()  # the next pass sees it now, not after 0.25 s
        time.sleep(0.1)
        start = passes
        time.sleep(0.5)
        busy = passes - start
        assert idle <= 6, f"{idle} passes in an idle second"
        assert busy >= 20, f"{busy} passes in half a second with a READ settling"
    finally:
        peer.close()


@pytest.mark.parametrize("producer_engine", ["asleep", "stepping"])
def test_a_read_over_tcp_from_an_idle_producer_moves_on_its_progress(
    monkeypatch: pytest.MonkeyPatch, producer_engine: str
) -> None:
    """Over UCX's TCP transport a consumer's READ moves only as the
    producer's side progresses, and nothing wakes the producer for it: no
    frame, no transfer of its own in flight. While it holds blocks it
    offered, its waker (engine asleep) or its idle wait (engine stepping)
    progresses every DATA_TICK_S. Both would otherwise sleep on: the
    waker up to its idle bound (5 s here; at 200 ms a 4-block READ took
    171 ms, a 128 MiB one 1.4 s), the stepping engine's wait up to 2 s
    once idle 2 s (its backoff), so 3 s after the answer the READ met the
    middle of a 2 s wait."""
    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    pid, bs = os.getpid(), 64 * 1024
    producer = StandalonePeer(
        16,
        bs,
        engine_id=f"tcp-p-{pid}",
        timeouts=QUIET,
        same_host=False,
        idle_wait_s=TICK_S,
    )
    consumer = StandalonePeer(
        16, bs, engine_id=f"tcp-c-{pid}", timeouts=QUIET, same_host=False
    )
    keys = [make_key(i) for i in range(4)]
    producer.fill(keys, [0, 1, 2, 3])
    stop = threading.Event()
    engine: SleepingEngine | None = None
    stepper: threading.Thread | None = None
    if producer_engine == "asleep":
        engine = SleepingEngine(producer)
        producer.runtime.start_waker(engine.wake, idle_s=TICK_S)
    else:

        def step() -> None:
            while not stop.is_set():
                with producer.runtime.lock:
                    producer.step()

        stepper = threading.Thread(target=step, daemon=True)
        stepper.start()
    m, rt = consumer.manager, consumer.runtime
    idle_s, bound_s = (0.3, IN_TIME_S) if engine else (3.0, 0.5)
    try:
        for i in range(2):
            req = f"r{i}"
            consumer.open(req, producer.address, f"kv{i}")
            end = time.monotonic() + 10
            while Answer.RETRY in (answers := [m.lookup(req, k) for k in keys]):
                assert time.monotonic() < end, "no lookup answer"
                rt.flush()
                consumer.step()
            assert answers == [Answer.HIT] * 4
            time.sleep(idle_s)  # the producer is back in its long sleep
            t0 = time.monotonic()
            rt.submit_load(100 + i, req, keys, [4, 5, 6, 7])
            while 100 + i not in consumer.results:
                assert time.monotonic() - t0 < bound_s, "the READ did not move"
                consumer.step()
            assert consumer.results.pop(100 + i).success
            for j in range(4):
                assert (consumer.block(4 + j) == producer.block(j)).all()
            rt.end_request(req)
            rt.pump()
    finally:
        stop.set()
        if engine is not None:
            engine.close()
        if stepper is not None:
            stepper.join(2 * TICK_S)
        consumer.close()
        producer.close()


def test_a_release_queued_off_the_step_leaves_at_once() -> None:
    """vLLM ends a request (an abort) outside the step's poll; the Release
    it queues must not wait for the waker's idle bound when the engine
    then sleeps (it waited 87-102 ms at 200 ms, while the producer held
    the pins for nothing)."""
    pid = os.getpid()
    producer = StandalonePeer(16, 4096, engine_id=f"rel-p-{pid}", timeouts=QUIET)
    consumer = StandalonePeer(16, 4096, engine_id=f"rel-c-{pid}", timeouts=QUIET)
    keys = [make_key(1), make_key(2)]
    producer.fill(keys, [1, 2])
    engine = SleepingEngine(producer)
    producer.runtime.start_waker(engine.wake, idle_s=TICK_S)
    rt, m = consumer.runtime, consumer.manager
    try:
        consumer.open("r1", producer.address, "kv1")
        end = time.monotonic() + IN_TIME_S
        while (answers := [m.lookup("r1", k) for k in keys]).count(Answer.RETRY):
            assert time.monotonic() < end, "no lookup answer"
            rt.flush()
            consumer.step()
        assert answers == [Answer.HIT, Answer.HIT]
        assert producer.pinner.pinned
        # From here the consumer's engine sleeps: only its waker acts.
        rt.start_waker(lambda: None, idle_s=TICK_S)
        time.sleep(0.3)
        t0 = time.monotonic()
        with rt.lock:
            rt.end_request("r1")  # the client aborted
        while producer.pinner.pinned:
            # 10 ms; 1.7 s without the wake (a lookup deadline woke it)
            assert time.monotonic() - t0 < 0.5, "the Release waited"
            time.sleep(0.01)
    finally:
        engine.close()
        consumer.close()
        producer.close()


def test_an_idle_engines_wait_grows_to_idle_wait_ms() -> None:
    """The idle wait doubles from 2 ms up to ``idle_wait_ms``; the doubling
    stopped at 2.048 s, so a larger setting was accepted and did nothing.
    Timed on a clock of our own: the receive returns at once and moves it."""
    peer = StandalonePeer(4, 4096, engine_id=f"idle-cap-{os.getpid()}", idle_wait_s=5.0)
    try:
        rt, waits, now = peer.runtime, [], [1000.0]

        def receive(timeout: float) -> bool:
            waits.append(timeout)
            now[0] += timeout
            return False

        rt.clock = lambda: now[0]
        rt._receive = receive  # type: ignore[method-assign]
        for _ in range(16):
            rt.poll(wait=True)
        assert max(waits) == pytest.approx(5.0), waits
    finally:
        peer.close()


def test_a_peer_dialling_in_before_our_identity_is_ready_is_answered_after() -> None:
    """vLLM seeds its block hashes (``NONE_HASH``) after the tier is built,
    and the waker starts with the tier: a peer's Hello arriving meanwhile
    made the waker's pass raise (our Hello could not be made), the frame
    was lost, and the peer waited out its handshake. The frames now wait
    in the sockets until the identity resolves. Meanwhile the waker
    sleeps its tick: those unread frames (or a fresh socket's descriptor)
    kept every wait short, and it spun, 2,500-6,800 passes a second."""
    pid = os.getpid()
    producer = StandalonePeer(16, 4096, engine_id=f"early-p-{pid}", timeouts=QUIET)
    consumer = StandalonePeer(16, 4096, engine_id=f"early-c-{pid}")
    keys = [make_key(1), make_key(2)]
    producer.fill(keys, [1, 2])
    real, ready = producer.manager.settings.me, threading.Event()

    def identity() -> Any:
        if not ready.is_set():
            raise NameError("name 'NONE_HASH' is not defined")
        return real

    producer.manager.settings.identity = identity
    rt = producer.runtime
    passes: list[float] = []
    real_sweep = rt.waker.sweep

    def counted(*args: Any) -> Any:
        if not ready.is_set():
            passes.append(time.monotonic())
        return real_sweep(*args)

    rt.waker.sweep = counted  # type: ignore[method-assign]
    engine = SleepingEngine(producer)
    rt.start_waker(engine.wake)
    try:
        threading.Timer(0.5, ready.set).start()
        out = consumer.fetch(producer.address, "kv1", keys, [4, 9])
        assert out.ok and out.hits == 2, out
        # One pass a data tick (10 ms): about 50 in the half second.
        assert len(passes) < 0.5 / DATA_TICK_S * 3, f"{len(passes)} passes in 0.5 s"
    finally:
        engine.close()
        consumer.close()
        producer.close()


def test_wait_readable_skips_a_descriptor_closed_under_it() -> None:
    """The engine's thread may close a session's sockets while the waker
    sleeps on their descriptors: poll then reports the closed one at once,
    every time. A frame on another must still end the wait at once."""
    r, w = os.pipe()
    # A number far above those in use: the kernel hands out the lowest free
    # one, so no other thread reopens it meanwhile.
    closed_r = os.dup2(r, 1000)
    os.close(closed_r)
    try:
        timer = threading.Timer(0.1, lambda: os.write(w, b"!"))
        timer.start()
        t0 = time.monotonic()
        wait_readable([(closed_r, select.POLLIN), (r, select.POLLIN)], TICK_S)
        took = time.monotonic() - t0
        timer.join()
        assert 0.05 < took < IN_TIME_S, took
    finally:
        os.close(r)
        os.close(w)


def test_wait_readable_ends_on_a_readable_fd_and_never_spins_on_a_bad_one() -> None:
    r, w = os.pipe()
    try:
        os.write(w, b"!")
        t0 = time.monotonic()
        wait_readable([(r, select.POLLIN)], TICK_S)
        assert time.monotonic() - t0 < IN_TIME_S
        t0 = time.monotonic()
        wait_readable(
            [(-1, select.POLLIN)], 0.05
        )  # refused: slept, not raised, not returned
        assert time.monotonic() - t0 >= 0.05
    finally:
        os.close(r)
        os.close(w)
    # Closed under us: poll reports POLLNVAL at once, every time.
    t0 = time.monotonic()
    wait_readable([(r, select.POLLIN)], 0.2)
    assert time.monotonic() - t0 >= 0.2


@pytest.mark.parametrize("refused", [False, True], ids=["sent", "refused"])
def test_a_frame_that_arrives_as_we_send_still_ends_the_wakers_sleep(
    refused: bool,
) -> None:
    """A frame left unread must end a sleep on
    :meth:`ControlTransport.readiness_fds` at once, whatever was sent (or
    refused) on its connection meanwhile."""
    a = ControlTransport("127.0.0.1", 0)
    b = ControlTransport("127.0.0.1", 0)
    try:
        b.connect(a.address)
        assert b.send(a.address, [b"hello"]) == ""
        end = time.monotonic() + IN_TIME_S
        got: list[Any] = []
        while len(got) < 2 and time.monotonic() < end:
            b.poll(0.0)
            got += a.poll(0.01)
        assert got and got[0].new and got[1].frame == b"hello", got
        conn = got[0].conn
        assert b.send(a.address, [b"unread"]) == ""
        time.sleep(0.2)  # it has reached a's socket
        target = "in:999" if refused else conn
        assert (a.send(target, [b"reply"]) != "") is refused
        t0 = time.monotonic()
        wait_readable(a.readiness_fds(), TICK_S)
        assert time.monotonic() - t0 < IN_TIME_S
        assert any(x.frame == b"unread" for x in a.poll(0.0))
    finally:
        a.close()
        b.close()


class EngineCoreLoop:
    """vLLM 0.32's engine-core loop as the tier meets it: asleep on its
    input queue while it has no work; while it has some it steps, pausing
    1 ms between steps. A pin held for a peer is work to vLLM (a store job
    of its tiering manager), so without :meth:`TierRuntime.park_engine` a
    producer steps ~750 times a second until the peer lets go."""

    def __init__(self, peer: StandalonePeer) -> None:
        self.peer = peer
        self.queue: queue.Queue[str] = queue.Queue()
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _has_work(self) -> bool:
        # vLLM's connector: any job of its tiering manager in flight (a
        # pin is a store job; a finished request's load stays one until
        # its result), or the tier's own pending work.
        with self.peer.runtime.lock:
            m = self.peer.manager
            return bool(self.peer.pinner.pinned or m.jobs_in_flight()) or (
                m.has_pending_work()
            )

    def _run(self) -> None:
        rt = self.peer.runtime
        while not self._stop.is_set():
            if not self._has_work():
                with contextlib.suppress(queue.Empty):
                    self.queue.get(timeout=0.05)
                continue
            while not self.queue.empty():  # client requests, the waker's call
                self.queue.get_nowait()
            rt.park_engine(self.queue)  # the tier's get_finished_jobs does this
            with rt.lock:
                rt.waker.engine_stepped()
                self.peer.step(wait=False)
            self.steps += 1
            time.sleep(0.001)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def test_pins_held_for_a_peer_do_not_keep_an_idle_engine_stepping() -> None:
    pid = os.getpid()
    # Parked for up to 5 s a step: only a wake-up can end a park in time.
    producer = StandalonePeer(
        16, 4096, engine_id=f"park-p-{pid}", timeouts=QUIET, idle_wait_s=TICK_S
    )
    consumer = StandalonePeer(16, 4096, engine_id=f"park-c-{pid}", timeouts=QUIET)
    for slot in range(4):
        producer.pinner.table[make_key(slot)] = slot
    engine = EngineCoreLoop(producer)
    producer.runtime.start_waker(lambda: engine.queue.put_nowait("wake"), 0.05)
    try:
        m = consumer.manager
        keys = [make_key(1), make_key(2)]
        consumer.open("r1", producer.address, "kv1")
        end = time.monotonic() + IN_TIME_S
        while (answers := [m.lookup("r1", k) for k in keys]).count(Answer.RETRY):
            assert time.monotonic() < end, "no lookup answer"
            consumer.runtime.flush()
            consumer.step()
        assert answers == [Answer.HIT, Answer.HIT]
        # The consumer now holds the producer's pins and does nothing.
        steps = engine.steps
        time.sleep(1.0)
        held = engine.steps - steps
        assert producer.pinner.pinned, "the pins went early"
        assert held <= 3, f"the idle producer stepped {held} times in 1 s"
        # A client request ends the park at once...
        steps = engine.steps
        engine.queue.put_nowait("add")
        end = time.monotonic() + IN_TIME_S
        while engine.steps == steps:
            assert time.monotonic() < end, "a new request waited on the park"
            time.sleep(0.01)
        # A peer's Fetch that waits for stores of a request the engine has
        # not seen does not keep it stepping: with no live request nothing
        # can be parked (vLLM ends a request at the tier after its last
        # store), and the request, when it comes, wakes the engine anyway.
        # (It stepped ~50 times a second for the Fetch's whole wait.)
        other = StandalonePeer(16, 4096, engine_id=f"park-f-{pid}", timeouts=QUIET)
        waiter = threading.Thread(
            target=lambda: other.fetch(
                producer.address, "kv-later", keys, [5, 6], probe=False, timeout_s=1.5
            )
        )
        try:
            time.sleep(0.3)  # asleep again
            steps = engine.steps
            waiter.start()
            time.sleep(1.0)
            held = engine.steps - steps
            assert held <= 3, f"a waiting Fetch stepped the idle engine {held} times"
        finally:
            waiter.join()
            other.close()
        # ...and so does the waker, once the Release has ended the pins.
        t0 = time.monotonic()
        consumer.runtime.end_request("r1")
        consumer.runtime.pump()
        while producer.pinner.pinned:
            assert time.monotonic() - t0 < IN_TIME_S, "the Release waited on the park"
            time.sleep(0.01)
    finally:
        engine.close()
        consumer.close()
        producer.close()


def _look_up(
    consumer: StandalonePeer, producer: StandalonePeer, keys: list[bytes]
) -> None:
    """Request "r" of ``consumer`` looks ``keys`` up at ``producer``, both
    stepped here, until every one hits."""
    m, rt = consumer.manager, consumer.runtime
    consumer.open("r", producer.address, "kv")
    end = time.monotonic() + IN_TIME_S
    while Answer.RETRY in (answers := [m.lookup("r", k) for k in keys]):
        assert time.monotonic() < end, "no lookup answer"
        rt.flush()
        consumer.step()
        producer.step(wait=False)
    assert answers == [Answer.HIT] * 4


def _stepped_to_result(consumer: StandalonePeer, job: int) -> Any:
    """Step ``consumer`` (5 s at most) until load ``job`` has its result."""
    end = time.monotonic() + 5.0
    while job not in consumer.results:
        assert time.monotonic() < end, "the load never ended"
        consumer.step(wait=False)
        time.sleep(0.005)
    return consumer.results.pop(job)


def _result_once_resumed(
    producer: StandalonePeer, consumer: StandalonePeer, job: int, step_consumer: bool
) -> Any:
    """The stalled ``producer`` steps again, its READ ends, and load
    ``job``'s result comes: through the waker's call to the engine, or
    through ``consumer``'s own steps (``step_consumer``)."""
    t0 = time.monotonic()
    while job not in consumer.results:
        assert time.monotonic() - t0 < IN_TIME_S, "the result never came"
        producer.step(wait=False)
        if step_consumer:
            consumer.step()
        else:
            time.sleep(0.005)
    return consumer.results.pop(job)


def _in_place_reader(tag: str, timeouts: Timeouts) -> StandalonePeer:
    """A consumer of 16 64 KiB blocks whose NIXL READs land in place (no
    same-host copy, no staging): a READ given up on waits its drain bound."""
    return StandalonePeer(
        16,
        64 * 1024,
        engine_id=f"{tag}-c-{os.getpid()}",
        timeouts=timeouts,
        same_host=False,
        read_staging_bytes=0,
    )


def _hits_to_read_in_place(
    tag: str, timeouts: Timeouts
) -> tuple[StandalonePeer, StandalonePeer, list[bytes]]:
    """A producer holding 4 blocks and a consumer (``timeouts``) whose
    request "r" has looked them all up, its NIXL READs landing in place.
    Over UCX's TCP transport (the caller sets UCX_TLS) a READ then stalls
    for as long as the producer makes no NIXL call."""
    producer = StandalonePeer(
        16,
        64 * 1024,
        engine_id=f"{tag}-p-{os.getpid()}",
        timeouts=QUIET,
        same_host=False,
    )
    consumer = _in_place_reader(tag, timeouts)
    keys = [make_key(i) for i in range(4)]
    producer.fill(keys, [0, 1, 2, 3])
    try:
        _look_up(consumer, producer, keys)
    except BaseException:
        consumer.close()
        producer.close()
        raise
    return producer, consumer, keys


def test_an_aborted_read_neither_holds_nor_spins_the_idle_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request ends while its in-place READ is stuck on a stalled
    producer (over TCP a READ needs the producer's progress). The READ is
    given up on, but it is reported only when UCX ends it or at the data
    plane's drain bound. The cancel waited out that bound holding the
    tier's lock, so the engine's thread could not step for its other
    requests; and then, with no live request, the engine stepped ~1,000
    times a second for a job nobody waits on."""
    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    producer, consumer, keys = _hits_to_read_in_place(
        "ab", Timeouts(heartbeat_interval_s=10.0, abort_ack_s=8.0)
    )
    # Past this test's window, and under the session's own wait for the
    # READ (abort_ack_s, 8 s here), as drain_timeout_for would keep it.
    consumer.runtime.data._drain_timeout_s = 3.0
    m, rt = consumer.manager, consumer.runtime
    engine: EngineCoreLoop | None = None
    try:
        # From here the producer makes no NIXL call: the READ stalls.
        engine = EngineCoreLoop(consumer)
        rt.start_waker(lambda: engine.queue.put_nowait("wake"), idle_s=TICK_S)
        with rt.lock:
            rt.submit_load(7, "r", keys, [4, 5, 6, 7])
            assert rt.transfers_in_flight == 1
            rt.end_request("r")  # the client aborted
        steps = engine.steps
        for _ in range(10):
            time.sleep(0.1)
            t0 = time.monotonic()
            assert rt.lock.acquire(timeout=0.5), "the cancel held the tier's lock"
            rt.lock.release()
            waited = time.monotonic() - t0
            assert waited < 0.3, f"the engine's thread waited {waited:.2f} s"
        held = engine.steps - steps
        assert held <= 3, f"the idle engine stepped {held} times in 1 s"
        assert 7 not in consumer.results and rt.transfers_in_flight == 1
        # The producer resumes: the READ ends, and the waker calls the
        # engine in for the job's result.
        result = _result_once_resumed(producer, consumer, 7, step_consumer=False)
        assert not result.success  # aborted: never a hit
        with rt.lock:
            assert rt.transfers_in_flight == 0
            assert not any(m.state_report().values()), m.state_report()
    finally:
        if engine is not None:
            engine.close()
        consumer.close()
        producer.close()


def test_a_cache_resets_drain_waits_for_a_stuck_read_without_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's cache reset drains the tier's jobs on the engine's thread. A
    load whose READ is stuck on a stalled producer (over TCP a READ needs
    the producer's progress) ends only at its deadline, and the drain
    polled for it without sleeping: a whole core until then (seconds,
    for a large load). It still polls, since our READs move only on our
    progress calls, but backs off between polls while nothing ends."""
    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    producer, consumer, keys = _hits_to_read_in_place(
        "dr", Timeouts(heartbeat_interval_s=10.0)
    )
    m, rt = consumer.manager, consumer.runtime
    try:
        rt.submit_load(7, "r", keys, [4, 5, 6, 7])  # the producer stalls now
        assert rt.transfers_in_flight == 1
        m.release_for_reset(rt.clock())  # what TierRuntime.reset_cache does first
        cpu0, t0 = time.thread_time(), time.monotonic()
        rt.drain(timeout_s=1.0)
        cpu, wall = time.thread_time() - cpu0, time.monotonic() - t0
        assert wall >= 1.0 and rt.transfers_in_flight == 1  # still stuck
        assert cpu < 0.25 * wall, f"the drain spun: {cpu:.2f} s of CPU in {wall:.2f} s"
        # The producer resumes: the READ lands and the load ends, ok.
        t0 = time.monotonic()
        while rt.transfers_in_flight:
            assert time.monotonic() - t0 < IN_TIME_S, "the READ never ended"
            producer.step(wait=False)
            consumer.step(wait=False)
        assert _stepped_to_result(consumer, 7).success
    finally:
        consumer.close()
        producer.close()


def test_closing_with_reads_stuck_on_two_stalled_producers_waits_one_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At shutdown every session closes in one pump, and each closing
    session's transfers are fenced before its slots are freed. An in-place
    READ stuck on a stalled producer is waited for up to the data plane's
    drain bound; fenced one session after another, each READ's bound began
    only when its turn came, so two stalled producers held the engine's
    thread two bounds (k producers, k). They now share one."""
    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    bound = 0.6
    producers = [
        StandalonePeer(
            16,
            64 * 1024,
            engine_id=f"two-p{i}-{os.getpid()}",
            timeouts=QUIET,
            same_host=False,
        )
        for i in range(2)
    ]
    consumer = _in_place_reader("two", QUIET)
    m, rt = consumer.manager, consumer.runtime
    keys = [make_key(i) for i in range(4)]
    try:
        for i, producer in enumerate(producers):
            producer.fill(keys, [0, 1, 2, 3])
            consumer.open(f"r{i}", producer.address, f"kv{i}")
        end = time.monotonic() + IN_TIME_S
        while any(
            Answer.RETRY in [m.lookup(f"r{i}", k) for k in keys] for i in range(2)
        ):
            assert time.monotonic() < end, "no lookup answer"
            rt.flush()
            consumer.step()
            for producer in producers:
                producer.step(wait=False)
        rt.data._drain_timeout_s = bound
        # From here neither producer makes a NIXL call: both READs stall.
        rt.submit_load(7, "r0", keys, [4, 5, 6, 7])
        rt.submit_load(8, "r1", keys, [8, 9, 10, 11])
        assert rt.transfers_in_flight == 2
        t0 = time.monotonic()
        consumer.close()
        took = time.monotonic() - t0
        assert bound <= took < 1.5 * bound, f"closing took {took:.2f} s"
    finally:
        consumer.close()
        for producer in producers:
            producer.close()


def test_an_aborted_read_does_not_spin_an_engine_that_steps_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine without a waker (in-process vLLM, a StandalonePeer) waits
    on its sockets at each idle step. A READ given up on when its request
    was aborted, stuck on a stalled producer, still counted as work in
    flight: no step waited, and the idle engine stepped back to back until
    the READ ended or met its drain bound (1 s by default, each vLLM step
    about 4 ms of CPU). It waits now, looking at the data plane every
    DATA_TICK_S, and the job's result comes when the READ ends."""
    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    producer, consumer, keys = _hits_to_read_in_place(
        "sp", Timeouts(heartbeat_interval_s=10.0, abort_ack_s=8.0)
    )
    consumer.runtime.data._drain_timeout_s = 3.0  # past this test's window
    m, rt = consumer.manager, consumer.runtime
    try:
        rt.submit_load(7, "r", keys, [4, 5, 6, 7])  # the producer stalls now
        rt.end_request("r")  # the client aborted
        assert rt.transfers_in_flight == 1 and rt.live_requests == 0
        steps, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 0.5:
            consumer.step()
            steps += 1
        assert steps <= 60, f"the idle engine stepped {steps} times in 0.5 s"
        assert 7 not in consumer.results and rt.transfers_in_flight == 1
        # The producer resumes: the READ ends, and a step returns the result.
        result = _result_once_resumed(producer, consumer, 7, step_consumer=True)
        assert not result.success  # aborted: never a hit
        assert rt.transfers_in_flight == 0
        assert not any(m.state_report().values()), m.state_report()
    finally:
        consumer.close()
        producer.close()


def test_a_short_abort_ack_deadline_does_not_end_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load whose in-place READ is stuck on a stalled producer passes its
    deadline and is given up on; its session then waits ``abort_ack_s`` for
    the data plane to report it. The data plane's drain bound was a fixed
    1 s: with ``abort_ack_timeout_s`` of 1 s or less the session's timer
    ran out first and ended the session, failing every load on it. The
    bound now stays under the session's deadline."""
    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    producer, consumer, keys = _hits_to_read_in_place(
        "aa",
        Timeouts(
            heartbeat_interval_s=10.0,
            fetch_floor_s=0.3,
            abort_ack_s=0.5,
        ),
    )
    m, rt = consumer.manager, consumer.runtime
    try:
        (session,) = m.sessions()
        rt.submit_load(7, "r", keys, [4, 5, 6, 7])  # the producer stalls now
        assert not _stepped_to_result(consumer, 7).success
        assert not session.link.closed, session.link.close_reason
    finally:
        consumer.close()
        producer.close()


def test_a_write_given_up_on_does_not_keep_the_idle_producer_stepping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer with no request of its own WRITEs a peer's Fetch into a
    consumer that stalls (over TCP a WRITE needs the consumer's progress).
    Past the write's deadline it is given up on, and waits for the data
    plane's report (up to the drain bound) with nobody waiting on it; the
    producer's engine stepped ~1,000 times a second all that while."""
    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    pid, bs = os.getpid(), 64 * 1024
    producer = StandalonePeer(
        16,
        bs,
        engine_id=f"gw-p-{pid}",
        timeouts=Timeouts(
            heartbeat_interval_s=10.0,
            fetch_floor_s=0.3,
            abort_ack_s=8.0,
        ),
        same_host=False,
        secret=b"s",  # the write path loads the consumer's metadata
    )
    producer.runtime.data._drain_timeout_s = 3.0  # past the window below
    consumer = StandalonePeer(
        16,
        bs,
        engine_id=f"gw-c-{pid}",
        timeouts=QUIET,
        same_host=False,
        reads=False,
        secret=b"s",
    )
    keys = [make_key(i) for i in range(4)]
    for i, k in enumerate(keys):
        producer.pinner.table[k] = i
    rt = consumer.runtime
    engine: EngineCoreLoop | None = None
    try:
        _look_up(consumer, producer, keys)
        engine = EngineCoreLoop(producer)
        producer.runtime.start_waker(
            lambda: engine.queue.put_nowait("wake"), idle_s=TICK_S
        )
        rt.submit_load(7, "r", keys, [4, 5, 6, 7])  # a Fetch: the producer WRITEs
        # From here the consumer makes no call at all: the WRITE stalls,
        # its deadline (0.3 s) passes, and it is given up on.
        time.sleep(1.0)
        steps = engine.steps
        time.sleep(1.0)
        held = engine.steps - steps
        assert held <= 3, f"the idle producer stepped {held} times in 1 s"
        # The consumer resumes: the WRITE ends, the load fails (too late).
        assert not _stepped_to_result(consumer, 7).success
        rt.end_request("r")
        end = time.monotonic() + 5.0
        while producer.pinner.pinned or producer.runtime.transfers_in_flight:
            assert time.monotonic() < end, "the producer still holds the write"
            consumer.step(wait=False)
            time.sleep(0.01)
        assert producer.runtime.data.in_flight() == 0
    finally:
        if engine is not None:
            engine.close()
        consumer.close()
        producer.close()


def test_close_releases_the_transports_even_when_its_goodbyes_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() set its stop flag, then said its goodbyes and closed the
    transports with nothing to catch a failure between: a pump that raised
    left the control socket, the NIXL agent and UCX's thread open, and every
    later close() returned at once."""
    peer = StandalonePeer(4, 4096, engine_id=f"close-raises-{os.getpid()}")
    rt = peer.runtime

    def boom() -> None:
        raise RuntimeError("injected: the goodbyes failed")

    monkeypatch.setattr(rt, "pump", boom)
    with pytest.raises(RuntimeError, match="injected"):
        rt.close()
    assert rt.control._listener is None
    assert rt.data._agent is None
    rt.close()  # does nothing


def test_two_threads_closing_at_once_tear_down_once() -> None:
    """The stop flag was checked, then set: two callers both got through,
    and the second closed the control transport again (KeyError from its
    poller)."""
    peer = StandalonePeer(4, 4096, engine_id=f"close-twice-{os.getpid()}")
    rt = peer.runtime

    class SlowFlag(threading.Event):
        def is_set(self) -> bool:
            seen = super().is_set()
            time.sleep(0.1)  # the window between the check and the set
            return seen

    rt._stop = SlowFlag()
    errors: list[BaseException] = []

    def close() -> None:
        try:
            rt.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []
    assert rt.control._listener is None and rt.data._agent is None


# ---------------------------------------------------------------------------
# an engine that steps itself, in a forward pass longer than liveness
# ---------------------------------------------------------------------------


def _long_forward(with_keepalive: bool, forward_s: float) -> tuple[bool, Any]:
    """A consumer engine (this process) holds a session to a producer in
    its own process, then spends ``forward_s`` in one forward pass without
    a call into the tier; afterwards it loads from the producer. Returns
    whether the session it had is the one it loads over, and the load."""
    from tests.support.procs import PeerProc

    hb = {"heartbeat_interval_s": 0.5}  # liveness 0.75 s on both sides
    producer = PeerProc(
        {
            "engine_id": f"fwd-p-{os.getpid()}-{with_keepalive}",
            "num_blocks": 16,
            "block_bytes": 4096,
            "fill": 4,
            "timeouts": hb,
        }
    )
    consumer = StandalonePeer(
        16, 4096, engine_id=f"fwd-c-{os.getpid()}", timeouts=Timeouts(**hb)
    )
    rt = consumer.runtime
    keys = [make_key(k) for k in range(4)]
    try:
        if with_keepalive:
            rt.start_waker(None)  # what the adapter starts without a waker
            assert not rt.has_waker  # the engine still steps itself
        with rt.lock:
            first = consumer.fetch(producer.address, "before", keys, [0, 1, 2, 3])
            assert first.ok and first.hits == 4, first
            session = consumer.manager.session(producer.address)
        time.sleep(forward_s)  # the forward pass: no call into the tier
        with rt.lock:
            out = consumer.fetch(producer.address, "after", keys, [4, 5, 6, 7])
            kept = consumer.manager.session(producer.address) is session
        return kept, out
    finally:
        consumer.close()
        producer.stop()


def test_an_engine_in_a_10_s_forward_pass_keeps_its_sessions() -> None:
    """An engine that steps itself (in-process, a data-parallel rank) may
    spend seconds in one prefill, far past its peers' liveness deadline
    (1.5 heartbeat intervals). The tier's keep-alive thread answers for it:
    the session survives a 10 s forward pass and the next load uses it.
    Without it, the same engine is dropped within 2 s, which is what makes
    this test able to fail."""
    kept, out = _long_forward(with_keepalive=True, forward_s=10.0)
    assert kept and out.ok and out.hits == 4, out
    kept, _ = _long_forward(with_keepalive=False, forward_s=2.0)
    assert not kept, "an engine silent for 2 s kept its session without keep-alive"


def test_an_engine_going_idle_exports_its_drained_request_state() -> None:
    """vLLM collects stats at steps only, and an engine whose last request
    ended steps no more: its last collect must export the drained state.
    The report is taken at most once a second while requests are live, so
    the second collect here (at the same instant) would still say 1."""
    from tests.unit.test_metrics import Sink

    from p2p_kv.node.roles import Roles
    from p2p_kv.runtime.metrics import REQUEST_STATE, MetricsExporter

    peer = StandalonePeer(16, 4096, engine_id=f"gauge-{os.getpid()}")
    rt = peer.runtime
    rt.clock = lambda: 100.0  # both collects within the throttle's second
    exporter = MetricsExporter()
    try:
        with rt.lock:
            rt.start_request("r1", Roles())
            busy = Sink()
            rt.collect_metrics(exporter, busy)
            assert busy.gauges[REQUEST_STATE][()] >= 1
            rt.end_request("r1")
            idle = Sink()
            rt.collect_metrics(exporter, idle)
            assert idle.gauges[REQUEST_STATE] == {(): 0}, idle.gauges
    finally:
        peer.close()
