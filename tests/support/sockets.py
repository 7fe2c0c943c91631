"""Plain TCP connections whose both ends this process holds: stand-ins for
a control connection in the ``/proc`` proof tests."""

from __future__ import annotations

import socket


def tcp_connection(host: str) -> tuple[socket.socket, socket.socket, socket.socket]:
    """(listener, our end, the accepted far end) of one TCP connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family)
    listener.bind((host, 0))
    listener.listen()
    ours = socket.socket(family)
    ours.connect(listener.getsockname()[:2])
    far, _ = listener.accept()
    return listener, ours, far
