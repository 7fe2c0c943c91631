"""What two peers must agree on before any request crosses between them.

Pure functions over :class:`~p2p_kv.protocol.Hello`. A mismatch is refused
with a reason that names the field, because the alternative -- peers that
hash or lay out blocks differently -- does not fail: it silently misses (or,
worse, loads wrong bytes into the right-looking slot).

The hash seed itself never leaves the process: peers compare a salted digest
of it, plus the hashes of a canonical token sequence, which also catches a
different hash *function* configured under the same name. Anyone who
connects reads a Hello, and a guessable seed (a small PYTHONHASHSEED) falls
to a search over those; so with a shared secret both are keyed with it, and
compared only once the peer has proven the secret (a peer with another
secret is then refused for ``auth``, not for its seed).

With a shared secret, proving it in the handshake is not enough: a party
without it can relay two engines' hellos and proofs to each other and end
up holding a proven session to each. So every frame after the handshake is
sealed under a key derived from the secret and both hellos
(:class:`FrameKeys`: a MAC and a sequence number per direction), which a
relay can pass on but never forge; and the data-plane region (NIXL memory
keys, the shared file), which lets whoever holds it write our KV cache, is
sent only after the peer's proof checked, encrypted under that key.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Final

from p2p_kv.protocol import PROTOCOL_VERSION, Hello

_SEED_SALT = b"p2p_kv/hash-seed/v1"
_KEYED_SALT = b"p2p_kv/keyed-hash/v1"
_MAC_SALT = b"p2p_kv/handshake-mac/v1"
_KEY_SALT = b"p2p_kv/session-key/v1"
#: First byte of a sealed frame: one msgpack never emits, so a sealed frame
#: can never be taken for a plain one or the other way round.
SEALED: Final = 0xC1
_TAG_BYTES: Final = 16


class HandshakeRefused(Exception):
    """The peer does not match us; ``reason`` is a metric label, ``detail``
    the sentence for the log."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Identity:
    """Everything this engine states about itself in its Hello."""

    engine_id: str
    hash_algo: str
    hash_seed: str = field(repr=False)  # it keeps block hashes unguessable
    canonical_hashes: tuple[bytes, ...]
    layout: str
    block_bytes: int
    num_blocks: int
    region: bytes = b""
    secret: bytes | None = field(default=None, repr=False)


def seed_digest(seed: str) -> bytes:
    return hashlib.sha256(_SEED_SALT + seed.encode()).digest()


def _keyed(secret: bytes | None, value: bytes) -> bytes:
    """``value`` as a peer without ``secret`` may see it: keyed with it."""
    if secret is None:
        return value
    mac = hmac.new(secret, _KEYED_SALT + value, hashlib.sha256).digest()
    return mac[: len(value)]


def make_hello(me: Identity, nonce: bytes) -> Hello:
    return Hello(
        version=PROTOCOL_VERSION,
        engine_id=me.engine_id,
        hash_algo=me.hash_algo,
        seed_digest=_keyed(me.secret, seed_digest(me.hash_seed)),
        canonical_hashes=[_keyed(me.secret, h) for h in me.canonical_hashes],
        layout=me.layout,
        block_bytes=me.block_bytes,
        num_blocks=me.num_blocks,
        authenticated=me.secret is not None,
        nonce=nonce,
    )


def check_hello(mine: Hello, theirs: Hello) -> None:
    """Raise :class:`HandshakeRefused` naming the first field that differs.
    Under a secret the hashes are keyed: :func:`check_hashes` compares them
    once the peer's proof checked."""
    if theirs.version != mine.version:
        raise HandshakeRefused(
            "version",
            f"peer speaks protocol v{theirs.version}, we speak v{mine.version}",
        )
    if theirs.engine_id == mine.engine_id:
        raise HandshakeRefused("self", "peer has our own engine id")
    if theirs.hash_algo != mine.hash_algo:
        raise HandshakeRefused(
            "hash_algo",
            f"peer hashes blocks with {theirs.hash_algo!r}, we use "
            f"{mine.hash_algo!r} (set the same prefix_caching_hash_algo)",
        )
    if theirs.authenticated != mine.authenticated:
        who = "we require" if mine.authenticated else "the peer requires"
        raise HandshakeRefused(
            "auth", f"{who} a shared secret and the other side has none"
        )
    if not mine.authenticated:
        check_hashes(mine, theirs)
    if theirs.layout != mine.layout:
        raise HandshakeRefused(
            "layout",
            f"peer's KV layout {theirs.layout!r} differs from ours {mine.layout!r}",
        )
    if theirs.block_bytes != mine.block_bytes:
        raise HandshakeRefused(
            "layout",
            f"peer's block is {theirs.block_bytes} bytes, ours {mine.block_bytes}",
        )
    if theirs.nonce == mine.nonce:
        raise HandshakeRefused("replay", "peer echoed our own nonce")


def check_hashes(mine: Hello, theirs: Hello) -> None:
    """Raise :class:`HandshakeRefused` if the peer would hash blocks
    differently (its seed, or its canonical sequence's hashes)."""
    if theirs.seed_digest != mine.seed_digest:
        raise HandshakeRefused(
            "hash_seed",
            "peer's hash seed differs from ours (set the same PYTHONHASHSEED "
            "on every engine)",
        )
    if theirs.canonical_hashes != mine.canonical_hashes:
        raise HandshakeRefused(
            "canonical_hashes",
            "peer hashes the canonical token sequence differently "
            "(block size or hash function differs)",
        )


def handshake_mac(secret: bytes | None, sender: Hello, receiver: Hello) -> bytes:
    """MAC that ``sender`` sends ``receiver``: binds both hellos (and so both
    fresh nonces), so it can be neither replayed nor reflected."""
    if secret is None:
        return b""
    body = _MAC_SALT + _hello_digest(sender) + _hello_digest(receiver)
    return hmac.new(secret, body, hashlib.sha256).digest()


def verify_mac(
    secret: bytes | None, sender: Hello, receiver: Hello, mac: bytes
) -> None:
    expected = handshake_mac(secret, sender, receiver)
    if not hmac.compare_digest(expected, mac):
        raise HandshakeRefused(
            "auth", "peer's handshake proof does not match our shared secret"
        )


def _hello_digest(hello: Hello) -> bytes:
    from p2p_kv.protocol import encode

    return hashlib.sha256(encode(hello)).digest()


class FrameRefused(Exception):
    """A frame whose seal does not check: forged, replayed, reordered, or
    plain where a sealed one was due."""


@dataclass(slots=True)
class FrameKeys:
    """One session's sealing keys, one per direction (each bound to its
    sender's nonce, so a frame reflected back at its sender fails), and
    the count of frames sealed and opened each way (so a replayed, dropped
    or reordered frame fails)."""

    out: bytes
    into: bytes
    sent: int = 0
    received: int = 0

    def seal(self, frame: bytes) -> bytes:
        tag = _tag(self.out, self.sent, frame)
        self.sent += 1
        return bytes([SEALED]) + tag + frame

    def open(self, frame: bytes) -> bytes:
        if len(frame) <= 1 + _TAG_BYTES or frame[0] != SEALED:
            raise FrameRefused("a plain frame where a sealed one was due")
        body = frame[1 + _TAG_BYTES :]
        if not hmac.compare_digest(
            frame[1 : 1 + _TAG_BYTES], _tag(self.into, self.received, body)
        ):
            raise FrameRefused("a frame whose seal does not match our shared secret")
        self.received += 1
        return body


def frame_keys(secret: bytes | None, mine: Hello, theirs: Hello) -> FrameKeys | None:
    """The session's keys: both sides derive the same pair from the secret
    and both hellos (fresh nonces each), so no two sessions share one."""
    if secret is None:
        return None
    first, second = sorted((_hello_digest(mine), _hello_digest(theirs)))
    session = hmac.new(secret, _KEY_SALT + first + second, hashlib.sha256).digest()

    def direction(nonce: bytes) -> bytes:
        return hmac.new(session, b"from" + nonce, hashlib.sha256).digest()

    return FrameKeys(out=direction(mine.nonce), into=direction(theirs.nonce))


def region_cipher(key: bytes, data: bytes) -> bytes:
    """Encrypt or decrypt (the same operation) a region blob under a
    direction key: XOR with an HMAC-SHA256 keystream. Each key encrypts one
    region only (one per session and direction), so the stream never
    repeats; the frame's seal covers its integrity."""
    stream = bytearray()
    counter = 0
    while len(stream) < len(data):
        stream += hmac.new(
            key, b"region" + counter.to_bytes(8, "little"), hashlib.sha256
        ).digest()
        counter += 1
    n = len(data)
    mixed = int.from_bytes(data, "little") ^ int.from_bytes(stream[:n], "little")
    return mixed.to_bytes(n, "little")


def _tag(key: bytes, seq: int, frame: bytes) -> bytes:
    return hashlib.blake2b(
        seq.to_bytes(8, "little") + frame, key=key, digest_size=_TAG_BYTES
    ).digest()
