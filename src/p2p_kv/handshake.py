"""What two peers must agree on before any request crosses between them,
and the cryptography that protects them once they agree.

Pure functions over :class:`~p2p_kv.protocol.Hello`. A mismatch is refused
with a reason that names the field, because the alternative -- peers that
hash or lay out blocks differently -- does not fail: it silently misses (or,
worse, loads wrong bytes into the right-looking slot).

The hash seed itself never leaves the process: peers compare a salted digest
of it, plus the hashes of a canonical token sequence, which also catches a
different hash *function* configured under the same name. Anyone who
connects reads a Hello, and a guessable seed (a small PYTHONHASHSEED) falls
to a search over those; so with a shared secret both are keyed with it
(HMAC-SHA256, truncated to the value's length), and compared only once the
peer has proven the secret (a peer with another secret is then refused for
``auth``, not for its seed).

Cryptography, with a shared secret (none of it runs without one: then there
is no authentication and nothing is encrypted). Only vetted constructions
are used, from the standard library and ``cryptography``:

* **Proof of the secret** (:func:`handshake_mac`): each side sends
  HMAC-SHA256 keyed with the secret over a fixed label and the SHA-256
  digests of the sender's and the receiver's Hello. Each Hello carries a
  fresh random nonce (16 bytes from the OS, ``runtime.fresh_nonce``), so a
  proof is good for one session and one direction only: it can be neither
  replayed nor reflected. Compared in constant time.
* **Session keys** (:func:`frame_keys`): one 256-bit key per direction,
  HKDF-SHA256 (RFC 5869) with the secret as input keying material, both
  hellos' SHA-256 digests (sorted, so both sides agree) as salt, and a fixed
  label followed by the *sender's* nonce as info. Both hellos in the salt
  make every session's keys fresh; the sender's nonce in the info gives
  each direction its own key, so a frame reflected back at its sender does
  not open. The secret's other uses (the proof, keyed hashes) are HMACs
  with distinct fixed labels, never a key or salt of HKDF.
* **Frames** (:class:`FrameKeys`): every frame after the handshake is
  sealed with AES-256-GCM (NIST SP 800-38D, an AEAD: the frame is
  encrypted, not only authenticated). The sealed frame is the byte
  :data:`SEALED` followed by ciphertext and the 16-byte GCM tag. The 96-bit AEAD
  nonce is the count of frames sealed so far in that direction (12 bytes,
  little-endian): under one key it never repeats, and it is not sent, so a
  replayed, dropped or reordered frame is opened under the wrong nonce and
  fails, which ends the session. The marker byte is the AEAD's associated
  data (see :class:`FrameKeys`).

The secret is used as key material as it is, not stretched: a secret that
can be guessed falls to an offline search over one recorded handshake's
proofs. It must be a random key (32 random bytes, hex-encoded, say), not a
password.

Proving the secret in the handshake is not enough on its own: a party
without it can relay two engines' hellos and proofs to each other, and each
proof checks. The sealed frames are what such a relay can pass on but
neither forge nor read. The data-plane region (NIXL memory keys, the shared
file), which lets whoever holds it write our KV cache, is sent only after
the peer's proof checked, in a sealed frame like every other after the
handshake: the seal is its encryption.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2p_kv.protocol import PROTOCOL_VERSION, Hello

_SEED_SALT = b"p2p_kv/hash-seed/v1"
_KEYED_SALT = b"p2p_kv/keyed-hash/v1"
_MAC_SALT = b"p2p_kv/handshake-mac/v1"
#: HKDF info of a frame key, followed by the sending side's nonce.
_FRAME_KEY_INFO = b"p2p_kv/frame-key/v1 from "
#: First byte of a sealed frame: one msgpack never emits, so a sealed frame
#: can never be taken for a plain one or the other way round.
SEALED: Final = 0xC1
_MARKER: Final = bytes([SEALED])
#: AES-256-GCM's key, nonce and tag sizes. AES-GCM rather than
#: ChaCha20-Poly1305: every server CPU a vLLM fleet runs on has AES and
#: carry-less multiply instructions, with which OpenSSL seals and opens a
#: 100-byte frame in 1.8 us against ChaCha20-Poly1305's 4.4 us, and 1 MiB in
#: 0.29 ms against 0.85 ms (``docs/architecture.md``, "Control plane").
_KEY_BYTES: Final = 32
_NONCE_BYTES: Final = 12
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
    """A frame that does not open: forged, tampered with, replayed,
    reordered, after a dropped one, reflected, sealed under another secret,
    or plain where a sealed one was due."""


@dataclass(slots=True)
class FrameKeys:
    """One session's frame keys, one per direction (``out`` seals what we
    send, ``into`` opens what we get), and the count of frames sealed and
    opened each way, which is each direction's AEAD nonce.

    A sealed frame is ``SEALED`` + AES-256-GCM(key, nonce=count,
    plaintext=frame, associated data=``SEALED``). The marker byte is the
    associated data so that the tag covers every byte on the wire: nothing
    of a sealed frame is outside its seal, and the marker cannot be
    rewritten onto a ciphertext sealed as something else (a frame format
    that adds a second marker stays bound to the one it was sealed with).
    A frame whose first byte is not the marker is refused before any
    decryption anyway; the associated data makes that rule part of the
    construction rather than of the parser."""

    out: bytes = field(repr=False)
    into: bytes = field(repr=False)
    sent: int = 0
    received: int = 0
    _seal: AESGCM = field(init=False, repr=False, compare=False)
    _open: AESGCM = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._seal = AESGCM(self.out)
        self._open = AESGCM(self.into)

    def seal(self, frame: bytes) -> bytes:
        nonce = self.sent.to_bytes(_NONCE_BYTES, "little")  # raises past 2**96
        self.sent += 1
        return _MARKER + self._seal.encrypt(nonce, frame, _MARKER)

    def open(self, frame: bytes) -> bytes:
        if len(frame) < 1 + _TAG_BYTES or frame[0] != SEALED:
            raise FrameRefused("a plain frame where a sealed one was due")
        try:
            plain = self._open.decrypt(
                self.received.to_bytes(_NONCE_BYTES, "little"),
                memoryview(frame)[1:],
                _MARKER,
            )
        except InvalidTag:
            raise FrameRefused(
                "a frame whose seal does not match our shared secret"
            ) from None
        self.received += 1
        return plain


def frame_keys(secret: bytes | None, mine: Hello, theirs: Hello) -> FrameKeys | None:
    """The session's keys (see the module docstring): both sides derive the
    same pair, each direction's key from the secret, both hellos and the
    sender's nonce."""
    if secret is None:
        return None
    first, second = sorted((_hello_digest(mine), _hello_digest(theirs)))

    def direction(sender_nonce: bytes) -> bytes:
        return HKDF(
            algorithm=SHA256(),
            length=_KEY_BYTES,
            salt=first + second,
            info=_FRAME_KEY_INFO + sender_nonce,
        ).derive(secret)

    return FrameKeys(out=direction(mine.nonce), into=direction(theirs.nonce))
