"""The wire codec: every message round-trips, and every defect in a frame
from a peer surfaces as :class:`ProtocolError` and nothing else."""

from __future__ import annotations

import random
import typing
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_kv.protocol import (
    MAX_FRAME_BYTES,
    MAX_KEY_BYTES,
    MAX_KEYS,
    Abort,
    AbortAck,
    Error,
    Fetch,
    FetchOffer,
    FetchWait,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    Holdings,
    Lookup,
    LookupResp,
    Message,
    ProtocolError,
    Region,
    Release,
    Revoke,
    Subscribe,
    TransferDone,
    decode,
    encode,
)

K1, K2, K3 = b"k" * 12, b"\x00\xff" * 6, b"x"

SAMPLES: list[Any] = [
    Hello(
        version=1,
        engine_id="engine-a",
        hash_algo="sha256_cbor",
        seed_digest=b"\x01" * 32,
        canonical_hashes=[b"c1", b"c2" * 16],
        layout="NHD:bf16:32x8x128",
        block_bytes=65536,
        num_blocks=4096,
        authenticated=True,
        nonce=b"\x07" * 16,
    ),
    HelloAck(mac=b"\x02" * 32),
    Region(region=b"nixl-metadata"),
    HelloAck(mac=b""),
    Lookup(req="req-1", gen=3, seq=1, keys=[K1, K2, K3]),
    Lookup(req="r", gen=0, seq=0, keys=[]),
    LookupResp(req="req-1", gen=3, seq=1, hits=[True, False, True]),
    LookupResp(
        req="req-1", gen=3, seq=1, hits=[True, False], slots=[9, 0], ttl_ms=15000
    ),
    Release(req="req-1", gen=3, blocks=2),
    Revoke(req="req-1", gen=3),
    Fetch(req="req-1", gen=3, job=42, keys=[K1, K2], slots=[7, 0]),
    Fetch(req="req-1", gen=2**63 - 1, job=0, keys=[], slots=[]),
    Fetch(req="req-1", gen=3, job=42, keys=[K1], slots=[7], parked=False),
    Fetch(req="req-1", gen=3, job=42, keys=[K1], slots=[7], read=True),
    FetchOffer(req="req-1", gen=3, job=42, slots=[10, 13], ttl_ms=15000),
    FetchWait(req="req-1", gen=3, job=42, ttl_ms=500),
    TransferDone(req="req-1", gen=3, job=42, ok=True),
    TransferDone(req="req-1", gen=3, job=42, ok=False, reason="write failed"),
    Abort(req="req-1", gen=3),
    AbortAck(req="req-1", gen=3),
    Heartbeat(seq=9),
    Goodbye(),
    Goodbye(reason="shutdown"),
    Error(code="illegal", detail="no", req="req-1", gen=3),
    Error(code="x"),
    Subscribe(),
    Holdings(add=b"\x01" * 16, drop=b"\x02" * 8),
    Holdings(),
]


def raw(*fields: Any) -> bytes:
    """A msgpack array frame built by hand (bypasses every constructor)."""
    return msgspec.msgpack.encode(list(fields))


def refused(frame: bytes | bytearray, match: str | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        decode(frame)
    assert type(info.value) is ProtocolError
    return info.value


# ---------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(typing.get_args(Message))


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Any) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert type(back) is type(msg)
    assert back == msg
    assert decode(bytearray(frame)) == msg
    assert decode(memoryview(frame)) == msg
    assert encode(back) == frame


def test_a_fetch_that_does_not_say_parked_may_wait_for_parked_stores() -> None:
    # A peer of the version before ``parked`` sends five fields: it gets
    # the behaviour it had (the producer waits for parked stores).
    frame = msgspec.msgpack.encode(["fetch", "r", 1, 2, [K1], [3]])
    assert decode(frame) == Fetch(req="r", gen=1, job=2, keys=[K1], slots=[3])
    assert Fetch(req="r", gen=1, job=2, keys=[K1], slots=[3]).parked


def test_largest_legal_lookup_fits_a_frame() -> None:
    keys = [i.to_bytes(4, "big") + b"k" * 32 for i in range(MAX_KEYS)]
    msg = Lookup(req="r" * 256, gen=1, seq=1, keys=keys)
    assert decode(encode(msg)) == msg


def test_text_utf8_cannot_carry_is_a_protocol_error_not_a_crash() -> None:
    """JSON admits lone surrogates; msgspec raised UnicodeEncodeError, which
    the runtime's send did not catch: it left the engine's step."""
    with pytest.raises(ProtocolError, match="Abort holds text UTF-8 cannot"):
        encode(Abort(req="x\ud800", gen=1))


# ---------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------


def test_empty_frame() -> None:
    refused(b"", "empty")
    refused(bytearray(), "empty")


def test_oversize_frame() -> None:
    refused(b"\x00" * (MAX_FRAME_BYTES + 1), "exceeds")
    # A well-formed message just over the limit is refused by size first.
    msg = Lookup(req="r", gen=1, seq=1, keys=[b"k" * MAX_KEY_BYTES] * 70_000)
    big = msgspec.msgpack.encode(msg)
    assert len(big) > MAX_FRAME_BYTES
    refused(big, "exceeds")


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",  # never-used msgpack opcode
        b"\x92",  # array header, no elements
        b"\xa5abc",  # truncated string
        b"\x00",  # a bare integer
        b"\xc0",  # nil
        b"hello world",
        b"\xff" * 64,
        b"\xdd\xff\xff\xff\xff",  # array claiming 4G elements
        b"\xd6\xff\x00\x00\x00\x00",  # timestamp extension
        encode(Heartbeat(seq=1)) + b"\x00",  # trailing bytes
        encode(Heartbeat(seq=1))[:-1],  # truncated
    ],
)
def test_garbage(frame: bytes) -> None:
    refused(frame)


@pytest.mark.parametrize(
    "frame",
    [
        raw("lookup", "r", "3", 1, [K1]),  # gen as str
        raw("lookup", "r", 3, 1, K1),  # keys not a list
        raw("lookup", "r", 3, 1, ["text-key"]),  # key as str
        raw("lookup", 7, 3, 1, [K1]),  # req as int
        raw("lookup", "", 3, 1, [K1]),  # empty req
        raw("lookup", "r" * 257, 3, 1, [K1]),  # req too long
        raw("lookup", "r", 3.5, 1, [K1]),  # float gen
        raw("lookup", "r", 3, 1),  # missing field
        raw("lookup_resp", "r", 3, 1, [1, 0]),  # ints for bools
        raw("fetch", "r", 3, 1, [K1], ["0"]),  # slot as str
        raw("fetch", "r", 3, 1, [K1], [2**40]),  # slot beyond 40 bits
        raw("transfer_done", "r", 3, 1, "yes", ""),
        raw("heartbeat", None),
        raw("hello", 1, "e", "h", b"", [], "l", 0, 1, False, b"", b""),  # block 0
        raw("hello", 1, "e", "h", b"", [], "l", 16, -1, False, b"", b""),
        raw("error", "c", "d" * 1025, "", -1),  # text too long
        raw("hello_ack", b"\x00" * (1024 * 1024 + 1)),  # blob too long
        msgspec.msgpack.encode({"t": "heartbeat", "seq": 1}),  # map, not array
    ],
)
def test_wrong_field_types(frame: bytes) -> None:
    refused(frame, "invalid message")


@pytest.mark.parametrize("tag", ["nope", "", "HELLO", "Hello", 3, None])
def test_unknown_tag(tag: Any) -> None:
    refused(raw(tag, 1), "invalid message")
    refused(raw(tag), "invalid message")


def test_too_many_keys() -> None:
    keys = [b"k"] * (MAX_KEYS + 1)
    refused(encode(Lookup(req="r", gen=1, seq=1, keys=keys)), "invalid message")
    refused(raw("fetch", "r", 1, 1, keys, list(range(MAX_KEYS + 1))), "invalid message")
    refused(raw("lookup_resp", "r", 1, 1, [True] * (MAX_KEYS + 1)), "invalid message")


def test_key_too_long_or_empty() -> None:
    long_key = b"k" * (MAX_KEY_BYTES + 1)
    refused(encode(Lookup(req="r", gen=1, seq=1, keys=[K1, long_key])), "invalid")
    refused(encode(Fetch(req="r", gen=1, job=1, keys=[long_key], slots=[0])))
    refused(encode(Lookup(req="r", gen=1, seq=1, keys=[b""])), "invalid")
    # exactly at the limit is fine
    ok = Lookup(req="r", gen=1, seq=1, keys=[b"k" * MAX_KEY_BYTES])
    assert decode(encode(ok)) == ok


@pytest.mark.parametrize(
    "msg",
    [
        Lookup(req="r", gen=-1, seq=1, keys=[K1]),
        Lookup(req="r", gen=1, seq=-1, keys=[K1]),
        LookupResp(req="r", gen=-5, seq=1, hits=[]),
        Fetch(req="r", gen=-1, job=1, keys=[K1], slots=[0]),
        Fetch(req="r", gen=1, job=-1, keys=[K1], slots=[0]),
        Fetch(req="r", gen=1, job=1, keys=[K1], slots=[-1]),
        Fetch(req="r", gen=1, job=1, keys=[K1, K2], slots=[3, -2]),
        TransferDone(req="r", gen=-1, job=1, ok=True),
        Abort(req="r", gen=-1),
        AbortAck(req="r", gen=-(2**63)),
        Heartbeat(seq=-1),
    ],
    ids=lambda m: type(m).__name__,
)
def test_negative_gen_or_slot(msg: Any) -> None:
    refused(encode(msg), "invalid message")


def test_gen_beyond_int64() -> None:
    refused(raw("abort", "r", 2**63), "invalid message")
    refused(raw("abort", "r", 2**64 - 1), "invalid message")


def test_lookup_resp_slots_must_match_hits() -> None:
    bad = LookupResp(req="r", gen=1, seq=1, hits=[True, True], slots=[4])
    refused(encode(bad), "2 hits but 1 slots")
    huge_ttl = LookupResp(req="r", gen=1, seq=1, hits=[True], slots=[4], ttl_ms=-1)
    refused(encode(huge_ttl))


def test_a_fetch_offer_without_a_hold_is_refused() -> None:
    # An offer whose blocks are held for no time cannot be read safely.
    refused(encode(FetchOffer(req="r", gen=1, job=1, slots=[4], ttl_ms=0)))
    assert not Fetch(req="r", gen=1, job=2, keys=[K1], slots=[3]).read


def test_fetch_keys_slots_mismatch() -> None:
    refused(encode(Fetch(req="r", gen=1, job=1, keys=[K1, K2], slots=[1])), "2 keys")
    refused(encode(Fetch(req="r", gen=1, job=1, keys=[K1], slots=[1, 2])), "1 keys")
    refused(encode(Fetch(req="r", gen=1, job=1, keys=[], slots=[1])), "0 keys")


def test_fetch_duplicate_slots() -> None:
    msg = Fetch(req="r", gen=1, job=1, keys=[K1, K2, K3], slots=[4, 9, 4])
    refused(encode(msg), "duplicate")
    # nor duplicate keys: a load asks for each block once, and one pinned
    # key repeated 65,536 times made a Fetch whose keys (7 MiB a request)
    # and hold the producer kept
    refused(encode(Fetch(req="r", gen=1, job=1, keys=[K1, K1], slots=[4, 9])), "keys")


def test_lookup_duplicate_keys() -> None:
    # A probe asks about each block once: one held key repeated pinned a
    # block per copy.
    with pytest.raises(ProtocolError, match="duplicate keys") as info:
        decode(encode(Lookup(req="r", gen=1, seq=1, keys=[K1, K2, K1])))
    assert info.value.reason == "duplicate_keys"
    assert decode(encode(Lookup(req="r", gen=1, seq=1, keys=[K1, K2]))).keys == [K1, K2]


def test_encode_refuses_oversize_message() -> None:
    msg = Lookup(req="r", gen=1, seq=1, keys=[b"k" * MAX_KEY_BYTES] * MAX_KEYS)
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(msg)
    blob = Hello(
        version=1,
        engine_id="e",
        hash_algo="h",
        seed_digest=b"",
        canonical_hashes=[b"x" * (1 << 20)] * 5,
        layout="l",
        block_bytes=1,
        num_blocks=1,
        authenticated=False,
        nonce=b"",
    )
    with pytest.raises(ProtocolError, match="Hello frame"):
        encode(blob)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("canonical_hashes", [b"h"] * 17),  # a million made 42.8 MiB held
        ("canonical_hashes", [b"h" * 65]),
        ("nonce", b"n" * 65),
        ("seed_digest", b"d" * 65),
    ],
)
def test_a_hellos_fields_are_bounded_by_what_they_carry(
    field: str, value: object
) -> None:
    """Anyone may send a Hello, and a session keeps it (also a closed one,
    for metrics): each field holds at most what ours sends, not a frame's
    worth of small items."""
    good = Hello(
        version=1,
        engine_id="e",
        hash_algo="h",
        seed_digest=b"d" * 32,
        canonical_hashes=[b"h" * 32] * 16,
        layout="l",
        block_bytes=1,
        num_blocks=1,
        authenticated=False,
        nonce=b"n" * 64,
    )
    assert decode(encode(good)) == good
    bad = msgspec.structs.replace(good, **{field: value})
    refused(msgspec.msgpack.encode(bad), r"length <= (16|64)")


# ---------------------------------------------------------------------------
# fuzz: decode only ever returns a Message or raises ProtocolError
#
# Example counts (total 20,000): arbitrary bytes 8,000; mutated valid frames
# 8,000; msgpack arrays with a real tag and random fields 4,000. Mutations
# and fields are generated from one drawn seed each (hypothesis' per-draw
# cost would dominate otherwise).
# ---------------------------------------------------------------------------

MESSAGE_TYPES = typing.get_args(Message)
TAGS = [t.__struct_config__.tag for t in MESSAGE_TYPES]
FRAMES = [encode(m) for m in SAMPLES]

FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def decodes_or_refuses(frame: bytes) -> None:
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    assert isinstance(msg, MESSAGE_TYPES)
    # Anything accepted must survive our own encoder and come back equal.
    assert decode(encode(msg)) == msg


@settings(FUZZ, max_examples=8_000)
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_bytes(frame: bytes) -> None:
    decodes_or_refuses(frame)


def mutate(frame: bytes, seed: int) -> bytes:
    """Apply 1-4 random flips / byte sets / inserts / deletes / truncations.

    Driven by one drawn seed rather than one draw per edit: hypothesis'
    per-draw overhead would otherwise dominate the run time.
    """
    rng = random.Random(seed)
    out = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(("flip", "set", "insert", "delete", "truncate"))
        pos = rng.randrange(len(out) + 1)
        if op == "flip" and pos < len(out):
            out[pos] ^= 1 << rng.randrange(8)
        elif op == "set" and pos < len(out):
            out[pos] = rng.randrange(256)
        elif op == "insert":
            out[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == "delete":
            del out[pos : pos + rng.randint(1, 8)]
        elif op == "truncate":
            del out[pos:]
    return bytes(out)


@settings(FUZZ, max_examples=8_000)
@given(st.sampled_from(FRAMES), st.integers(0, 2**32 - 1))
def test_fuzz_mutated_valid_frames(frame: bytes, seed: int) -> None:
    decodes_or_refuses(mutate(frame, seed))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A msgpack-encodable value of a random kind, biased toward the kinds
    message fields actually have (short strings, small ints, bytes, lists)."""
    kind = rng.randrange(10 if depth < 2 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice((0, 1, -1, 2**40, 2**63 - 1, 2**63, -(2**63), 2**64 - 1))
    if kind == 3:
        return rng.randint(-5, 100)
    if kind == 4:
        return rng.choice((0.0, -1.5, float("nan"), float("inf")))
    if kind == 5:
        return "".join(
            rng.choice("ab\u00e9\U0001f600") for _ in range(rng.randrange(6))
        )
    if kind in (6, 7):
        return rng.randbytes(rng.choice((0, 1, 8, 12, 32, 64, 65)))
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]


@settings(FUZZ, max_examples=4_000)
@given(st.sampled_from(TAGS), st.integers(0, 2**32 - 1))
def test_fuzz_tagged_arrays(tag: Any, seed: int) -> None:
    rng = random.Random(seed)
    fields = [random_value(rng) for _ in range(rng.randrange(13))]
    decodes_or_refuses(raw(tag, *fields))


# ---------------------------------------------------------------------------
# before the handshake
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_before_the_handshake_only_a_greeting_is_taken(msg: Any) -> None:
    """A session that is not ready takes the handshake's messages alone.
    Anything else is refused by its tag, its body never built: a 65,536-key
    Fetch from anyone who reaches the port cost a full decode (16 ms) under
    the lock the engine's step waits on, only for the session to refuse it."""
    frame = encode(msg)
    if isinstance(msg, Hello | HelloAck | Region | Heartbeat | Goodbye | Error):
        assert decode(frame, greeting=True) == msg
        return
    with pytest.raises(ProtocolError, match="before the handshake") as info:
        decode(frame, greeting=True)
    assert info.value.reason == "before_handshake"
    assert decode(frame) == msg  # once the session is ready


def test_a_malformed_greeting_is_a_plain_decode_error() -> None:
    for frame in (raw("hello", "not a version"), raw(7), b"\xc1junk"):
        with pytest.raises(ProtocolError) as info:
            decode(frame, greeting=True)
        assert info.value.reason == "decode", frame


@pytest.mark.parametrize("greeting", [True, False])
@pytest.mark.parametrize("tag", ["heartbeat", "hello", "lookup", "fetch"])
def test_deep_nesting_is_a_decode_error(tag: str, greeting: bool) -> None:
    """msgspec raises RecursionError, not one of its own errors, at about
    1,000 levels, even inside a field it would skip: it escaped decode."""
    deep = b"\x91" * 5000 + b"\x01"
    for frame in (b"\x93" + msgspec.msgpack.encode(tag) + b"\x01" + deep, deep):
        with pytest.raises(ProtocolError, match=r"nested too deep|invalid") as info:
            decode(frame, greeting=greeting)
        assert info.value.reason == "decode"
