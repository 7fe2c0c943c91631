"""Two Sessions wired by hand through the real codec: what they agree on,
what they refuse and why, and what never crosses the wire."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from p2p_kv.handshake import Identity, check_hello, make_hello, seed_digest
from p2p_kv.manager import LoadManager
from p2p_kv.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Error,
    Fetch,
    Goodbye,
    Hello,
    HelloAck,
    Lookup,
    Message,
    Region,
    TransferDone,
    decode,
    encode,
)
from p2p_kv.session import Link, Session

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
    """Two sessions and the frames between them (every frame is kept)."""

    def __init__(self, a: Session, b: Session) -> None:
        self.a, self.b = a, b
        self.frames: list[bytes] = []
        self.sent: dict[str, list[Message]] = {"a": [], "b": []}

    def pump(self, now: float = 0.0, rounds: int = 10) -> None:
        for _ in range(rounds):
            moved = False
            for name, src, dst in (("a", self.a, self.b), ("b", self.b, self.a)):
                for msg in src.take_outbox(now):
                    moved = True
                    frame = encode(msg)
                    self.frames.append(frame)
                    self.sent[name].append(msg)
                    dst.receive(decode(frame), now)
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
    assert w.a.link is Link.HANDSHAKING and not w.a.ready
    w.pump()
    assert w.a.ready and w.b.ready
    assert w.a.refusal is None and w.b.refusal is None
    ha, hb = w.b.peer_hello, w.a.peer_hello  # a's hello as b saw it, and back
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
    # its region once the other's proof checked: encrypted with a secret
    for name in "ab":
        assert sent_types(w.sent[name]) == [Hello, HelloAck, Region]
        ack, region = w.sent[name][1:]
        assert isinstance(ack, HelloAck) and isinstance(region, Region)
        assert (len(ack.mac) == 32) is (secret is not None)
        plain = f"region-of-{name}".encode()
        assert (region.region == plain) is (secret is None)
    assert w.a.peer_region == b"region-of-b" and w.b.peer_region == b"region-of-a"
    assert not w.a.counters.protocol_errors and not w.b.counters.protocol_errors


def test_ready_sessions_carry_requests() -> None:
    w = pair(ident("a"), ident("b"))
    w.a.send_lookup("kv1", 1, [b"k1", b"k2"], 0.0)  # queued until ready
    w.pump()
    assert w.b.has_lookups_to_serve


def test_different_num_blocks_is_fine() -> None:
    w = pair(ident("a", num_blocks=64), ident("b", num_blocks=4096))
    w.pump()
    assert w.a.ready and w.b.ready
    assert w.a.peer_hello is not None and w.a.peer_hello.num_blocks == 4096


# ---------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------

MISMATCHES = [
    ("hash_seed", {"hash_seed": "another-seed"}),
    ("hash_algo", {"hash_algo": "xxhash"}),
    ("canonical_hashes", {"canonical_hashes": (b"c1" * 8, b"zz" * 8)}),
    ("canonical_hashes", {"canonical_hashes": (b"c1" * 8,)}),
    ("layout", {"layout": "HND:bf16:2x4x16"}),
    ("layout", {"block_bytes": 512}),
    ("auth", {"secret": SECRET}),
]


def assert_refused(s: Session, reason: str) -> None:
    assert s.refusal is not None, "not refused"
    assert s.refusal.reason == reason
    assert s.link is Link.CLOSED and s.closed and not s.ready
    assert s.counters.refused == {reason: 1}
    assert s.close_reason.startswith("refused")


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
    assert w.b.closed and not w.b.ready
    assert w.b.refusal is not None and w.b.refusal.reason == "auth"
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
    first, second = m.on_inbound(0.0), m.on_inbound(0.0)
    hellos = dict(m.take_outgoing(0.0))
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
    assert a.counters.protocol_errors == {"before_handshake": 1}
    assert a.link is Link.HANDSHAKING
    assert a.sizes() == dict.fromkeys(a.sizes(), 0)
    assert a.take_writes() == []
    # ... and the handshake still completes afterwards.
    b = Session("in:1", ident("b"), 0.0, nonce=b"B" * 16)
    b.receive(decode(encode(hello)), 0.0)
    Wire(a, b).pump()
    assert a.ready and b.ready


def test_hello_ack_before_hello_is_an_error() -> None:
    a = Session("b:1", ident("a"), 0.0, nonce=b"A" * 16)
    a.take_outbox(0.0)
    a.receive(decode(encode(HelloAck(mac=b""))), 0.0)
    (reply,) = a.take_outbox(0.0)
    assert isinstance(reply, Error) and reply.code == "unexpected_hello_ack"
    assert not a.closed


def test_refused_session_ignores_everything_after() -> None:
    w = pair(ident("a"), ident("b", layout="other"))
    w.pump()
    assert w.a.closed
    w.a.receive(Lookup(req="kv1", gen=1, seq=1, keys=[b"k"]), 1.0)
    w.a.receive(make_hello(ident("b"), b"C" * 16), 1.0)
    assert w.a.take_outbox(1.0) == []
    assert w.a.counters.refused == {"layout": 1}


def test_handshake_timeout_closes() -> None:
    a = Session("b:1", ident("a"), 0.0, nonce=b"A" * 16)
    a.tick(a.timeouts.handshake_s - 0.01)
    assert not a.closed
    a.tick(a.timeouts.handshake_s)
    assert a.closed and a.close_reason.startswith("handshake_timeout")


# ---------------------------------------------------------------------------
# sealing: frames after the handshake, under a shared secret
# ---------------------------------------------------------------------------


def test_frames_after_the_handshake_are_sealed_and_checked() -> None:
    """With a secret both sides seal every frame after their HelloAck, under
    keys only the secret and both hellos give: a frame forged, replayed,
    reflected back at its sender or plain is refused."""
    from p2p_kv.handshake import FrameKeys, FrameRefused

    w = pair(ident("a", secret=SECRET), ident("b", secret=SECRET))
    w.pump()
    assert w.a.ready and w.b.ready
    msg = Lookup("r1", 1, 1, [b"k1"])
    frame = encode(msg)
    sealed = w.a.seal(msg, frame)
    assert sealed != frame and sealed[0] == 0xC1
    assert w.b.unseal(sealed) == (frame, True)
    with pytest.raises(FrameRefused):
        w.b.unseal(sealed)  # the same frame again
    with pytest.raises(FrameRefused):
        w.a.unseal(sealed)  # back at its sender
    forged = FrameKeys(out=b"x" * 32, into=b"y" * 32).seal(frame)
    with pytest.raises(FrameRefused):
        w.b.unseal(forged)
    tampered = bytearray(w.a.seal(msg, frame))
    tampered[-1] ^= 1
    with pytest.raises(FrameRefused):
        w.b.unseal(bytes(tampered))
    assert not w.b.admits_plain(msg)  # a plain frame where a sealed one is due
    assert w.b.admits_plain(HelloAck(mac=b""))
    # the handshake's own frames stay plain: a peer without keys reads them
    hello = w.a.peer_hello
    assert hello is not None and w.a.seal(hello, b"hello") == b"hello"


def test_without_a_secret_nothing_is_sealed() -> None:
    w = pair(ident("a"), ident("b"))
    w.pump()
    msg = Lookup("r1", 1, 1, [b"k1"])
    assert w.a.seal(msg, encode(msg)) == encode(msg)
    assert w.b.admits_plain(msg)


def test_a_relay_of_two_engines_hellos_and_proofs_learns_no_region() -> None:
    """A party without the secret hands engine V's Hello and proof to R and
    R's to V: each proof checks (it covers both hellos). What it then gets
    from either is encrypted, and nothing it says unsealed is admitted."""
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
        assert isinstance(region, Region) and region.region != name
    assert not r.admits_plain(Lookup("x", 1, 1, [b"k1"]))


def test_a_goodbye_after_our_proof_checked_is_sealed_and_taken() -> None:
    """B checked A's proof and sent its region; A took it and is ready; B
    then closes before A's region reached it. B's Goodbye must be sealed
    (A, ready, takes no plain frame): sent plain, A refused it as an
    attack and lost B's reason."""
    a = Session("b:1", ident("a", secret=SECRET), 0.0, nonce=b"A" * 16)
    b = Session("in:1", ident("b", secret=SECRET), 0.0, nonce=b"B" * 16)

    def deliver(src: Session, dst: Session) -> None:
        for msg in src.take_outbox(0.0):
            frame, sealed = dst.unseal(src.seal(msg, encode(msg)))
            got = decode(frame)
            assert sealed or dst.admits_plain(got), got
            dst.receive(got, 0.0)

    deliver(b, a)  # B's Hello: A queues its HelloAck
    deliver(a, b)  # A's Hello and HelloAck: B checks it, queues its Region
    deliver(b, a)  # B's HelloAck and Region: A checks, is ready
    assert a.ready and not b.ready  # A's Region has not reached B
    b.close("shutdown")
    deliver(b, a)
    assert a.closed and a.refusal is None
    assert a.close_reason == "peer_down: peer said goodbye: shutdown"


def test_an_identity_shows_neither_its_seed_nor_its_secret() -> None:
    """The raw hash seed keeps block hashes unguessable: the handshake
    sends only its digest, and a logged or printed Identity showed it."""
    me = Identity("e", "sha256", "s33d-value", (b"x",), "L", 1, 1, secret=b"k3y")
    assert "s33d-value" not in repr(me) and "k3y" not in repr(me)
