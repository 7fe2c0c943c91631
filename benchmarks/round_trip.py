"""The control plane's round trip against a bare TCP socket's, same run.

Two echo servers run in another process, each idle between trips as a
producer is between lookups:

* **bare TCP**: a blocking Python socket that sends back the 64 bytes it
  reads (``TCP_NODELAY``), the floor of any control plane over TCP;
* **least Python**: what any control plane written in Python with sealed
  frames pays at the least: the same 64 bytes sealed with AES-256-GCM,
  length-prefixed, one ``poll``, one ``recv_into`` and one ``send`` a
  side, and none of the bounds, tables or checks a transport facing the
  network needs. It splits p2p_kv's ratio into the language and cipher's
  share and our transport's;
* **p2p_kv**: a :class:`p2p_kv.control.transport.ControlTransport` (the runtime's
  transport: non-blocking sockets, ``poll``, length-prefixed frames) whose
  frames are sealed and opened with the session's AEAD
  (:class:`p2p_kv.peer.handshake.FrameKeys`, AES-256-GCM) on both ends, as
  a session with a secret seals every frame. The client here waits the way
  an engine's runtime does (``poll`` on the transport).

The last two again **unsealed** (plain frames, as peers without a
``secret`` on one host exchange them): the split of the ratio between the
cipher and the rest. An AEAD call costs about 0.5 us in a hot loop, but a
process woken from idle runs it with cold caches, where one seal or open
took 8-9 us on the 2-core VM; four of them lie on every sealed round trip.

All carry a 64-byte message, about a one-key Lookup. Where this process
may run on two cores or more, the client runs on the first and every echo
on the second, so that each trip crosses the same two cores whatever the
scheduler would have done. Between trips both
sides sleep ``GAP_S`` so that each trip starts from idle, as a lookup does
(a busy loop of trips keeps both processes awake and measures less than
any lookup can take).

Target (control-plane issue): p2p_kv's round trip at most 1.5x the bare
socket's. Run: ``p2p-kv bench round_trip [--json] [--trips N]
[--unpinned]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import statistics
import time
import traceback
from collections.abc import Iterator
from typing import Any

from benchmarks.harness import ProducerProcess, met, producer_host

GAP_S = 0.001
MESSAGE = b"\x5a" * 64
TARGET_X = 1.5
_TIMEOUT_S = 60.0
#: Both ends' frame keys (a fixed pair: what is measured is the AEAD's
#: cost, not the handshake that derives them).
_KEY_A, _KEY_B = b"\x01" * 32, b"\x02" * 32


def _tcp_echo(out: Any, stop: Any) -> None:
    listener = socket.create_server((producer_host(), 0))
    try:
        out.put(("ready", listener.getsockname()[1]))
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while not stop.is_set():
            if not select.select([conn], [], [], 0.1)[0]:
                continue
            data = conn.recv(4096)
            if not data:
                return
            conn.sendall(data)
    except BaseException:
        out.put(("error", traceback.format_exc()))
    finally:
        listener.close()


class _Plain:
    """Frame "keys" of a session without a secret: frames pass as they are."""

    @staticmethod
    def seal(frame: bytes) -> bytes:
        return frame

    @staticmethod
    def open(frame: bytes) -> bytes:
        return frame


def _control_echo(sealed: bool, out: Any, stop: Any) -> None:
    from p2p_kv.control import transport as control
    from p2p_kv.peer import handshake

    keys = handshake.FrameKeys(out=_KEY_B, into=_KEY_A) if sealed else _Plain()
    transport = control.ControlTransport(producer_host(), 0)
    try:
        out.put(("ready", transport.port))
        while not stop.is_set():
            for got in transport.poll(0.1):
                if got.new:
                    transport.trust(got.conn)  # the handshake, taken as done
                elif got.lost:
                    transport.close_conn(got.conn)
                else:
                    reply = keys.seal(keys.open(got.frame))
                    transport.send(got.conn, [reply])
    except BaseException:
        out.put(("error", traceback.format_exc()))
    finally:
        transport.close()


class _LeastPython:
    """One end of the least-Python baseline: sealed (or, ``sealed=False``,
    plain) length-prefixed frames over a non-blocking socket, one poll, one
    read and one write each."""

    def __init__(
        self, sock: socket.socket, out: bytes, into: bytes, sealed: bool = True
    ) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._sock, self._poll = sock, select.poll()
        self._poll.register(sock, select.POLLIN)
        self._buf = memoryview(bytearray(65536))
        self._seal, self._open = AESGCM(out), AESGCM(into)
        self._sealed = sealed
        self._sent = self._got = 0

    def send(self, message: bytes) -> None:
        if not self._sealed:
            self._sock.send(len(message).to_bytes(4, "big") + message)
            return
        nonce = self._sent.to_bytes(12, "little")
        self._sent += 1
        frame = b"\xc1" + self._seal.encrypt(nonce, message, b"\xc1")
        self._sock.send(len(frame).to_bytes(4, "big") + frame)

    def recv(self, timeout_ms: int) -> bytes | None:
        """The next frame, opened; None if none came in time. (Assumes one
        read holds one whole frame, as it does for 64 bytes on loopback.)"""
        if not self._poll.poll(timeout_ms):
            return None
        n = self._sock.recv_into(self._buf)
        if n == 0:
            raise EOFError
        if not self._sealed:
            return bytes(self._buf[4:n])
        nonce = self._got.to_bytes(12, "little")
        self._got += 1
        return self._open.decrypt(nonce, self._buf[5:n], b"\xc1")

    def close(self) -> None:
        self._sock.close()


def _least_python_echo(sealed: bool, out: Any, stop: Any) -> None:
    listener = socket.create_server((producer_host(), 0))
    try:
        out.put(("ready", listener.getsockname()[1]))
        conn, _ = listener.accept()
        end = _LeastPython(conn, out=_KEY_B, into=_KEY_A, sealed=sealed)
        while not stop.is_set():
            got = end.recv(100)
            if got is not None:
                end.send(got)
    except EOFError:
        pass
    except BaseException:
        out.put(("error", traceback.format_exc()))
    finally:
        listener.close()


def _summary(seconds: list[float]) -> dict[str, Any]:
    ordered = sorted(seconds)
    return {
        "median_us": 1e6 * statistics.median(ordered),
        "p90_us": 1e6 * ordered[int(0.9 * (len(ordered) - 1))],
        "trips": len(ordered),
    }


class _Echoed:
    """One end here (``_end``: anything with ``close``) and its echo, run by
    ``body`` in another process."""

    name = ""

    def __init__(self, body: Any, *args: Any) -> None:
        self._echo = ProducerProcess(body, *args, timeout_s=_TIMEOUT_S)
        (self.port,) = self._echo.ready
        self._end: Any = None

    def _answered(self, got: bytes | None, t0: float) -> float:
        """The trip's time, if the echo sent back what was sent."""
        if got != MESSAGE:
            raise AssertionError(f"the {self.name} echo answered other bytes")
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._end is not None:
            self._end.close()
        self._echo.close()


class TcpRoundTrip(_Echoed):
    """A bare socket here and its echo in another process."""

    name = "TCP"

    def __init__(self) -> None:
        super().__init__(_tcp_echo)
        self._end = socket.create_connection((producer_host(), self.port))
        self._end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def trip(self) -> float:
        t0 = time.perf_counter()
        self._end.sendall(MESSAGE)
        got = b""
        while len(got) < len(MESSAGE):
            chunk = self._end.recv(len(MESSAGE) - len(got))
            if not chunk:
                raise RuntimeError("the TCP echo closed")
            got += chunk
        return self._answered(got, t0)


class LeastPythonRoundTrip(_Echoed):
    """The least-Python baseline here and its echo in another process."""

    name = "least-Python"

    def __init__(self, sealed: bool = True) -> None:
        super().__init__(_least_python_echo, sealed)
        sock = socket.create_connection((producer_host(), self.port))
        self._end = _LeastPython(sock, out=_KEY_A, into=_KEY_B, sealed=sealed)

    def trip(self) -> float:
        t0 = time.perf_counter()
        self._end.send(MESSAGE)
        got = None
        while got is None:
            got = self._end.recv(int(_TIMEOUT_S * 1000))
        return self._answered(got, t0)


class ControlRoundTrip(_Echoed):
    """p2p_kv's transport here, sealing and opening as a session does, and
    its echo in another process."""

    name = "control"

    def __init__(self, sealed: bool = True) -> None:
        from p2p_kv.control import transport as control
        from p2p_kv.peer import handshake

        super().__init__(_control_echo, sealed)
        self._keys: Any = (
            handshake.FrameKeys(out=_KEY_A, into=_KEY_B) if sealed else _Plain()
        )
        self._end = control.ControlTransport("127.0.0.1", 0)
        self._peer = f"{producer_host()}:{self.port}"
        self._end.connect(self._peer)
        # The handshake, taken as done: a session trusts its connection once
        # the peer has proved itself, dialled or accepted (p2p_kv.runtime.frames).
        self._end.trust(self._peer)

    def trip(self) -> float:
        t0 = time.perf_counter()
        why = self._end.send(self._peer, [self._keys.seal(MESSAGE)])
        if why:
            raise RuntimeError(f"the control echo is gone: {why}")
        end = t0 + _TIMEOUT_S
        while time.perf_counter() < end:
            for got in self._end.poll(_TIMEOUT_S):
                if got.lost:
                    raise RuntimeError(f"the control echo is gone: {got.why}")
                if got.frame:
                    return self._answered(self._keys.open(got.frame), t0)
        raise RuntimeError("the control echo did not answer")


def _two_cores() -> tuple[int, int] | None:
    """The client's core and the echoes' core, when this process may run
    on two or more: every round trip then crosses the same two cores. Left
    to the scheduler, each echo lands where it lands, and on a 16-core
    server the same echo measured 1.0x and 2.2x bare TCP in two runs."""
    cores = sorted(os.sched_getaffinity(0))
    return (cores[0], cores[1]) if len(cores) >= 2 else None


@contextlib.contextmanager
def _on_core(core: int | None) -> Iterator[None]:
    """This process on ``core`` (if any) for the block, as it was after."""
    if core is None:
        yield
        return
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, was)


#: Each round trip by its name in the results.
ENDS: dict[str, Any] = {
    "tcp": TcpRoundTrip,
    "python": LeastPythonRoundTrip,
    "p2p_kv": ControlRoundTrip,
    "python_plain": lambda: LeastPythonRoundTrip(sealed=False),
    "p2p_kv_plain": lambda: ControlRoundTrip(sealed=False),
}


class RoundTrips:
    """The round trips named (all of :data:`ENDS` unless told), each
    against its own echo process."""

    def __init__(
        self, names: tuple[str, ...] = tuple(ENDS), pinned: bool = True
    ) -> None:
        self.ends: dict[str, Any] = {}
        #: (the client's core, the echoes' core), or None: unpinned
        self.cores = cores = _two_cores() if pinned else None
        with contextlib.ExitStack() as undo:  # closes those made if one fails
            # The echoes inherit the affinity they are spawned with.
            with _on_core(cores[1] if cores else None):
                for name in names:
                    self.ends[name] = end = ENDS[name]()
                    undo.callback(end.close)
            undo.pop_all()
        for _ in range(5):  # warm-ups: the connections' first trips
            for end in self.ends.values():
                end.trip()

    def measure(self, trips: int) -> dict[str, dict[str, Any]]:
        """``trips`` of each, interleaved trip by trip (the machine's noise
        falls on all alike), each from idle, the client on its core."""
        samples: dict[str, list[float]] = {name: [] for name in self.ends}
        with _on_core(self.cores[0] if self.cores else None):
            for _ in range(trips):
                for name, end in self.ends.items():
                    time.sleep(GAP_S)
                    samples[name].append(end.trip())
        return {name: _summary(s) for name, s in samples.items()}

    def close(self) -> None:
        for end in self.ends.values():
            end.close()


def measure(trips: int, pinned: bool = True) -> dict[str, Any]:
    """Medians of the round trips and their ratios."""
    pair = RoundTrips(pinned=pinned)
    try:
        out: dict[str, Any] = pair.measure(trips)
    finally:
        pair.close()
    tcp = out["tcp"]["median_us"]
    ratio = out["p2p_kv"]["median_us"] / tcp
    return {
        **out,
        "ratio": ratio,
        "python_x_tcp": out["python"]["median_us"] / tcp,
        "x_python": out["p2p_kv"]["median_us"] / out["python"]["median_us"],
        "plain_ratio": out["p2p_kv_plain"]["median_us"] / tcp,
        "python_plain_x_tcp": out["python_plain"]["median_us"] / tcp,
        "target_x": TARGET_X,
        "met": ratio <= TARGET_X,
        "cpus": os.cpu_count(),
        "cores": list(pair.cores) if pair.cores else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--trips", type=int, default=600, help="trips of each")
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="leave every process where the scheduler puts it (on one idle "
        "host it often wakes the echo on the client's own core, which is "
        "faster than any wake-up across cores or hosts)",
    )
    args = parser.parse_args(argv)
    result = measure(args.trips, pinned=not args.unpinned)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    tcp, py, ours = result["tcp"], result["python"], result["p2p_kv"]
    where = result["cores"]
    print(
        "round trip of a 64-byte message between two idle processes, us"
        + (f" (client on core {where[0]}, echoes on core {where[1]})" if where else "")
    )
    print(
        f"bare TCP socket     median {tcp['median_us']:7.1f}  p90 {tcp['p90_us']:7.1f}"
    )
    print(
        f"least Python        median {py['median_us']:7.1f}  p90 {py['p90_us']:7.1f}"
        f"  (sealed, one poll/read/write a side: {result['python_x_tcp']:.2f}x TCP)"
    )
    print(
        f"p2p_kv control      median {ours['median_us']:7.1f}  p90 {ours['p90_us']:7.1f}"
        "  (sealed frames, poll-driven)"
    )
    plain, ours_plain = result["python_plain"], result["p2p_kv_plain"]
    print(
        f"least Python, plain median {plain['median_us']:7.1f}  p90 {plain['p90_us']:7.1f}"
        f"  (unsealed: {result['python_plain_x_tcp']:.2f}x TCP)"
    )
    print(
        f"p2p_kv, plain       median {ours_plain['median_us']:7.1f}  "
        f"p90 {ours_plain['p90_us']:7.1f}  (unsealed, no secret: "
        f"{result['plain_ratio']:.2f}x TCP)"
    )
    print(
        f"ratio {result['ratio']:.2f}x bare TCP (target <= {TARGET_X}x): "
        f"{met(result['met'])}; {result['x_python']:.2f}x the least Python"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
