"""The KV event format (tandem.runtime.kv_events): what tandem publishes decodes with the engines'
own structs, and tandem's one decoder reads every shape vLLM and SGLang have published: payloads
made here by msgspec structs laid out as each engine's source lays them out (each says which),
and every malformed input is one KvEventsError."""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.runtime import kv_events
from tandem.runtime.kv_events import (
    END_SEQ, REPLAY_END, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEventsError,
    decode_batch, decode_live, decode_replay, encode_batch, live_frames, parse_replay_start,
    replay_request, seq_frame,
)
from tandem.runtime.wire import ProtocolError

TOKENS = list(range(100, 132))  # two blocks of 16


def tandem_batch() -> EventBatch:
    return EventBatch(1700000000.5, [
        BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=TOKENS,
                    block_size=16),
        BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=TOKENS[:16], block_size=16),
        BlockRemoved(block_hashes=[11]),
        AllBlocksCleared(),
    ])


def test_tandem_batches_round_trip_and_have_the_published_shape() -> None:
    batch = tandem_batch()
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    ts, events, rank = msgspec.msgpack.decode(payload)  # an array of three
    assert (ts, rank) == (1700000000.5, 0)
    assert events[0] == {"type": "BlockStored", "block_hashes": [11, 12],
                         "parent_block_hash": None, "token_ids": TOKENS, "block_size": 16,
                         "lora_id": None, "medium": None, "lora_name": None,
                         "cache_salt": None}
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [11], "medium": None}
    assert events[3] == {"type": "AllBlocksCleared"}


# --- vLLM, current (events are tagged maps; one version's batch is a map too) --------------------

class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's KVCacheEvent after the switch to map-encoded events."""


class VllmStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class VllmCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmMapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """vLLM's EventBatch in the version that encodes it as a map."""

    ts: float
    events: list[VllmStored | VllmRemoved | VllmCleared]
    data_parallel_rank: int | None = None


class VllmArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's EventBatch as an array (the versions around it)."""

    ts: float
    events: list[VllmStored | VllmRemoved | VllmCleared]
    data_parallel_rank: int | None = None


def test_vllm_current_payloads_decode() -> None:
    big = (1 << 64) - 1  # vLLM's int hashes are unsigned 64-bit
    events = [VllmStored([big, 5], None, TOKENS, 16, None, "GPU", None, extra_keys=[None, None],
                         group_idx=0, kv_cache_spec_kind="full_attention"),
              VllmRemoved([big], "GPU", group_idx=0), VllmCleared()]
    want = [BlockStored([big, 5], None, TOKENS, 16, None, "GPU"),
            BlockRemoved([big], "GPU"), AllBlocksCleared()]
    for batch in (VllmMapBatch(2.0, events, 3), VllmArrayBatch(2.0, events, 3)):
        assert decode_batch(msgspec.msgpack.encode(batch)) == EventBatch(2.0, want, 3)
    assert decode_batch(msgspec.msgpack.encode(VllmMapBatch(2.0, []))).dp_rank is None


def test_tandem_payloads_decode_with_vllm_current_structs() -> None:
    """Every field vLLM's structs require is written (lora_id, medium, lora_name)."""
    got = msgspec.msgpack.decode(encode_batch(tandem_batch()), type=VllmArrayBatch)
    assert isinstance(got.events[0], VllmStored) and got.events[0].token_ids == TOKENS
    assert isinstance(got.events[2], VllmRemoved) and got.events[3] == VllmCleared()


def test_vllm_bytes_hashes_become_its_own_ints() -> None:
    """vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends sha256 digests; decoded as vLLM
    turns them into ints (big-endian, low 64 bits), so stored and removed still match."""
    digest = hashlib.sha256(b"block").digest()
    raw = [1.0, [{"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": digest,
                  "token_ids": [1], "block_size": 1, "lora_id": None, "medium": "GPU",
                  "lora_name": None},
                 {"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"}], 0]
    want = int.from_bytes(digest, "big") & ((1 << 64) - 1)
    stored, removed = decode_batch(msgspec.msgpack.encode(raw)).events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [want] and stored.parent_block_hash == want
    assert removed.block_hashes == [want]


# --- vLLM, before the switch (positional arrays) ---------------------------------------------------

class VllmOldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's KVCacheEvent before map encoding (the array_like versions)."""


class VllmOldStored(VllmOldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class VllmOldRemoved(VllmOldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VllmOldCleared(VllmOldEvent, tag="AllBlocksCleared"):
    pass


class VllmFirstBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's first EventBatch: [ts, events], no rank."""

    ts: float
    events: list[object]


class VllmFirstStored(VllmOldEvent, tag="BlockStored"):
    """vLLM's first BlockStored: no medium, no lora_name."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


def test_vllm_array_payloads_decode() -> None:
    events = [VllmOldStored([7, 8], 6, TOKENS, 16, 3, "CPU_PINNED", "adapter"),
              VllmOldRemoved([7], None), VllmOldCleared()]
    got = decode_batch(msgspec.msgpack.encode(VllmArrayBatch(3.0, events, 1)))
    assert got == EventBatch(3.0, [BlockStored([7, 8], 6, TOKENS, 16, 3, "CPU_PINNED"),
                                   BlockRemoved([7]), AllBlocksCleared()], 1)
    first = VllmFirstBatch(4.0, [VllmFirstStored([9], None, TOKENS[:16], 16, None)])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(first))[1][0][0] == "BlockStored"
    assert decode_batch(msgspec.msgpack.encode(first)) == EventBatch(
        4.0, [BlockStored([9], None, TOKENS[:16], 16)], None)


# --- SGLang ---------------------------------------------------------------------------------------

class SglEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """SGLang 0.5.23's KVCacheEvent: tagged maps, defaults omitted."""


class SglStored(SglEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglRemoved(SglEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglCleared(SglEvent, tag="AllBlocksCleared"):
    pass


class SglBatch(msgspec.Struct, array_like=True, gc=False):
    """SGLang's EventBatch in 0.5.23: [ts, events, attn_dp_rank], always three."""

    ts: float
    events: list[SglStored | SglRemoved | SglCleared]
    attn_dp_rank: int | None = None


class SglOldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """SGLang's KVCacheEvent before 0.5.23: tagged arrays (msgspec writes every field of an
    array, defaults too)."""


class SglOldStored(SglOldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SglOldRemoved(SglOldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglOldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """SGLang's EventBatch before 0.5.23."""

    ts: float
    events: list[object]
    attn_dp_rank: int | None = None


def test_sglang_payloads_decode() -> None:
    signed = -(1 << 63)  # SGLang's hashes: the first 16 hex chars of a SHA-256 as a signed int64
    page = TOKENS[:16]  # one page per BlockStored, block_size = the page's tokens
    new = SglBatch(5.0, [SglStored([signed], None, page, 16, None, "GPU", cache_salt="s",
                                   session_id="x"), SglStored([2], signed, page, 16, None),
                         SglRemoved([signed, 2], "GPU"), SglCleared()], 0)
    assert decode_batch(msgspec.msgpack.encode(new)) == EventBatch(5.0, [
        BlockStored([signed], None, page, 16, None, "GPU", None, "s"),  # (its salt, carried)
        BlockStored([2], signed, page, 16),
        BlockRemoved([signed, 2], "GPU"), AllBlocksCleared()], 0)
    old = SglOldBatch(6.0, [SglOldStored([3], None, page, 16, None), SglOldRemoved([3])], 2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old))[1][0] == [
        "BlockStored", [3], None, page, 16, None, None]
    assert decode_batch(msgspec.msgpack.encode(old)) == EventBatch(
        6.0, [BlockStored([3], None, page, 16), BlockRemoved([3])], 2)


def test_tandem_payloads_decode_with_sglang_structs() -> None:
    got = msgspec.msgpack.decode(encode_batch(tandem_batch()), type=SglBatch)
    assert isinstance(got.events[1], SglStored) and got.events[1].parent_block_hash == 12


def test_events_of_both_forms_may_share_a_batch() -> None:
    raw = [1.0, [["BlockRemoved", [1]], {"type": "BlockRemoved", "block_hashes": [2]}]]
    assert decode_batch(msgspec.msgpack.encode(raw)).events == [BlockRemoved([1]),
                                                                BlockRemoved([2])]


# --- malformed input: one exception --------------------------------------------------------------

def stored(**over: object) -> dict[str, object]:
    ev: dict[str, object] = {"type": "BlockStored", "block_hashes": [1],
                             "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2}
    ev.update(over)
    return ev


BAD = {
    "empty": b"",
    "not msgpack": b"\xc1",
    "truncated": encode_batch(tandem_batch())[:-3],
    "a number": msgspec.msgpack.encode(7),
    "a string": msgspec.msgpack.encode("batch"),
    "no events": msgspec.msgpack.encode([1.0]),
    "events not a list": msgspec.msgpack.encode([1.0, {"a": 1}]),
    "an event that is a number": msgspec.msgpack.encode([1.0, [5]]),
    "an event that is empty bytes": msgspec.msgpack.encode([1.0, [b""]]),
    "unknown type": msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}]]),
    "unknown positional type": msgspec.msgpack.encode([1.0, [["Nope", [1]]]]),
    "no type": msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),
    "negative token id": msgspec.msgpack.encode([1.0, [stored(token_ids=[-1, 2])]]),
    "token id over u32": msgspec.msgpack.encode([1.0, [stored(token_ids=[1 << 32, 2])]]),
    "bigram token ids": msgspec.msgpack.encode([1.0, [stored(token_ids=[[1, 2], [2, 3]])]]),
    "block size 0": msgspec.msgpack.encode([1.0, [stored(block_size=0, token_ids=[])]]),
    "huge block size": msgspec.msgpack.encode([1.0, [stored(block_size=1 << 30)]]),
    "tokens and blocks disagree": msgspec.msgpack.encode([1.0, [stored(token_ids=[1, 2, 3])]]),
    "a hash that is a string": msgspec.msgpack.encode([1.0, [stored(block_hashes=["h"])]]),
    "a hash of 65 bytes": msgspec.msgpack.encode([1.0, [stored(block_hashes=[b"x" * 65])]]),
    "missing token ids": msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                "block_size": 2}]]),
    "negative ts": msgspec.msgpack.encode([-1.0, []]),
    "ts a string": msgspec.msgpack.encode(["now", []]),
    "negative rank": msgspec.msgpack.encode([1.0, [], -1]),
    "a long medium": msgspec.msgpack.encode([1.0, [stored(medium="x" * 1000)]]),
    "map batch without ts": msgspec.msgpack.encode({"events": []}),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_payloads_are_one_error(name: str) -> None:
    with pytest.raises(KvEventsError):
        decode_batch(BAD[name])


def test_the_error_is_a_protocol_error_and_payloads_are_capped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert issubclass(KvEventsError, ProtocolError)
    payload = encode_batch(tandem_batch())
    monkeypatch.setattr(kv_events, "MAX_PAYLOAD_BYTES", len(payload) - 1)
    with pytest.raises(KvEventsError, match="payload of"):
        decode_batch(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_one_error(data: bytes) -> None:
    try:
        decode_batch(data)
    except KvEventsError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
                    | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
                    lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.sampled_from(["type", "ts", "events", "block_hashes",
                                                       "token_ids", "block_size"]), inner,
                                      max_size=5), max_leaves=30))
def test_any_msgpack_value_decodes_or_is_one_error(value: object) -> None:
    try:
        decode_batch(msgspec.msgpack.encode([1.0, [value]]))
    except KvEventsError:
        pass


# --- frames ---------------------------------------------------------------------------------------

def test_live_frames() -> None:
    payload = encode_batch(tandem_batch())
    frames = live_frames(b"kv", 7, payload)
    assert frames[1] == b"\x00" * 7 + b"\x07"
    assert decode_live(frames) == (b"kv", 7, tandem_batch())
    for bad in (frames[:2], [*frames, b""], [b"kv", b"\x07", payload],
                [b"kv", b"\xff" * 8, payload], [b"kv", frames[1], b"junk"]):
        with pytest.raises(KvEventsError):
            decode_live(bad)


def test_replay_answers_of_both_engines() -> None:
    payload = encode_batch(tandem_batch())
    end = END_SEQ.to_bytes(8, "big")
    assert end == (-1).to_bytes(8, "big", signed=True)
    # vLLM: [seq, payload] ... [END, b""]; SGLang 0.5.23: [topic, seq, payload] ... [b"", END, b""]
    assert decode_replay([b"", seq_frame(3), payload]) == (3, tandem_batch())
    assert decode_replay([b"", b"", seq_frame(3), payload]) == (3, tandem_batch())
    assert decode_replay([b"", end, b""]) is None
    assert decode_replay([b"", b"", end, b""]) is None
    assert decode_replay([b"", *REPLAY_END]) is None  # tandem's own end marker
    assert decode_replay([seq_frame(3), payload], delimited=False) == (3, tandem_batch())
    for bad in ([seq_frame(3), payload], [b"", end, b"x"], [b"", b"t", b"t", end, b""],
                [b""], [b"", b"\x01", payload]):
        with pytest.raises(KvEventsError):
            decode_replay(bad)


def test_replay_requests() -> None:
    assert replay_request(5) == [b"", b"\x00" * 7 + b"\x05"]
    assert parse_replay_start(replay_request(5)) == 5  # (after the ROUTER's identity frame)
    for bad in ([b"", b"\x05"], [b"x", seq_frame(1)], [b"", b"", seq_frame(1)],
                [seq_frame(1)]):
        with pytest.raises(KvEventsError):
            parse_replay_start(bad)
