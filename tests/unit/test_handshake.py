"""Two Sessions wired by hand through the real codec: what they agree on,
what they refuse and why, and what never crosses the wire."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2p_kv.node.manager import LoadManager
from p2p_kv.peer import LinkState, Session
from p2p_kv.peer.events import RegionKnown
from p2p_kv.peer.handshake import (
    SEALED,
    FrameKeys,
    FrameRefused,
    Identity,
    check_hello,
    frame_keys,
    layout_refusal,
    make_hello,
    seed_digest,
)
from p2p_kv.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    Fetch,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    Lookup,
    Message,
    Region,
    TransferDone,
    decode,
    encode,
)

SEED = "seed-8c1f-do-not-leak-4e2a"
SECRET = b"shared-secret-value-77"


def ident(name: str, **over: Any) -> Identity:
    fields: dict[str, Any] = dict(
        engine_id=name,
        hash_algo="sha256_cbor",
        hash_seed=SEED,
        canonical_hashes=(b"c1" * 8, b"c2" * 8),
        layout="NHD:bf16:2x4x16",
        block_bytes=256,
        num_blocks=64,
        region=f"region-of-{name}".encode(),
    )
    fields.update(over)
    return Identity(**fields)


class Wire:
    """Two sessions and the frames between them (every frame is kept), as
    the runtime carries them: sealed by the sender, opened by the receiver
    (a closed receiver reads nothing)."""

    def __init__(self, a: Session, b: Session) -> None:
        self.a, self.b = a, b
        self.frames: list[bytes] = []
        self.sent: dict[str, list[Message]] = {"a": [], "b": []}
        #: each side's frames as on the wire, in step with ``sent``
        self.wire: dict[str, list[bytes]] = {"a": [], "b": []}

    def pump(self, now: float = 0.0, rounds: int = 10) -> None:
        for _ in range(rounds):
            moved = False
            for name, src, dst in (("a", self.a, self.b), ("b", self.b, self.a)):
                for msg in src.take_outbox(now):
                    moved = True
                    frame = src.link.seal(msg, encode(msg))
                    self.frames.append(frame)
                    self.sent[name].append(msg)
                    self.wire[name].append(frame)
                    if not dst.link.closed:
                        dst.receive(dst.link.open(frame), now)
            if not moved:
                return


def pair(ia: Identity, ib: Identity) -> Wire:
    a = Session("b:1", ia, 0.0, nonce=b"A" * 16)
    b = Session("in:1", ib, 0.0, nonce=b"B" * 16)
    return Wire(a, b)


def sent_types(msgs: list[Message]) -> list[type]:
    return [type(m) for m in msgs]


# ---------------------------------------------------------------------------
# agreement
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_matching_peers_become_ready_with_the_same_config(
    secret: bytes | None,
) -> None:
    w = pair(ident("a", secret=secret), ident("b", secret=secret))
    assert w.a.link.state is LinkState.HANDSHAKING and not w.a.link.ready
    w.pump()
    assert w.a.link.ready and w.b.link.ready
    assert w.a.link.refusal is None and w.b.link.refusal is None
    ha, hb = w.b.link.peer_hello, w.a.link.peer_hello  # a's hello as b saw it, and back
    assert ha is not None and hb is not None
    assert (ha.engine_id, hb.engine_id) == ("a", "b")
    for field in (
        "version",
        "hash_algo",
        "seed_digest",
        "canonical_hashes",
        "layout",
        "block_bytes",
        "num_blocks",
        "authenticated",
    ):
        assert getattr(ha, field) == getattr(hb, field), field
    assert ha.authenticated is (secret is not None)
    assert ha.version == PROTOCOL_VERSION
    # each side sent exactly Hello, HelloAck (a MAC only with a secret), and
    # its region once the other's proof checked: in a sealed frame with a
    # secret (test_a_region_blob_is_unreadable_on_the_wire_only_with_a_secret)
    for name in "ab":
        assert sent_types(w.sent[name]) == [Hello, HelloAck, Region]
        ack, region = w.sent[name][1:]
        assert isinstance(ack, HelloAck) and isinstance(region, Region)
        assert (len(ack.mac) == 32) is (secret is not None)
        assert region.region == f"region-of-{name}".encode()
        sealed = [f[0] == SEALED for f in w.wire[name]]
        assert sealed == [False, False, secret is not None]
    assert (
        w.a.link.peer_region == b"region-of-b"
        and w.b.link.peer_region == b"region-of-a"
    )
    assert (
        not w.a.link.counters.protocol_errors and not w.b.link.counters.protocol_errors
    )


def test_ready_sessions_carry_requests() -> None:
    w = pair(ident("a"), ident("b"))
    w.a.send_lookup("kv1", 1, [b"k1", b"k2"], 0.0)  # queued until ready
    w.pump()
    assert w.b.producer.has_lookups_to_serve


def test_different_num_blocks_is_fine() -> None:
    w = pair(ident("a", num_blocks=64), ident("b", num_blocks=4096))
    w.pump()
    assert w.a.link.ready and w.b.link.ready
    assert w.a.link.peer_hello is not None and w.a.link.peer_hello.num_blocks == 4096


# ---------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------

MISMATCHES = [
    ("hash_seed", {"hash_seed": "another-seed"}),
    ("hash_algo", {"hash_algo": "xxhash"}),
    ("canonical_hashes", {"canonical_hashes": (b"c1" * 8, b"zz" * 8)}),
    ("canonical_hashes", {"canonical_hashes": (b"c1" * 8,)}),
    ("layout", {"layout": "HND:bf16:2x4x16"}),
    ("layout_block_bytes", {"block_bytes": 512}),
    ("layout_block_size", {"layout": "m|bf16|[(32, 2)]|4096|1|1|1"}),
    ("layout_tp", {"layout": "m|bf16|[(16, 2)]|4096|1|2|1"}),
    ("auth", {"secret": SECRET}),
]


def assert_refused(s: Session, reason: str) -> None:
    assert s.link.refusal is not None, "not refused"
    assert s.link.refusal.reason == reason
    assert s.link.state is LinkState.CLOSED and s.link.closed and not s.link.ready
    assert s.link.counters.refused == {reason: 1}
    assert s.link.close_reason.startswith("refused")


@pytest.mark.parametrize(
    ("reason", "over"),
    MISMATCHES,
    ids=[f"{r}-{i}" for i, (r, _) in enumerate(MISMATCHES)],
)
@pytest.mark.parametrize("side", ["a", "b"])
def test_mismatch_is_refused_by_both_sides(
    reason: str, over: dict[str, Any], side: str
) -> None:
    ia, ib = ident("a"), ident("b")
    if str(over.get("layout", "")).startswith("m|"):  # the tier's form
        ia, ib = (ident(n, layout="m|bf16|[(16, 2)]|4096|1|1|1") for n in "ab")
    if side == "a":
        ia = ident("a", **over)
    else:
        ib = ident("b", **over)
    w = pair(ia, ib)
    w.pump()
    # Hellos cross: both check the other's before seeing any Goodbye.
    assert_refused(w.a, reason)
    assert_refused(w.b, reason)
    for name in "ab":
        types = sent_types(w.sent[name])
        assert types[0] is Hello and types[-1] is Goodbye, types
        assert HelloAck not in types
        bye = w.sent[name][-1]
        assert isinstance(bye, Goodbye) and reason in bye.reason


def test_own_engine_id_is_refused() -> None:
    w = pair(ident("a"), ident("a"))
    w.pump()
    assert_refused(w.a, "self")
    assert_refused(w.b, "self")


def test_different_secrets_are_refused_as_auth() -> None:
    w = pair(ident("a", secret=SECRET), ident("b", secret=b"other-secret"))
    w.pump()
    # Hellos match (both authenticated); each side's MAC check fails.
    assert_refused(w.a, "auth")
    assert w.b.link.closed and not w.b.link.ready
    assert w.b.link.refusal is not None and w.b.link.refusal.reason == "auth"
    for name in "ab":
        types = sent_types(w.sent[name])
        assert types[:2] == [Hello, HelloAck] and types[-1] is Goodbye


def test_protocol_version_mismatch() -> None:
    a = Session("b:1", ident("a"), 0.0, nonce=b"A" * 16)
    b = Session("in:1", ident("b"), 0.0, nonce=b"B" * 16)
    (hello_b,) = b.take_outbox(0.0)
    assert isinstance(hello_b, Hello)
    future = msgspec.structs.replace(hello_b, version=PROTOCOL_VERSION + 1)
    a.receive(decode(encode(future)), 0.0)
    assert_refused(a, "version")
    out = a.take_outbox(0.0)
    assert sent_types(out) == [Hello, Goodbye]


def test_replayed_own_hello_is_refused() -> None:
    a = Session("b:1", ident("a"), 0.0, nonce=b"A" * 16)
    other = make_hello(ident("b"), b"A" * 16)  # echoes a's nonce
    a.receive(decode(encode(other)), 0.0)
    assert_refused(a, "replay")


def test_the_manager_takes_each_session_nonce_from_its_caller() -> None:
    # The core draws no randomness: every session's Hello carries the next
    # nonce the caller's source gives, so a run can be replayed exactly.
    nonces = iter([b"N1" * 8, b"N2" * 8])
    m = LoadManager(ident("a"), nonces=lambda: next(nonces))
    first, second = m.peers.on_inbound(0.0), m.peers.on_inbound(0.0)
    hellos = {p: [decode(f) for f in fs] for p, fs in m.take_frames(0.0)}
    assert [h.nonce for (h,) in (hellos[first], hellos[second])] == [
        b"N1" * 8,
        b"N2" * 8,
    ]


def test_forged_mac_is_refused() -> None:
    w = pair(ident("a", secret=SECRET), ident("b", secret=SECRET))
    (hello_a,) = w.a.take_outbox(0.0)
    (hello_b,) = w.b.take_outbox(0.0)
    w.a.receive(decode(encode(hello_b)), 0.0)
    w.a.receive(decode(encode(HelloAck(mac=b"\x00" * 32))), 0.0)
    assert_refused(w.a, "auth")
    w.b.receive(decode(encode(hello_a)), 0.0)
    w.b.receive(decode(encode(HelloAck(mac=b""))), 0.0)
    assert_refused(w.b, "auth")


def test_check_hello_names_the_first_difference() -> None:
    mine = make_hello(ident("a"), b"A" * 16)
    theirs = make_hello(ident("b", layout="x", block_bytes=1), b"B" * 16)
    with pytest.raises(Exception, match="layout") as info:
        check_hello(mine, theirs)
    assert getattr(info.value, "reason", None) == "layout"


#: The tier's layout string of a one-worker engine: model, KV dtype, KV
#: groups as (tokens per block, layers), one worker's bytes per KV block,
#: blocks per chunk, TP, PP.
TIER_LAYOUT = "tiny-llama|torch.float32|[(16, 2)]|4096|1|1|1"


def tier_layout(**over: object) -> str:
    fields: dict[str, object] = dict(
        model="tiny-llama",
        dtype="torch.float32",
        groups=[(16, 2)],
        kv=4096,
        chunk=1,
        tp=1,
        pp=1,
    )
    fields.update(over)
    return "|".join(str(v) for v in fields.values())


LAYOUT_FIELDS = [
    (
        "layout_block_size",
        {"groups": [(32, 2)], "kv": 8192},
        "peer's blocks hold 32 tokens (block_size), ours 16; also kv_bytes",
        "--block-size",
    ),
    (
        "layout_tp",
        {"tp": 2, "kv": 2048},
        "peer runs tensor_parallel_size 2, we 1; also kv_bytes",
        "--tensor-parallel-size",
    ),
    ("layout_pp", {"pp": 2}, "peer runs pipeline_parallel_size 2, we 1", "pipeline"),
    (
        "layout_dtype",
        {"dtype": "torch.bfloat16", "kv": 2048},
        "peer's KV dtype is 'torch.bfloat16', ours 'torch.float32'; also kv_bytes",
        "--kv-cache-dtype",
    ),
    (
        "layout_model",
        {"model": "other-model", "tp": 2},
        "peer serves model 'other-model', we 'tiny-llama'; also tp",
        "same model",
    ),
    (
        "layout_kv_groups",
        {"groups": [(16, 1), (16, 1)]},
        "peer's KV cache groups are 1 layers of 16, 1 layers of 16 tokens a "
        "block, ours 2 layers of 16",
        "sliding",
    ),
    ("layout_chunk", {"chunk": 4}, "peer offloads 4 blocks a chunk, we 1", "chunk"),
    (
        "layout_kv_bytes",
        {"kv": 2048},
        "peer's worker holds 2048 bytes a KV block, ours 4096",
        "--kv-cache-dtype",
    ),
]


@pytest.mark.parametrize(
    ("reason", "over", "detail", "fix"),
    LAYOUT_FIELDS,
    ids=[c[0] for c in LAYOUT_FIELDS],
)
@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_a_layout_refusal_names_the_field_both_values_and_the_fix(
    reason: str, over: dict[str, object], detail: str, fix: str, secret: bytes | None
) -> None:
    """Engines whose layouts differ were refused as ``layout`` with both
    whole strings: an operator had to diff them to find the field, and the
    metric could not tell a TP mismatch from a block size one. Now the
    reason (the metric's label) is the field, the detail names the peer's
    value and ours, and the refusal carries the fix."""
    theirs = tier_layout(**over)
    w = pair(
        ident("a", layout=TIER_LAYOUT, secret=secret),
        ident("b", layout=theirs, secret=secret),
    )
    w.pump()
    assert_refused(w.a, reason)
    assert_refused(w.b, reason)
    refusal = w.a.link.refusal
    assert refusal is not None
    assert refusal.detail == (
        f"{detail} (peer's KV layout {theirs!r} differs from ours {TIER_LAYOUT!r})"
    )
    assert fix in refusal.fix


def test_a_block_size_mismatch_is_named_before_the_hashes_it_changes() -> None:
    """Another block size hashes the canonical sequence differently too.
    Without a secret the hashes were compared first, so a block size
    mismatch was refused as ``canonical_hashes`` ("block size or hash
    function differs"); with one, as a layout: now as the block size,
    either way."""
    w = pair(
        ident("a", layout=TIER_LAYOUT),
        ident(
            "b",
            layout=tier_layout(groups=[(32, 2)], kv=8192),
            canonical_hashes=(b"zz" * 8, b"yy" * 8),
        ),
    )
    w.pump()
    assert_refused(w.a, "layout_block_size")


def test_layouts_not_in_the_tiers_form_are_refused_whole() -> None:
    """A StandalonePeer's or a test's own layout has no fields to name."""
    refusal = layout_refusal("standalone", TIER_LAYOUT)
    assert refusal.reason == "layout"
    assert refusal.detail == (
        f"peer's KV layout 'standalone' differs from ours {TIER_LAYOUT!r}"
    )
    assert "same model" in refusal.fix


def test_a_seed_refusal_names_both_digests_without_a_secret() -> None:
    w = pair(ident("a"), ident("b", hash_seed="another-seed"))
    w.pump()
    refusal = w.a.link.refusal
    assert refusal is not None and refusal.reason == "hash_seed"
    theirs, ours = seed_digest("another-seed").hex()[:16], seed_digest(SEED).hex()[:16]
    assert f"seed digest {theirs} there, {ours} here" in refusal.detail
    assert "PYTHONHASHSEED" in refusal.fix


def test_a_peers_text_in_a_layout_refusal_cannot_forge_a_log_line() -> None:
    refusal = layout_refusal(tier_layout(dtype="x\nWARNING forged"), TIER_LAYOUT)
    assert refusal.reason == "layout_dtype" and "\n" not in refusal.detail


# ---------------------------------------------------------------------------
# secrets stay home
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ib",
    [
        ident("b", secret=SECRET),
        ident("b", secret=b"other"),
        ident("b", hash_seed="another-seed", secret=SECRET),
    ],
    ids=["match", "wrong-secret", "wrong-seed"],
)
def test_raw_seed_and_secret_never_cross_the_wire(ib: Identity) -> None:
    w = pair(ident("a", secret=SECRET), ib)
    w.a.send_lookup("kv1", 1, [b"k1"], 0.0)
    w.pump()
    assert w.frames
    for frame in w.frames:
        for secret in (SEED.encode(), b"another-seed", SECRET, b"other"):
            assert secret not in frame
    # What crosses is a digest keyed with the secret: not the salted digest
    # a party without the secret could match by searching seeds.
    hello = decode(w.frames[0])
    assert isinstance(hello, Hello)
    assert hello.seed_digest != seed_digest(SEED)
    assert not set(hello.canonical_hashes) & set(ident("a").canonical_hashes)
    assert make_hello(ident("a"), b"n" * 16).seed_digest == seed_digest(SEED)


@pytest.mark.parametrize("reason", ["hash_seed", "canonical_hashes"])
def test_under_a_secret_the_hashes_are_compared_once_the_peer_proved_it(
    reason: str,
) -> None:
    """Keyed with the secret, the hashes of a peer with another secret
    differ too: compared before its proof, it was refused for its seed.
    Compared after, a peer with our secret and another seed is refused for
    its seed, and gets no region."""
    over: dict[str, Any] = (
        {"hash_seed": "another-seed"}
        if reason == "hash_seed"
        else {"canonical_hashes": (b"c1" * 8, b"zz" * 8)}
    )
    w = pair(ident("a", secret=SECRET), ident("b", secret=SECRET, **over))
    w.pump()
    assert_refused(w.a, reason)
    assert_refused(w.b, reason)
    for name in "ab":
        assert Region not in sent_types(w.sent[name])


# ---------------------------------------------------------------------------
# traffic before / around the handshake
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        Lookup(req="kv1", gen=1, seq=1, keys=[b"k"]),
        Fetch(req="kv1", gen=1, job=1, keys=[b"k"], slots=[0]),
        TransferDone(req="kv1", gen=1, job=1, ok=True),
        Abort(req="kv1", gen=1),
    ],
    ids=lambda m: type(m).__name__,
)
def test_request_message_before_handshake_gets_an_error(msg: Message) -> None:
    a = Session("b:1", ident("a"), 0.0, nonce=b"A" * 16)
    a.receive(decode(encode(msg)), 0.0)
    hello, reply = a.take_outbox(0.0)
    assert isinstance(hello, Hello)
    assert isinstance(reply, Error) and reply.code == "before_handshake"
    assert a.link.counters.protocol_errors == {"before_handshake": 1}
    assert a.link.state is LinkState.HANDSHAKING
    assert a.sizes() == dict.fromkeys(a.sizes(), 0)
    assert a.link.take_events() == []
    # ... and the handshake still completes afterwards.
    b = Session("in:1", ident("b"), 0.0, nonce=b"B" * 16)
    b.receive(decode(encode(hello)), 0.0)
    Wire(a, b).pump()
    assert a.link.ready and b.link.ready


def test_hello_ack_before_hello_is_an_error() -> None:
    a = Session("b:1", ident("a"), 0.0, nonce=b"A" * 16)
    a.take_outbox(0.0)
    a.receive(decode(encode(HelloAck(mac=b""))), 0.0)
    (reply,) = a.take_outbox(0.0)
    assert isinstance(reply, Error) and reply.code == "unexpected_hello_ack"
    assert not a.link.closed


def test_refused_session_ignores_everything_after() -> None:
    w = pair(ident("a"), ident("b", layout="other"))
    w.pump()
    assert w.a.link.closed
    w.a.receive(Lookup(req="kv1", gen=1, seq=1, keys=[b"k"]), 1.0)
    w.a.receive(make_hello(ident("b"), b"C" * 16), 1.0)
    assert w.a.take_outbox(1.0) == []
    assert w.a.link.counters.refused == {"layout": 1}


def test_handshake_timeout_closes() -> None:
    a = Session("b:1", ident("a"), 0.0, nonce=b"A" * 16)
    a.tick(a.link.timeouts.handshake_s - 0.01)
    assert not a.link.closed
    a.tick(a.link.timeouts.handshake_s)
    assert a.link.closed and a.link.close_reason.startswith("handshake_timeout")


# ---------------------------------------------------------------------------
# sealing: frames after the handshake, under a shared secret
# ---------------------------------------------------------------------------

HELLO_A = make_hello(ident("a", secret=SECRET), b"A" * 16)
HELLO_B = make_hello(ident("b", secret=SECRET), b"B" * 16)
#: A frame whose bytes are easy to find on the wire.
LOOKUP = Lookup("plain-request-id", 1, 1, [b"plain-key-bytes-0123456789"])


def frame_pair(secret: bytes = SECRET) -> tuple[FrameKeys, FrameKeys]:
    """A's and B's keys for one session under ``secret``."""
    ka, kb = frame_keys(secret, HELLO_A, HELLO_B), frame_keys(secret, HELLO_B, HELLO_A)
    assert ka is not None and kb is not None
    return ka, kb


def refused(keys: FrameKeys, frame: bytes) -> bool:
    """Whether ``keys`` refuses ``frame``; a refusal must not count it."""
    before = keys.received
    try:
        keys.open(frame)
    except FrameRefused:
        assert keys.received == before
        return True
    return False


def test_a_sealed_frame_opens_once_on_the_other_side() -> None:
    ka, kb = frame_pair()
    frame = encode(LOOKUP)
    sealed = ka.seal(frame)
    assert sealed[0] == SEALED
    assert kb.open(sealed) == frame
    assert (ka.sent, kb.received) == (1, 1)
    assert refused(kb, sealed)  # replayed
    assert kb.open(ka.seal(frame)) == frame  # the next one opens


def test_a_sealed_frame_is_encrypted() -> None:
    """The whole frame is ciphertext: none of its plain bytes show, and the
    same frame sealed twice (two nonces) looks different each time."""
    ka, _ = frame_pair()
    frame = encode(LOOKUP)
    first, second = ka.seal(frame), ka.seal(frame)
    assert len(first) == 1 + len(frame) + 16  # marker, ciphertext, tag
    for sealed in (first, second):
        for plain in (b"plain-request-id", b"plain-key-bytes", frame[:8]):
            assert plain not in sealed
    assert first[1:] != second[1:]


def test_the_seal_is_aes_256_gcm_with_the_frame_count_as_nonce() -> None:
    """The construction the module docstring states, pinned: the keys are
    HKDF-SHA256 of the secret over both hellos and the sender's nonce, and
    frame n is AES-256-GCM under nonce n with the marker as
    associated data."""
    ka, kb = frame_pair()
    digests = sorted(hashlib.sha256(encode(h)).digest() for h in (HELLO_A, HELLO_B))

    def hkdf(nonce: bytes) -> bytes:
        return HKDF(
            algorithm=SHA256(),
            length=32,
            salt=b"".join(digests),
            info=b"p2p_kv/frame-key/v1 from " + nonce,
        ).derive(SECRET)

    assert (ka.out, ka.into) == (hkdf(b"A" * 16), hkdf(b"B" * 16))
    assert (kb.out, kb.into) == (ka.into, ka.out) and ka.out != ka.into
    frame = encode(LOOKUP)
    aead = AESGCM(ka.out)
    for n in range(3):
        nonce = n.to_bytes(12, "little")
        assert ka.seal(frame) == b"\xc1" + aead.encrypt(nonce, frame, b"\xc1")
    # the keys stay out of logs
    assert ka.out.hex() not in repr(ka) and repr(ka.out) not in repr(ka)


def test_a_dropped_or_reordered_frame_does_not_open() -> None:
    """The count is the nonce and is not sent: a frame opens only as the
    next one, so a gap or a swap fails (and in order both still open)."""
    ka, kb = frame_pair()
    f1, f2 = encode(LOOKUP), encode(Abort("r", 1))
    s1, s2 = ka.seal(f1), ka.seal(f2)
    assert refused(kb, s2)  # s1 dropped, or s2 ahead of it
    assert kb.open(s1) == f1
    assert refused(kb, s1)  # s1 again
    assert kb.open(s2) == f2


def test_a_frame_reflected_back_at_its_sender_does_not_open() -> None:
    ka, kb = frame_pair()
    sealed = ka.seal(encode(LOOKUP))
    assert ka.received == 0  # the count matches: only the key differs
    assert refused(ka, sealed)
    assert kb.open(sealed) == encode(LOOKUP)


@pytest.mark.parametrize("other", ["secret", "session", "forger"])
def test_a_frame_sealed_under_other_keys_does_not_open(other: str) -> None:
    """Another secret, another session under the same secret (the sender's
    nonce the same, its peer's not), or keys made up: each seals frames
    ours refuse."""
    ka, kb = frame_pair()
    frame = encode(LOOKUP)
    if other == "secret":
        theirs, _ = frame_pair(b"other-secret")
    elif other == "session":  # A's nonce again, with a peer of another one
        hello_c = make_hello(ident("c", secret=SECRET), b"C" * 16)
        keys = frame_keys(SECRET, HELLO_A, hello_c)
        assert keys is not None
        theirs = keys
    else:
        theirs = FrameKeys(out=os.urandom(32), into=os.urandom(32))
    assert refused(kb, theirs.seal(frame))
    assert kb.open(ka.seal(frame)) == frame  # ours still opens


@pytest.mark.parametrize("where", [1, 2, "middle", -17, -1])
def test_a_tampered_frame_does_not_open(where: int | str) -> None:
    """One bit flipped in the ciphertext (start, middle) or the tag (its
    first and last byte)."""
    ka, kb = frame_pair()
    frame = encode(LOOKUP)
    sealed = ka.seal(frame)
    i = len(sealed) // 2 if where == "middle" else int(where)
    tampered = bytearray(sealed)
    tampered[i] ^= 0x01
    assert refused(kb, bytes(tampered))
    assert kb.open(sealed) == frame


@pytest.mark.parametrize("marker", [0xC0, 0xC2, 0x00, 0x93])
def test_a_frame_with_another_marker_does_not_open(marker: int) -> None:
    ka, kb = frame_pair()
    sealed = ka.seal(encode(LOOKUP))
    assert refused(kb, bytes([marker]) + sealed[1:])
    assert kb.open(sealed) == encode(LOOKUP)


def test_the_marker_is_sealed_as_associated_data() -> None:
    """A frame sealed with the right key and nonce but without the marker
    as associated data (or with another) does not open: the tag covers
    every byte on the wire."""
    ka, kb = frame_pair()
    frame = encode(LOOKUP)
    aead, nonce = AESGCM(ka.out), bytes(12)
    for aad in (None, b"", b"\xc0"):
        assert refused(kb, b"\xc1" + aead.encrypt(nonce, frame, aad))
    assert kb.open(b"\xc1" + aead.encrypt(nonce, frame, b"\xc1")) == frame


@pytest.mark.parametrize("keep", [0, 1, 16, 17, -1, -16])
def test_a_truncated_frame_does_not_open(keep: int) -> None:
    ka, kb = frame_pair()
    sealed = ka.seal(encode(LOOKUP))
    assert refused(kb, sealed[:keep])
    assert kb.open(sealed) == encode(LOOKUP)


def test_sessions_seal_every_frame_after_the_handshake() -> None:
    """With a secret a ready session seals what it sends, opens what it
    gets, and refuses a plain frame where a sealed one is due; the
    handshake's own frames stay plain (a peer without keys reads them)."""
    w = pair(ident("a", secret=SECRET), ident("b", secret=SECRET))
    w.pump()
    assert w.a.link.ready and w.b.link.ready
    frame = encode(LOOKUP)
    sealed = w.a.link.seal(LOOKUP, frame)
    assert sealed[0] == SEALED and frame not in sealed
    assert w.b.link.open(sealed) == LOOKUP
    with pytest.raises(FrameRefused):
        w.b.link.open(sealed)  # again
    with pytest.raises(FrameRefused, match="plain Lookup"):
        w.b.link.open(frame)  # plain where a sealed one is due
    assert not w.b.link.admits_plain(LOOKUP)
    assert w.b.link.admits_plain(HelloAck(mac=b""))
    hello = w.a.link.peer_hello
    assert hello is not None and w.a.link.seal(hello, b"hello") == b"hello"
    assert w.a.link.seal(HelloAck(mac=b""), b"ack") == b"ack"


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_a_region_blob_is_unreadable_on_the_wire_only_with_a_secret(
    secret: bytes | None,
) -> None:
    """Both sides' Region frames, as the wire carries them: sealed (so
    encrypted) under a secret; without one plain, blob and all."""
    w = pair(ident("a", secret=secret), ident("b", secret=secret))
    w.pump()
    assert (
        w.a.link.peer_region == b"region-of-b"
        and w.b.link.peer_region == b"region-of-a"
    )
    for name in "ab":
        frames = [
            f
            for m, f in zip(w.sent[name], w.wire[name], strict=True)
            if isinstance(m, Region)
        ]
        assert len(frames) == 1
        (frame,) = frames
        blob = f"region-of-{name}".encode()
        assert (frame[0] == SEALED) is (secret is not None)
        assert (blob in frame) is (secret is None)


def test_without_a_secret_nothing_is_sealed() -> None:
    w = pair(ident("a"), ident("b"))
    w.pump()
    assert w.a.link.seal(LOOKUP, encode(LOOKUP)) == encode(LOOKUP)
    assert w.b.link.admits_plain(LOOKUP)


def test_a_relay_of_two_engines_hellos_and_proofs_learns_no_region() -> None:
    """A party without the secret hands engine V's Hello and proof to R and
    R's to V: each proof checks (it covers both hellos). The Region each
    then sends is sealed on the wire, and nothing the relay says unsealed
    is admitted."""
    v = Session("in:1", ident("v", secret=SECRET), 0.0, nonce=b"V" * 16)
    r = Session("in:2", ident("r", secret=SECRET), 0.0, nonce=b"R" * 16)
    (hello_v,) = v.take_outbox(0.0)
    (hello_r,) = r.take_outbox(0.0)
    v.receive(decode(encode(hello_r)), 0.0)
    r.receive(decode(encode(hello_v)), 0.0)
    (ack_v,) = v.take_outbox(0.0)
    (ack_r,) = r.take_outbox(0.0)
    r.receive(decode(encode(ack_v)), 0.0)
    v.receive(decode(encode(ack_r)), 0.0)
    for session, name in ((v, b"region-of-v"), (r, b"region-of-r")):
        (region,) = session.take_outbox(0.0)
        assert isinstance(region, Region)
        frame = session.link.seal(region, encode(region))
        assert frame[0] == SEALED and name not in frame
    assert not r.link.admits_plain(LOOKUP) and not r.link.admits_plain(Heartbeat(seq=1))
    with pytest.raises(FrameRefused, match="plain Heartbeat"):
        r.link.open(encode(Heartbeat(seq=1)))


def test_a_goodbye_after_our_proof_checked_is_sealed_and_taken() -> None:
    """B checked A's proof and sent its region; A took it and is ready; B
    then closes before A's region reached it. B's Goodbye must be sealed
    (A, ready, takes no plain frame): sent plain, A refused it as an
    attack and lost B's reason."""
    a = Session("b:1", ident("a", secret=SECRET), 0.0, nonce=b"A" * 16)
    b = Session("in:1", ident("b", secret=SECRET), 0.0, nonce=b"B" * 16)

    def deliver(src: Session, dst: Session) -> None:
        for msg in src.take_outbox(0.0):
            frame, sealed = dst.link.unseal(src.link.seal(msg, encode(msg)))
            got = decode(frame)
            assert sealed or dst.link.admits_plain(got), got
            dst.receive(got, 0.0)

    deliver(b, a)  # B's Hello: A queues its HelloAck
    deliver(a, b)  # A's Hello and HelloAck: B checks it, queues its Region
    deliver(b, a)  # B's HelloAck and Region: A checks, is ready
    assert a.link.ready and not b.link.ready  # A's Region has not reached B
    b.close("shutdown")
    deliver(b, a)
    assert a.link.closed and a.link.refusal is None
    assert a.link.close_reason == "peer_down: peer said goodbye: shutdown"


def test_an_identity_shows_neither_its_seed_nor_its_secret() -> None:
    """The raw hash seed keeps block hashes unguessable: the handshake
    sends only its digest, and a logged or printed Identity showed it."""
    me = Identity("e", "sha256", "s33d-value", (b"x",), "L", 1, 1, secret=b"k3y")
    assert "s33d-value" not in repr(me) and "k3y" not in repr(me)


@pytest.mark.parametrize("secret", [None, b"s" * 32], ids=["no-secret", "secret"])
def test_the_edge_tells_the_runtime_of_trust_and_regions_as_events(
    secret: bytes | None,
) -> None:
    """The runtime learns that a peer proved itself and that its region may
    be loaded from the node's events, not by reading the session. A peer
    that dialled us is told of as trusted, but its region (NIXL metadata,
    which UCX takes unchecked) reaches the runtime only if it proved the
    shared secret; the peer we dialled, whom our client named, always."""
    from .memnet import Net, identity

    net = Net(identities={n: identity(n, secret=secret) for n in ("a", "b")})
    b = net.engines["b"].manager
    b.on_new_request("r1", net.roles("a", "kv1"), net.now)
    b.lookup("r1", b"k" * 12)
    net.run()
    seen = {(name, type(ev).__name__): ev for name, _, ev in net.edge}
    assert ("a", "Trusted") in seen and ("b", "Trusted") in seen
    assert seen[("b", "RegionKnown")] == RegionKnown(b"a")  # a's region
    if secret is None:
        assert ("a", "RegionKnown") not in seen
    else:
        assert seen[("a", "RegionKnown")] == RegionKnown(b"b")
    # Each once, in the order the handshake went: trust before the region.
    for name in ("a", "b"):
        kinds = [type(ev).__name__ for n, _, ev in net.edge if n == name]
        assert kinds == ["Trusted", "RegionKnown"][: len(kinds)]
