"""The wire contract between tandem processes: every message that crosses a socket is defined here.

Frames on a socket are `[identity,] type byte, payload` — the type byte routes a message before it is
decoded, and each type has its own typed decoder, so untrusted bytes are only ever decoded against a
schema. No pickle anywhere.
"""

from __future__ import annotations

import enum
from typing import Literal

import msgspec

PROTOCOL_VERSION = 2  # 2: Credit (the worker's delta window per frontend), Generates
# Hard cap on one frame's payload; anything larger is refused by ZMQ before we see it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

Role = Literal["agg", "prefill", "decode"]
OutputMode = Literal["cumulative", "incremental"]
FinishReason = Literal["stop", "length", "abort", "error"]


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_REPLY = 2
    GENERATE = 3
    ABORT = 4
    DELTAS = 5
    LOAD_QUERY = 6
    LOAD_REPORT = 7
    CREDIT = 8
    GENERATES = 9
    KV_HELLO = 16
    KV_HELLO_REPLY = 17
    KV_ROOM = 18
    KV_CANCEL = 19
    KV_DONE = 20


class SamplingParams(_Msg, frozen=True):
    """What the engine needs to sample one sequence. Defaults here are the only defaults."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0


class Bootstrap(_Msg, frozen=True):
    """Where a prefill worker's bootstrap socket is, and which room this request is (DESIGN §1)."""

    host: str
    port: int
    room: int


class WorkerInfo(_Msg):
    name: str
    role: Role
    engine: str
    model: str
    page_size: int
    pages_total: int
    max_context: int
    output_mode: OutputMode = "cumulative"
    bootstrap_addr: str = ""
    eos_token_ids: tuple[int, ...] = ()


class Load(_Msg):
    """A worker's own report of how busy it is."""

    running: int = 0
    waiting: int = 0
    pages_free: int = 0
    pages_total: int = 0
    pages_reserved: int = 0


class Usage(_Msg):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


# --- frontend -> worker ---------------------------------------------------------------------------


class Hello(_Msg):
    version: int
    frontend_id: str


class Generate(_Msg):
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    bootstrap: Bootstrap | None = None


class Generates(_Msg):
    """The requests a frontend placed on one worker during one event loop pass, in one message."""

    items: list[Generate]


class Abort(_Msg):
    rids: list[str]


class LoadQuery(_Msg):
    seq: int


class Credit(_Msg):
    """The frontend handed the deltas of `n` more `Deltas` messages to their streams: the worker
    may send `n` more (tandem.worker.outbox)."""

    n: int


# --- worker -> frontend ---------------------------------------------------------------------------


class HelloReply(_Msg):
    version: int
    ok: bool
    info: WorkerInfo | None = None
    error: str = ""


class Delta(_Msg):
    """New tokens of one request. `offset` is how many completion tokens came before these ones;
    the receiver refuses a gap or an overlap. A delta with `finish_reason` is the request's last."""

    rid: str
    offset: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str = ""
    # With finish_reason "error": the HTTP-like status of the failure (400 = the request was
    # unacceptable, 503 = the worker is draining, 500 = the engine failed).
    status: int = 0


class Deltas(_Msg):
    """Every delta one engine step produced for one frontend: one message per step, not per token."""

    items: list[Delta]
    load: Load | None = None


class LoadReport(_Msg):
    seq: int
    load: Load


# --- the KV bootstrap socket of a prefill worker (DESIGN §1 steps 3-4) ---------------------------


class KvLayout(_Msg, frozen=True):
    """What a peer needs to address a worker's KV pages (page-major: page i is the contiguous byte
    range [base_addr + i * page_bytes, + page_bytes))."""

    base_addr: int
    page_bytes: int
    num_pages: int
    mem: str = "DRAM"
    device: int = 0


class KvHello(_Msg):
    """decode -> prefill, once per peer: who I am and where my pages are."""

    version: int
    decode_name: str
    agent_metadata: bytes
    layout: KvLayout


class KvHelloReply(_Msg):
    ok: bool
    prefill_name: str = ""
    error: str = ""


class KvRoom(_Msg):
    """decode -> prefill: write the KV of `room`'s prompt into these pages of mine."""

    room: int
    pages: list[int]


class KvCancel(_Msg):
    """decode -> prefill: the room's request was aborted on the decode side."""

    room: int


class KvDone(_Msg):
    """prefill -> decode: the room's KV is in place (ok) with the first sampled token, or not."""

    room: int
    ok: bool
    first_token: int = -1
    error: str = ""


TYPE_OF: dict[type, MsgType] = {
    Hello: MsgType.HELLO,
    HelloReply: MsgType.HELLO_REPLY,
    Generate: MsgType.GENERATE,
    Abort: MsgType.ABORT,
    Deltas: MsgType.DELTAS,
    LoadQuery: MsgType.LOAD_QUERY,
    Credit: MsgType.CREDIT,
    Generates: MsgType.GENERATES,
    LoadReport: MsgType.LOAD_REPORT,
    KvHello: MsgType.KV_HELLO,
    KvHelloReply: MsgType.KV_HELLO_REPLY,
    KvRoom: MsgType.KV_ROOM,
    KvCancel: MsgType.KV_CANCEL,
    KvDone: MsgType.KV_DONE,
}
CLASS_OF: dict[int, type] = {int(t): c for c, t in TYPE_OF.items()}
TYPE_BYTES: dict[type, bytes] = {c: bytes([int(t)]) for c, t in TYPE_OF.items()}

_encoder = msgspec.msgpack.Encoder()
_decoders = {int(t): msgspec.msgpack.Decoder(c) for t, c in CLASS_OF.items()}


class ProtocolError(Exception):
    """A peer sent bytes that do not decode against the schema (or an unknown type byte)."""


def encode(msg: _Msg) -> tuple[bytes, bytes]:
    """Return `(type byte, payload)` for one message."""
    return TYPE_BYTES[type(msg)], _encoder.encode(msg)


def decode(type_byte: bytes, payload: bytes) -> _Msg:
    if len(type_byte) != 1:
        raise ProtocolError(f"bad type frame of {len(type_byte)} bytes")
    dec = _decoders.get(type_byte[0])
    if dec is None:
        raise ProtocolError(f"unknown message type {type_byte[0]}")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message too large")
    try:
        return dec.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"undecodable {CLASS_OF[type_byte[0]].__name__}: {e}") from e
