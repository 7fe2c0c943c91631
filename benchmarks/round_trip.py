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
* **p2p_kv**: a :class:`p2p_kv.control.ControlTransport` (the runtime's
  transport: non-blocking sockets, ``poll``, length-prefixed frames) whose
  frames are sealed and opened with the session's AEAD
  (:class:`p2p_kv.handshake.FrameKeys`, AES-256-GCM) on both ends, as
  a session with a secret seals every frame. The client here waits the way
  an engine's runtime does (``poll`` on the transport).

All carry a 64-byte message, about a one-key Lookup. Between trips both
sides sleep ``GAP_S`` so that each trip starts from idle, as a lookup does
(a busy loop of trips keeps both processes awake and measures less than
any lookup can take).

Target (control-plane issue): p2p_kv's round trip at most 1.5x the bare
socket's. Run: ``p2p-kv bench round_trip [--json] [--trips N]``.
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


def _control_echo(out: Any, stop: Any) -> None:
    from p2p_kv import control, handshake

    keys = handshake.FrameKeys(out=_KEY_B, into=_KEY_A)
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
    """One end of the least-Python baseline: sealed, length-prefixed frames
    over a non-blocking socket, one poll, one read and one write each."""

    def __init__(self, sock: socket.socket, out: bytes, into: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._sock, self._poll = sock, select.poll()
        self._poll.register(sock, select.POLLIN)
        self._buf = memoryview(bytearray(65536))
        self._seal, self._open = AESGCM(out), AESGCM(into)
        self._sent = self._got = 0

    def send(self, message: bytes) -> None:
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
        nonce = self._got.to_bytes(12, "little")
        self._got += 1
        return self._open.decrypt(nonce, self._buf[5:n], b"\xc1")

    def close(self) -> None:
        self._sock.close()


def _least_python_echo(out: Any, stop: Any) -> None:
    listener = socket.create_server((producer_host(), 0))
    try:
        out.put(("ready", listener.getsockname()[1]))
        conn, _ = listener.accept()
        end = _LeastPython(conn, out=_KEY_B, into=_KEY_A)
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

    def __init__(self, body: Any) -> None:
        self._echo = ProducerProcess(body, timeout_s=_TIMEOUT_S)
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

    def __init__(self) -> None:
        super().__init__(_least_python_echo)
        sock = socket.create_connection((producer_host(), self.port))
        self._end = _LeastPython(sock, out=_KEY_A, into=_KEY_B)

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

    def __init__(self) -> None:
        from p2p_kv import control, handshake

        super().__init__(_control_echo)
        self._keys = handshake.FrameKeys(out=_KEY_A, into=_KEY_B)
        self._end = control.ControlTransport("127.0.0.1", 0)
        self._peer = f"{producer_host()}:{self.port}"
        self._end.connect(self._peer)
        # The handshake, taken as done: a session trusts its connection once
        # the peer has proved itself, dialled or accepted (p2p_kv.frames).
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


class RoundTrips:
    """The three round trips, each against its own echo process."""

    def __init__(self) -> None:
        with contextlib.ExitStack() as undo:  # closes those made if one fails
            self.tcp = TcpRoundTrip()
            undo.callback(self.tcp.close)
            self.python = LeastPythonRoundTrip()
            undo.callback(self.python.close)
            self.ours = ControlRoundTrip()
            undo.pop_all()
        for _ in range(5):  # warm-ups: the connections' first trips
            self.tcp.trip()
            self.python.trip()
            self.ours.trip()

    def measure(self, trips: int) -> dict[str, dict[str, Any]]:
        """``trips`` of each, interleaved trip by trip (the machine's noise
        falls on both alike), each from idle."""
        samples: dict[str, list[float]] = {"tcp": [], "python": [], "p2p_kv": []}
        for _ in range(trips):
            time.sleep(GAP_S)
            samples["tcp"].append(self.tcp.trip())
            time.sleep(GAP_S)
            samples["python"].append(self.python.trip())
            time.sleep(GAP_S)
            samples["p2p_kv"].append(self.ours.trip())
        return {name: _summary(s) for name, s in samples.items()}

    def close(self) -> None:
        self.tcp.close()
        self.python.close()
        self.ours.close()


def measure(trips: int) -> dict[str, Any]:
    """Medians of both round trips and their ratio."""
    pair = RoundTrips()
    try:
        out: dict[str, Any] = pair.measure(trips)
    finally:
        pair.close()
    ratio = out["p2p_kv"]["median_us"] / out["tcp"]["median_us"]
    return {
        **out,
        "ratio": ratio,
        "python_x_tcp": out["python"]["median_us"] / out["tcp"]["median_us"],
        "x_python": out["p2p_kv"]["median_us"] / out["python"]["median_us"],
        "target_x": TARGET_X,
        "met": ratio <= TARGET_X,
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--trips", type=int, default=600, help="trips of each")
    args = parser.parse_args(argv)
    result = measure(args.trips)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    tcp, py, ours = result["tcp"], result["python"], result["p2p_kv"]
    print("round trip of a 64-byte message between two idle processes, us")
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
    print(
        f"ratio {result['ratio']:.2f}x bare TCP (target <= {TARGET_X}x): "
        f"{met(result['met'])}; {result['x_python']:.2f}x the least Python"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
