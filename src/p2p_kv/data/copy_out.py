"""The copy of a staged READ's piece into the engine's slots, off the
engine's thread.

Why threads: a staged READ moves its bytes twice, into staging and out of
it. Done one after the other on one thread, the copy out adds its whole
time to the READ's (on one host, where UCX's CMA runs the READ inside its
post, a load reached about half of raw READ). Run beside the next piece's
READ, it costs only the last piece's copy. Between hosts the READ runs on
the NIC while we copy, and one copy stream (about 10-20 GB/s here) would
cap a 200-400 Gb/s link; so a piece is split into stripes, one per thread.

numpy releases the GIL while it copies, so the stripes run in parallel
with each other and with the engine's thread. The threads hold no lock of
ours and touch no state but the bytes of the piece they were given.
Whoever hands them a piece owns it until :meth:`Copying.done`: the
staging blocks stay taken and the slots are not reported until then, and
a READ given up on waits for its pieces' copies before its slots go back
(:meth:`Copying.wait`), so no copy lands in slots handed to another
request.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Final

__all__ = ["COPY_THREADS", "INLINE_COPY_BYTES", "CopyThreads", "Copying"]

#: At most this many threads copy pieces out of staging (made at the first
#: staged READ that needs them), and no more than the cores the engine's
#: thread may run on.
COPY_THREADS: Final = 4
#: A piece this small is copied on the caller's thread: handing it to a
#: thread and hearing back costs about as much as the copy.
INLINE_COPY_BYTES: Final = 1 << 20


class Copying:
    """One piece's copy, in stripes running on :class:`CopyThreads`."""

    def __init__(
        self, stripes: list[Future[None]], help_out: Callable[[], None]
    ) -> None:
        self._stripes = stripes
        self._help_out = help_out

    def done(self) -> bool:
        return all(f.done() for f in self._stripes)

    def wait(self) -> BaseException | None:
        """Until every stripe has ended (a copy at memory speed: bounded by
        the piece's bytes); the first stripe's error, if any failed. A
        caller that has to wait copies the stripes no thread has taken yet
        itself (:meth:`CopyThreads.help_out`)."""
        if not self.done():
            self._help_out()
        wait(self._stripes)
        for f in self._stripes:
            if f.exception() is not None:
                return f.exception()
        return None


class CopyThreads:
    """The threads, all started at first use (a ``ThreadPoolExecutor``
    starts one more only when none is idle by its count, which drifts up
    with every task done: here the second thread never started, and the
    stripes ran one after the other). ``wake`` is called (from a thread)
    each time a piece's copy ends, so a caller waiting on other events
    hears of it at once."""

    def __init__(self, threads: int | None = None) -> None:
        #: None: one a core the caller may run on (:meth:`usable`).
        self.threads = threads
        self.wake: Callable[[], None] | None = None
        self._work: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None]
        self._work = queue.SimpleQueue()
        self._started: list[threading.Thread] = []

    def usable(self) -> int:
        """How many threads copy: as made, or one a core the calling thread
        may run on, at most :data:`COPY_THREADS`, and none when it may run
        on one core only: then pieces are copied on the caller's thread.
        The affinity counts, not the machine's cores: an engine pinned to
        one core gains nothing from threads that share it with the READ,
        and pays a wake-up for every piece handed to one."""
        if self.threads is None:
            try:
                cores = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):  # not Linux
                cores = os.cpu_count() or 1
            self.threads = min(COPY_THREADS, cores) if cores > 1 else 0
        return self.threads

    def run(self, stripes: Sequence[Callable[[], None]]) -> Copying:
        """Start ``stripes`` (each copies its share of one piece)."""
        if not self._started:
            for i in range(max(1, self.usable())):
                t = threading.Thread(
                    target=self._serve, name=f"p2p_kv-copy-{i}", daemon=True
                )
                t.start()
                self._started.append(t)
        futures: list[Future[None]] = [Future() for _ in stripes]
        copying = Copying(futures, self.help_out)
        wake = self.wake
        if wake is not None:

            def one_done(_: Future[None]) -> None:
                if copying.done():  # the last stripe (rarely two: a spare wake)
                    wake()

            for f in futures:
                f.add_done_callback(one_done)
        for stripe, f in zip(stripes, futures, strict=True):
            self._work.put((stripe, f))
        return copying

    def help_out(self) -> None:
        """Copy, on the calling thread, the stripes still queued. Only a
        caller with nothing else to do calls it (it waits for the copies):
        the last piece of a load has nothing to overlap, and a thread that
        must wake first started 100-200 us late on a 2-core machine and
        left its stripe to a busy neighbour."""
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                return
            if item is None:  # close() is ending a thread: leave it to one
                self._work.put(None)
                return
            self._do(*item)

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            self._do(*item)

    @staticmethod
    def _do(stripe: Callable[[], None], future: Future[None]) -> None:
        try:
            stripe()
        except BaseException as exc:  # the piece fails, the thread goes on
            future.set_exception(exc)
        else:
            future.set_result(None)

    def close(self) -> None:
        """Wait for the copies still running, then end the threads."""
        started, self._started = self._started, []
        for _ in started:
            self._work.put(None)
        for t in started:
            t.join()
