"""KV cache events in the format routers read (ARCHITECTURE.md, "KV events"): the events, the
payload tandem publishes, and the one decoder a router uses on what any engine publishes.

The format is the one vLLM and SGLang publish and Dynamo's router, llm-d and SGLang's gateway
consume. On the live stream (a ZMQ PUB socket) each batch is three frames:

    [topic, seq (8 bytes, big-endian unsigned, from 0, one per batch), payload]

and the payload is msgpack: the batch `[ts, events, dp_rank]` (an array), each event a map tagged
by `"type"`:

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
     "token_ids": [t, ...], "block_size": n, "lora_id": nil, "medium": nil, "lora_name": nil,
     "cache_salt": s | nil}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": nil}
    {"type": "AllBlocksCleared"}

One BlockStored may carry a run of parent-linked full blocks: `token_ids` is their tokens, in
order (`len(token_ids) == len(block_hashes) * block_size`). A block hash is the engine's identity
key for parent links and removal; routers recompute their own keys from `token_ids`. Every field
either engine's own structs require is written, `None` included (vLLM's current struct requires
`lora_id`, `medium` and `lora_name`, SGLang's `lora_id`), so a consumer that decodes with either
engine's structs accepts tandem's events. `cache_salt` (vLLM's and SGLang's name) is the salt of
the sequence whose first block this is (None: unsalted): a router roots that block's key at the
salt (tandem.router.blocks.salt_root), so salted prefixes never match unsalted or other salts'
ones. The engines' other optional extras (extra keys, session, ...) tandem does not have, and
does not write.

A consumer that sees a gap in `seq` asks the replay socket (a ROUTER) for the batches from the
first one it lacks: the request is `[identity, b"", start_seq (8 bytes BE)]`; the answer is every
buffered batch with seq >= start_seq, then an end marker whose seq is -1 (eight 0xff bytes). vLLM
answers `[seq, payload]` per batch and `[END, b""]`; SGLang 0.5.23 `[topic, seq, payload]` and
`[b"", END, b""]` (each after the envelope's empty delimiter). `decode_replay` accepts both;
tandem's server answers in SGLang's form (`live_frames`, then `REPLAY_END`): a replayed batch is
then the live stream's three frames, so a consumer parses both with the same code. If the buffer no
longer holds start_seq, the answer starts at its oldest batch: the consumer sees the gap, drops
that worker's index and starts over.

Decoding (untrusted bytes) accepts every shape the engines have published: the batch as an array
(`[ts, events]` or `[ts, events, dp_rank]`) or as a map (one vLLM version:
`{"ts", "events", "data_parallel_rank"}`); each event as a tagged map (vLLM since mid-2026, SGLang
0.5.23) or as the older positional array `["BlockStored", hashes, parent, token_ids, block_size,
lora_id, medium, ...]`, extra trailing fields ignored; block hashes as ints or (vLLM with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) bytes, turned into ints as vLLM does (big-endian, the low 64
bits). Payloads are size-capped and every value range-checked (token ids fit a u32, block sizes,
the blocks' token count); any failure is one `KvEventsError` (a `wire.ProtocolError`). SGLang's
bigram pages (tuples of two ids, EAGLE) are refused like any other malformed token id.

The four ends as frame codecs (tandem.runtime.frames), so the publisher and a router's feed run on
channels like every other protocol end: `PUBLISHED` (a publisher sends `(topic, seq, payload)`),
`SUBSCRIBED` (a subscriber receives a LiveBatch), `REPLAY_SERVED` (the replay server receives a
start seq after the identity, and answers a buffered batch, or None for the end marker) and
`REPLAY_ASKED` (a consumer asks from a seq and receives ReplayBatch, None at the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, NamedTuple, Union

import msgspec
from msgspec import Meta

from tandem.runtime.frames import FrameCodec, receive_only, send_only
from tandem.runtime.wire import MAX_MESSAGE_BYTES, ProtocolError

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "END_SEQ", "EventBatch", "KvEvent",
    "KvEventsError", "LiveBatch", "PUBLISHED", "REPLAY_ASKED", "REPLAY_END", "REPLAY_SERVED",
    "ReplayBatch", "SUBSCRIBED", "decode_batch", "decode_live", "decode_replay", "encode_batch",
    "live_frames", "parse_replay_start", "parse_seq", "replay_request", "seq_frame",
]

MAX_PAYLOAD_BYTES = MAX_MESSAGE_BYTES  # one batch's msgpack
MAX_BLOCK_SIZE = 1 << 20  # tokens per block
END_SEQ = (1 << 64) - 1  # the replay's end marker: -1 as a signed 64-bit, eight 0xff bytes
_END = END_SEQ.to_bytes(8, "big")
REPLAY_END = [b"", _END, b""]  # tandem's end of a replay (SGLang's form), after the delimiter


class KvEventsError(ProtocolError):
    """Frames or a payload that are not KV events in the format (whatever is wrong with them)."""


# --- the events (what tandem's engines make and publish, and what decoding returns) ---------------

# (The fields' bounds apply when bytes are decoded into these types, never when code makes them.)
_Hash = Union[int, Annotated[bytes, Meta(max_length=64)]]
_Token = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
_BlockSize = Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
_Name = Union[Annotated[str, Meta(max_length=256)], None]
_Rank = Union[Annotated[int, Meta(ge=0, le=(1 << 31) - 1)], None]
_Ts = Annotated[float, Meta(ge=0.0)]


class _Event(msgspec.Struct, tag_field="type", tag=True, gc=False):
    """A map tagged by "type" (the class name). Not `omit_defaults`: every field is written."""


class BlockStored(_Event):
    """Full blocks now cached: `block_hashes[i]` holds tokens `[i * block_size, (i + 1) *
    block_size)` of `token_ids`; the first links to `parent_block_hash` (None: no parent)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[_Token]
    block_size: _BlockSize
    lora_id: int | None = None
    medium: _Name = None  # the storage tier: "GPU", "CPU_PINNED", ... (None: not said)
    lora_name: _Name = None
    cache_salt: _Name = None  # the sequence's cache salt (its first block's root; None: none)


class BlockRemoved(_Event):
    """Blocks no longer cached (evicted)."""

    block_hashes: list[int]
    medium: _Name = None


class AllBlocksCleared(_Event):
    """Every block of this worker is gone (a consumer drops the worker's index)."""


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One batch: `[ts, events, dp_rank]` (ts: seconds since the epoch, when it was made)."""

    ts: _Ts
    events: list[KvEvent]
    dp_rank: _Rank = 0


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch) -> bytes:
    """A batch's payload, as tandem publishes it."""
    return _encoder.encode(batch)


# --- decoding: every published shape, as one kind of result or one error -------------------------
# BlockStored's fields are declared three times, on purpose: what tandem writes (BlockStored above),
# the tagged map (_StoredMap) and the positional array (_StoredArray) it reads: the three shapes
# must move together (their one token-count check: `_check_tokens`).


class _StoredMap(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[_Token]
    block_size: _BlockSize
    lora_id: int | None = None
    medium: _Name = None
    lora_name: _Name = None
    cache_salt: _Name = None


class _RemovedMap(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: _Name = None


class _ClearedMap(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored"):
    # Positions 7 on differ between the engines (vLLM: lora_name, ...; SGLang: cache_salt, ...).
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[_Token]
    block_size: _BlockSize
    lora_id: int | None = None
    medium: _Name = None


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: _Name = None


class _ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: _Ts
    events: list[msgspec.Raw]
    dp_rank: _Rank = None


class _MapBatch(msgspec.Struct, rename={"dp_rank": "data_parallel_rank"}):
    ts: _Ts
    events: list[msgspec.Raw]
    dp_rank: _Rank = None


_map_events = msgspec.msgpack.Decoder(Union[_StoredMap, _RemovedMap, _ClearedMap])
_array_events = msgspec.msgpack.Decoder(Union[_StoredArray, _RemovedArray, _ClearedArray])
_array_batch = msgspec.msgpack.Decoder(_ArrayBatch)
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_fast_batch = msgspec.msgpack.Decoder(EventBatch)
_MASK64 = (1 << 64) - 1


def _kind(first: int) -> str:
    """What a msgpack value is, from its first byte: "map", "array" or "other"."""
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "map"
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return "array"
    return "other"


def _hash(h: int | bytes) -> int:
    return int.from_bytes(h, "big") & _MASK64 if isinstance(h, bytes) else h


def _check_tokens(ev: BlockStored | _StoredMap | _StoredArray) -> None:
    """A BlockStored's token ids fill its blocks exactly."""
    if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
        raise KvEventsError(f"BlockStored: {len(ev.token_ids)} token ids for "
                            f"{len(ev.block_hashes)} blocks of {ev.block_size}")


def _event(raw: msgspec.Raw) -> KvEvent:
    view = memoryview(raw)
    kind = _kind(view[0]) if len(view) else "other"
    if kind == "other":
        raise KvEventsError("an event is neither a map nor an array")
    ev = (_map_events if kind == "map" else _array_events).decode(view)
    if isinstance(ev, (_StoredMap, _StoredArray)):
        _check_tokens(ev)
        parent = None if ev.parent_block_hash is None else _hash(ev.parent_block_hash)
        return BlockStored([_hash(h) for h in ev.block_hashes], parent, ev.token_ids,
                           ev.block_size, ev.lora_id, ev.medium,
                           getattr(ev, "lora_name", None), getattr(ev, "cache_salt", None))
    if isinstance(ev, (_RemovedMap, _RemovedArray)):
        return BlockRemoved([_hash(h) for h in ev.block_hashes], ev.medium)
    return AllBlocksCleared()


def decode_batch(payload: bytes | memoryview) -> EventBatch:
    """A batch from any engine's payload (see the module docstring); KvEventsError if it is not
    one, whatever the bytes."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KvEventsError(f"payload of {len(payload)} bytes (most: {MAX_PAYLOAD_BYTES})")
    try:  # the fast path: tandem's own form (and any with int hashes), in one typed decode
        fast = _fast_batch.decode(payload)
    except Exception:  # (not only msgspec's errors: a tag of invalid UTF-8 is UnicodeDecodeError)
        pass
    else:
        for ev in fast.events:
            if isinstance(ev, BlockStored):
                _check_tokens(ev)
        return fast
    try:
        kind = _kind(payload[0]) if len(payload) else "other"
        if kind == "other":
            raise KvEventsError("the payload is neither an array nor a map")
        batch = (_array_batch if kind == "array" else _map_batch).decode(payload)
        return EventBatch(batch.ts, [_event(raw) for raw in batch.events], batch.dp_rank)
    except KvEventsError:
        raise
    except Exception as e:  # msgspec's DecodeError/ValidationError, and anything odd input makes
        raise KvEventsError(f"undecodable KV event batch: {e}") from None


# --- frames ---------------------------------------------------------------------------------------


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def parse_seq(frame: bytes) -> int:
    """A sequence frame: 8 bytes, big-endian unsigned (END_SEQ: the replay's end marker)."""
    if len(frame) != 8:
        raise KvEventsError(f"a sequence frame has 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big")


class LiveBatch(NamedTuple):
    topic: bytes
    seq: int
    batch: EventBatch


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One batch on the live stream (and, after the envelope, in tandem's replay answer)."""
    return [topic, seq_frame(seq), payload]


def decode_live(frames: Sequence[bytes]) -> LiveBatch:
    """A batch as a SUB socket receives it: `[topic, seq, payload]`."""
    if len(frames) != 3:
        raise KvEventsError(f"a live batch has 3 frames, not {len(frames)}")
    seq = parse_seq(frames[1])
    if seq == END_SEQ:
        raise KvEventsError("the end marker on the live stream")
    return LiveBatch(frames[0], seq, decode_batch(frames[2]))


def replay_request(start_seq: int) -> list[bytes]:
    """What a consumer's DEALER sends the replay socket: every batch from `start_seq`, please."""
    return [b"", seq_frame(start_seq)]


def parse_replay_start(frames: Sequence[bytes]) -> int:
    """The start_seq of a request as the replay ROUTER receives it, after the identity frame:
    `[b"", start_seq]`."""
    if len(frames) != 2 or frames[0] != b"":
        raise KvEventsError("a replay request is [identity, b'', start_seq]")
    return parse_seq(frames[1])


class ReplayBatch(NamedTuple):
    seq: int
    batch: EventBatch


def decode_replay(frames: Sequence[bytes], delimited: bool = True) -> ReplayBatch | None:
    """One message of a replay answer, vLLM's form or SGLang's: a batch, or None at the end
    marker. `delimited`: the frames start with the envelope's empty frame (a DEALER receives it;
    a socket that strips it, not)."""
    if delimited:
        if not frames or frames[0] != b"":
            raise KvEventsError("a replay answer starts with an empty delimiter frame")
        frames = frames[1:]
    if len(frames) not in (2, 3):  # vLLM: [seq, payload]; SGLang: [topic, seq, payload]
        raise KvEventsError(f"a replay answer has 2 or 3 frames, not {len(frames)}")
    seq, payload = parse_seq(frames[-2]), frames[-1]
    if seq == END_SEQ:
        if payload:
            raise KvEventsError("the replay's end marker carries a payload")
        return None
    return ReplayBatch(seq, decode_batch(payload))


LiveOut = tuple[bytes, int, bytes]  # (topic, seq, payload): one batch as a publisher sends it


def _replay_answer(item: LiveOut | None) -> list[bytes]:
    return [b"", *(REPLAY_END if item is None else live_frames(*item))]


PUBLISHED: FrameCodec[LiveOut, LiveBatch] = FrameCodec(
    "kv-events", lambda item: live_frames(*item), send_only("kv-events"))
SUBSCRIBED: FrameCodec[LiveOut, LiveBatch] = FrameCodec(
    "kv-events", receive_only("kv-events"), decode_live)
REPLAY_SERVED: FrameCodec[LiveOut | None, int] = FrameCodec(
    "kv-replay", _replay_answer, parse_replay_start)
REPLAY_ASKED: FrameCodec[int, ReplayBatch | None] = FrameCodec(
    "kv-replay", replay_request, decode_replay)
