"""TCP for the tests: plain connections whose both ends this process holds
(stand-ins for a control connection in the ``/proc`` proof tests), and the
``UCX_TLS`` that keeps NIXL on UCX's TCP transport."""

from __future__ import annotations

import glob
import socket

#: UCX's TCP transport alone, where a READ needs the peer's progress. NIXL
#: refuses a UCX_TLS without a CUDA transport where GPUs are present (the
#: GPU machine), though no GPU memory is used with it.
TCP_ONLY = "tcp,cuda_copy" if glob.glob("/dev/nvidia[0-9]*") else "tcp"


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
