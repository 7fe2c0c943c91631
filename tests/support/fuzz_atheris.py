"""Coverage-guided fuzzing of the decoder and live sessions with atheris.

The hypothesis fuzzer (``tests/unit/test_fuzz_session.py``) draws from a
grammar; libFuzzer instead mutates raw bytes toward new coverage of
``p2p_kv``'s own code, which finds the inputs nobody thought to write down.
Each input is split into up to 12 frames, each fed to one of two engines
mid-load exactly as the hypothesis test does, with the same checks after
every frame and the same drain at the end. Any exception is a crash. The
corpus starts from valid frames about the live request, so mutations
reach the session instead of dying in the decoder.

Not part of ``make test`` (atheris is an optional install)::

    pip install atheris
    python -m tests.support.fuzz_atheris -runs=100000 -max_len=4096
"""

from __future__ import annotations

import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["p2p_kv"]):
    pass

from p2p_kv.protocol import Abort, AbortAck, Fetch, TransferDone, encode
from tests.unit import test_fuzz_session as fz


def frames(data: bytes) -> Iterator[tuple[int, bytes]]:
    """``data`` as up to 12 (header, frame) pairs: a header byte (bit 0:
    which engine; bits 1-2: what happens after the frame; bit 3: whether
    writes succeed), a length byte, the frame. Simple enough for seeds."""
    i = 0
    for _ in range(12):
        if i + 2 > len(data):
            return
        header, length = data[i], data[i + 1]
        yield header, data[i + 2 : i + 2 + length]
        i += 2 + length


def one_input(data: bytes) -> None:
    net = fz.make_world()
    for header, frame in frames(data):
        fz.feed(net, "ab"[header & 1], frame, "any")
        fz.check(net, hostile=True)
        step = (header >> 1) & 3
        if step == 1:
            net.step()
            net.serve()
        elif step == 2:
            net.complete_writes(ok=bool(header & 8))
        elif step == 3:
            net.advance(0.4)
            net.step()
        for eng in net.engines.values():
            eng.collect(net.now)
        fz.check(net, hostile=True)
    fz.drain(net, hostile=True)


def seeds() -> list[bytes]:
    """One valid frame of every kind about the live request (kv1, gen 1,
    the consumer's job 198), for each engine and each follow-up."""
    net = fz.make_world()
    out = []
    for i in range(3 * len(fz.TYPES)):
        rng = random.Random(i)
        for target in "ab":
            frame, _ = fz.build(rng, net, target, hostile=True)
            if len(frame) < 256:
                for header in (0, 2, 4, 6, 8, 12):
                    out.append(bytes([header | (target == "b"), len(frame)]) + frame)
    for msg in (
        Fetch("kv1", 1, 198, fz.KEYS, fz.LOAD_SLOTS),
        TransferDone("kv1", 1, 198, True),
        Abort("kv1", 1),
        AbortAck("kv1", 1),
    ):
        frame = encode(msg)
        for header in (0, 1, 5, 9):
            out.append(bytes([header, len(frame)]) + frame)
    return out


def main() -> None:
    corpus = tempfile.mkdtemp(prefix="p2p_kv-atheris-")
    for i, seed in enumerate(seeds()):
        Path(corpus, f"seed-{i}").write_bytes(seed)
    atheris.Setup([*sys.argv, corpus], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
