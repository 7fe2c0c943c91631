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

import ast
import hashlib
import hmac
import mmap
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
    the sentence for the log naming the peer's value and ours, ``fix`` what
    to change."""

    def __init__(self, reason: str, detail: str, fix: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        #: what to change, for the log line and the doctor
        self.fix = FIXES.get(reason, "") if fix is None else fix


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


@dataclass(frozen=True)
class Layout:
    """The fields of an engine's layout string, as the tier joins them:
    model, dtype, KV groups as ``[(tokens per block, layers), ...]``, KV
    bytes per block of one worker, blocks per chunk, TP, PP."""

    model: str
    dtype: str
    groups: tuple[tuple[int, int], ...]
    worker_bytes_per_block: int
    blocks_per_chunk: int
    tp: int
    pp: int

    @property
    def block_tokens(self) -> int:
        """Tokens per block of the first KV group: the engine hashes its
        canonical blocks with this size."""
        return self.groups[0][0]

    def block_bytes(self, page: int = mmap.PAGESIZE) -> int | None:
        """The tier's block (one primary-tier chunk) in bytes, or None where
        the string does not settle it: with several workers the chunk holds
        one copy per worker or one in all, which the string does not say."""
        if self.tp * self.pp != 1 or self.worker_bytes_per_block <= 0:
            return None
        raw = self.worker_bytes_per_block * self.blocks_per_chunk
        return -(-raw // page) * page


def parse_layout(text: str) -> Layout | None:
    """An engine's layout string's fields, or None for a string not in the
    tier's form (a StandalonePeer's ``standalone``, a test's own)."""
    parts = text.rsplit("|", 6)
    if len(parts) != 7:
        return None
    model, dtype, groups_text, *numbers = parts
    try:
        groups = ast.literal_eval(groups_text)
        wkb, bpc, tp, pp = (int(x) for x in numbers)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not (
        isinstance(groups, list)
        and groups
        and all(
            isinstance(g, tuple)
            and len(g) == 2
            and all(type(x) is int and x > 0 for x in g)
            for g in groups
        )
        and min(bpc, tp, pp) > 0
    ):
        return None
    return Layout(model, dtype, tuple(groups), wkb, bpc, tp, pp)


#: Fixes of the refusals an engine's configuration causes, by reason: the
#: log line and ``p2p-kv doctor --peer`` say them after the refusal's detail.
FIXES: Final = {
    "version": "run the same p2p_kv version on every engine that shares KV",
    "hash_algo": (
        "set the same prefix_caching_hash_algo on every engine that shares KV"
    ),
    "hash_seed": (
        "export the same PYTHONHASHSEED on every engine that shares KV "
        "(vLLM derives its block hashes' seed from it)"
    ),
    "canonical_hashes": (
        "run the same vLLM version, --block-size and prefix_caching_hash_algo "
        "on every engine that shares KV"
    ),
    "auth": "set the same 'secret' (P2P_KV_SECRET) on every engine, or none",
    "layout": (
        "serve the same model with the same dtype, block size and parallelism "
        "on every engine that shares KV"
    ),
    "layout_model": (
        "name as a request's source only an engine serving the same model "
        "(the router's choice): engines of different models share no KV"
    ),
    "layout_dtype": (
        "set the same --dtype and --kv-cache-dtype, and the same canonical_layout "
        "in kv_connector_extra_config, on every engine that shares KV"
    ),
    "layout_block_size": "set the same --block-size on every engine that shares KV",
    "layout_kv_groups": (
        "serve the same model with the same attention settings (sliding "
        "window, hybrid layers) on every engine that shares KV"
    ),
    "layout_tp": (
        "run the same --tensor-parallel-size on every engine that shares KV: "
        "p2p_kv shares blocks only between engines of one TP size"
    ),
    "layout_pp": (
        "run the same --pipeline-parallel-size on every engine that shares KV"
    ),
    "layout_chunk": (
        "set the same block_size (or blocks_per_chunk) in kv_connector_extra_config "
        "on every engine that shares KV: it is the offloaded chunk"
    ),
    "layout_kv_bytes": (
        "set the same --kv-cache-dtype and parallelism on every engine that "
        "shares KV (the bytes a KV block holds differ: one worker's, or in the "
        "canonical layout every worker's)"
    ),
    "layout_block_bytes": (
        "run the same p2p_kv and vLLM versions and the same "
        "kv_connector_extra_config on every engine that shares KV"
    ),
}


def _groups_text(groups: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{layers} layers of {tokens}" for tokens, layers in groups)


def _layout_differences(theirs: Layout, mine: Layout) -> list[tuple[str, str]]:
    """The fields in which two engines' layouts differ, each as (reason,
    sentence naming the peer's value and ours), the one that explains the
    others first (another model differs in everything)."""
    out: list[tuple[str, str]] = []
    if theirs.model != mine.model:
        out.append(
            ("layout_model", f"peer serves model {theirs.model!r}, we {mine.model!r}")
        )
    if theirs.dtype != mine.dtype:
        out.append(
            (
                "layout_dtype",
                f"peer's KV dtype is {theirs.dtype!r}, ours {mine.dtype!r}",
            )
        )
    t_tokens = [t for t, _ in theirs.groups]
    m_tokens = [t for t, _ in mine.groups]
    if len(t_tokens) == len(m_tokens) and t_tokens != m_tokens:
        out.append(
            (
                "layout_block_size",
                "peer's blocks hold "
                f"{'/'.join(map(str, t_tokens))} tokens (block_size), ours "
                f"{'/'.join(map(str, m_tokens))}",
            )
        )
    elif theirs.groups != mine.groups:
        out.append(
            (
                "layout_kv_groups",
                f"peer's KV cache groups are {_groups_text(theirs.groups)} tokens "
                f"a block, ours {_groups_text(mine.groups)}",
            )
        )
    if theirs.tp != mine.tp:
        out.append(
            (
                "layout_tp",
                f"peer runs tensor_parallel_size {theirs.tp}, we {mine.tp}",
            )
        )
    if theirs.pp != mine.pp:
        out.append(
            (
                "layout_pp",
                f"peer runs pipeline_parallel_size {theirs.pp}, we {mine.pp}",
            )
        )
    if theirs.blocks_per_chunk != mine.blocks_per_chunk:
        out.append(
            (
                "layout_chunk",
                f"peer offloads {theirs.blocks_per_chunk} blocks a chunk, we "
                f"{mine.blocks_per_chunk}",
            )
        )
    if theirs.worker_bytes_per_block != mine.worker_bytes_per_block:
        out.append(
            (
                "layout_kv_bytes",
                f"peer's worker holds {theirs.worker_bytes_per_block} bytes a KV "
                f"block, ours {mine.worker_bytes_per_block}",
            )
        )
    return out


def layout_refusal(theirs: str, mine: str) -> HandshakeRefused:
    """The refusal of a peer whose layout string differs from ours: by the
    field that differs (``layout_block_size``, ``layout_tp``, ...) when both
    are in the tier's form, naming both values; else ``layout``. The detail
    ends with both strings whole (the doctor probes with the peer's)."""
    both = f"peer's KV layout {theirs!r} differs from ours {mine!r}"
    t, m = parse_layout(theirs), parse_layout(mine)
    diffs = _layout_differences(t, m) if t is not None and m is not None else []
    if not diffs:
        return HandshakeRefused("layout", both, FIXES["layout"])
    (reason, first), others = diffs[0], [r for r, _ in diffs[1:]]
    also = f"; also {', '.join(r.removeprefix('layout_') for r in others)}"
    return HandshakeRefused(
        reason, f"{first}{also if others else ''} ({both})", FIXES[reason]
    )


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
            f"peer hashes blocks with {theirs.hash_algo!r}, we use {mine.hash_algo!r}",
        )
    if theirs.authenticated != mine.authenticated:
        who = "we require" if mine.authenticated else "the peer requires"
        raise HandshakeRefused(
            "auth", f"{who} a shared secret and the other side has none"
        )
    # The layout before the hashes: another block size also hashes the
    # canonical sequence differently, and its own reason says which to fix.
    if theirs.layout != mine.layout:
        raise layout_refusal(theirs.layout, mine.layout)
    if theirs.block_bytes != mine.block_bytes:
        raise HandshakeRefused(
            "layout_block_bytes",
            f"peer's block is {theirs.block_bytes} bytes, ours {mine.block_bytes}",
        )
    if not mine.authenticated:
        check_hashes(mine, theirs)
    if theirs.nonce == mine.nonce:
        raise HandshakeRefused("replay", "peer echoed our own nonce")


def check_hashes(mine: Hello, theirs: Hello) -> None:
    """Raise :class:`HandshakeRefused` if the peer would hash blocks
    differently (its seed, or its canonical sequence's hashes)."""
    if theirs.seed_digest != mine.seed_digest:
        raise HandshakeRefused(
            "hash_seed",
            f"peer's hash seed differs from ours ({_seed_values(mine, theirs)})",
        )
    if theirs.canonical_hashes != mine.canonical_hashes:
        raise HandshakeRefused(
            "canonical_hashes",
            "peer hashes the canonical token sequence differently "
            "(its vLLM's hash function or block size differs)",
        )


def _seed_values(mine: Hello, theirs: Hello) -> str:
    """Both seeds as an operator can compare them: their digests as each
    engine's ``p2p_kv identity`` line shows them (keyed under a secret,
    where the line's plain digests are what to compare)."""
    if mine.authenticated:
        return "compare the seed digest on each engine's 'p2p_kv identity' line"
    return (
        f"seed digest {theirs.seed_digest.hex()[:16]} there, "
        f"{mine.seed_digest.hex()[:16]} here"
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
