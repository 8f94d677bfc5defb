"""The wire contract between tandem processes: every message that crosses a socket is defined here.

Messages are grouped by who receives them, as tagged unions (`ToWorker`, `ToFrontend`,
`ToPrefill`, `ToDecode`); each socket has ONE typed decoder for its receiver's union, so a worker
socket cannot even decode a `KvDone`. A message is one frame (after a ROUTER's identity frame):
msgpack (msgspec, `array_like`), the message's tag as its first element, which is what the
decoder dispatches on. No pickle anywhere.

Untrusted bytes only ever meet `Decoder.decode`, which turns every failure (bad msgpack, wrong
schema, invalid UTF-8, a number out of range, a mismatched or unknown tag, an oversized payload)
into one `ProtocolError`. An error on the wire is an `ErrorKind`, never an HTTP status: the
frontend alone maps kinds to statuses.
"""

from __future__ import annotations

import enum
from typing import Generic, Literal, TypeVar, Union

import msgspec

# 3: tagged unions per receiver, ErrorKind on deltas. 4: penalties, logit_bias, min_p, logprobs and
# constrained output in SamplingParams, logprobs on deltas and KvDone (a version-3 peer would drop
# them silently: the handshake refuses it instead). 5: KvRooms and KvDones (a bootstrap socket's
# messages of one loop pass, in one). 6: no type frame before the payload (its tag is inside).
# 7: one form per batched message: KvRooms, KvDones and KvCancel always carry a list (a lone
# KvRoom or KvDone no longer travels on its own). 8: `Prefills` (a decode worker fetches KV only
# from prefill workers the frontend that sent the request announced). 9: a Generate's `tenant` and
# `priority`; ErrorKind.BUSY (a version-8 peer cannot decode it).
PROTOCOL_VERSION = 9
# Hard cap on one frame's payload; anything larger is refused by ZMQ before we see it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

Role = Literal["agg", "prefill", "decode"]
OutputMode = Literal["cumulative", "incremental"]
FinishReason = Literal["stop", "length", "abort", "error"]


class ErrorKind(enum.IntEnum):
    """Why a request failed, as the worker knows it. The frontend maps each to an HTTP status."""

    ENGINE = 1  # the engine failed the request
    BAD_REQUEST = 2  # the request itself is unacceptable (too long, bad parameters)
    DRAINING = 3  # the worker is shutting down and takes no new work
    FRONTEND_SILENT = 4  # the frontend owed credit and stayed silent: its requests were ended
    KV_TRANSFER = 5  # the KV handoff of a PD request failed (timeout, peer gone)
    DUPLICATE = 6  # a request id already in flight on this worker
    BUSY = 7  # what the request needs is held by others now (the grammar compiler): retry


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


class _Frozen(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    pass


class Message(_Msg, tag_field="t"):
    """A message that travels on its own (has a tag); plain _Msg structs only travel inside one."""


class SamplingParams(_Frozen, frozen=True):
    """What the engine needs to sample one sequence. Defaults here are the only defaults."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Penalties (0 / 1.0 = off): presence and frequency over the completion's tokens, in [-2, 2];
    # repetition (> 0) over prompt and completion: a seen token's positive logit is divided by it,
    # a negative one multiplied.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p x the likeliest
    # Logprobs: None = off; k in [0, 20] = the sampled token's logprob and the k likeliest
    # alternatives', per completion token (TokenLogprobs).
    logprobs: int | None = None
    json_schema: str | None = None  # constrained output (engines that can; others refuse it)
    regex: str | None = None


class Bootstrap(_Frozen, frozen=True):
    """Where a prefill worker's bootstrap socket is, and which room this request is."""

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
    # Where the worker publishes its KV events and answers replay requests (tcp://HOST:PORT, "" =
    # none; tandem.runtime.kv_events). Last, with defaults: a peer that predates them decodes
    # without them (msgspec skips trailing array fields it does not know).
    kv_events_addr: str = ""
    kv_replay_addr: str = ""


class Load(_Msg):
    """A worker's own report of how busy it is."""

    running: int = 0
    waiting: int = 0
    pages_free: int = 0
    pages_total: int = 0
    pages_reserved: int = 0
    draining: bool = False  # the worker takes no new work (shutting down): place nothing here
    pages_cached: int = 0  # of pages_free: cached full pages nobody holds (evicted when needed)
    cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since the start
    cache_hits: int = 0  # of those, found cached (not computed)
    # The host tier (tandem.engines.host_tier; 0 when the worker has none), and what the engine
    # measured: seconds to load one page back from it, and its prefill's seconds per token.
    host_pages_total: int = 0
    host_pages_cached: int = 0
    host_hits: int = 0  # of cache_hits, loaded from the host tier
    host_load_s_per_page: float = 0.0
    prefill_s_per_token: float = 0.0


class Usage(_Msg):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Generate(_Msg):
    """One request, as an item of `Generates`."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    bootstrap: Bootstrap | None = None
    # A migrated request (its worker was lost mid-stream): the last `resume_offset` ids of
    # `prompt_ids` are completion tokens already delivered. The engine counts them as completion
    # (positions keyed for seeded draws, penalties, the mock's tokens start at this position), so
    # the rest of the completion is what an unbroken run would have produced.
    resume_offset: int = 0
    # Who sent it (the frontend's tenant key, a hash: never the client's own key) and its
    # priority (vLLM's: lower first): the engine's fair order (grammar compiles, admission).
    tenant: str = ""
    priority: int = 0
    # Its prefix cache partition: pages of requests with different salts are never shared (""
    # none). The frontend sends a digest, never a tenant's value in clear.
    cache_salt: str = ""


class TokenLogprobs(_Msg):
    """One completion token's logprobs: the sampled token's, and the `SamplingParams.logprobs`
    likeliest tokens' as (id, logprob) pairs, likeliest first. The distribution is the model's own
    (log_softmax of its raw logits, before penalties, bias, temperature or any filter)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class Delta(_Msg):
    """New tokens of one request. `offset` is how many completion tokens came before these ones;
    the receiver refuses a gap or an overlap. A delta with `finish_reason` is the request's last;
    with finish_reason "error", `error_kind` says why, `error` says it in words and `error_param`
    names the request's field at fault, when one is."""

    rid: str
    offset: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str = ""
    error_kind: ErrorKind | None = None
    logprobs: list[TokenLogprobs] | None = None  # when asked for: one per token_ids item
    error_param: str | None = None  # the request field at fault (EngineError.param), if one is

    def extend(self, later: Delta) -> None:
        """Merge the request's next delta into this one, in place: its tokens (and their logprobs)
        appended; its finish, error and usage (when it has one) taken."""
        self.token_ids += later.token_ids
        if later.logprobs:
            if self.logprobs is None:
                self.logprobs = list(later.logprobs)
            else:
                self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason
        if later.usage is not None:
            self.usage = later.usage
        self.error = later.error
        self.error_kind = later.error_kind
        self.error_param = later.error_param

    def joined(self, later: Delta) -> Delta:
        """A new delta: this one merged with the request's next (`extend`); neither changes."""
        d = Delta(self.rid, self.offset, list(self.token_ids), self.finish_reason, self.usage,
                  self.error, self.error_kind,
                  logprobs=None if self.logprobs is None else list(self.logprobs),
                  error_param=self.error_param)
        d.extend(later)
        return d


class KvLayout(_Frozen, frozen=True):
    """What a peer needs to address a worker's KV pages (page-major: page i is the contiguous byte
    range [base_addr + i * page_bytes, + page_bytes))."""

    base_addr: int
    page_bytes: int
    num_pages: int
    mem: str = "DRAM"
    device: int = 0


# --- to a worker (from a frontend) -----------------------------------------------------------------


class Hello(Message, tag=1):
    version: int
    frontend_id: str


class Prefills(Message, tag=10):
    """The bootstrap addresses (host:port) of the prefill workers this frontend uses: a decode
    worker fetches a request's KV only from one the request's frontend announced. Each sending
    replaces the last; a frontend sends it after the handshake and whenever the set changes."""

    addresses: list[str]


class Generates(Message, tag=9):
    """The requests a frontend placed on one worker during one event loop pass, in one message."""

    items: list[Generate]


class Abort(Message, tag=4):
    rids: list[str]


class LoadQuery(Message, tag=6):
    seq: int


class Credit(Message, tag=8):
    """The frontend handed the deltas of `n` more `Deltas` messages to their streams: the worker
    may send `n` more (tandem.worker.outbox)."""

    n: int


# --- to a frontend (from a worker) -----------------------------------------------------------------


class HelloReply(Message, tag=2):
    version: int
    ok: bool
    info: WorkerInfo | None = None
    error: str = ""


class Deltas(Message, tag=5):
    """Every delta one engine step produced for one frontend: one message per step, not per token."""

    items: list[Delta]
    load: Load | None = None


class LoadReport(Message, tag=7):
    seq: int
    load: Load


# --- to a prefill worker's bootstrap socket (from a decode worker) --------------------------------


class KvHello(Message, tag=16):
    """Once per peer: who I am and where my pages are."""

    version: int
    decode_name: str
    agent_metadata: bytes
    layout: KvLayout


class KvRoom(_Msg):
    """Write the KV of `room`'s prompt into these pages of mine (an item of `KvRooms`)."""

    room: int
    pages: list[int]
    skip: int = 0  # leading prompt pages the decode side has cached: write from page `skip` on


class KvCancel(Message, tag=19):
    """These rooms' requests were aborted on the decode side (those of one loop pass)."""

    rooms: list[int]


# --- to a decode worker's bootstrap connection (from a prefill worker) ----------------------------


class KvHelloReply(Message, tag=17):
    ok: bool
    prefill_name: str = ""
    error: str = ""


class KvDone(_Msg):
    """(An item of `KvDones`.) The room's KV is in place (ok) with the first sampled token (and its logprobs, when the
    request asked for them), or not."""

    room: int
    ok: bool
    first_token: int = -1
    error: str = ""
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    cached_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache


ToWorker = Union[Hello, Generates, Abort, LoadQuery, Credit, Prefills]
ToFrontend = Union[HelloReply, Deltas, LoadReport]


class KvRooms(Message, tag=21):
    """The rooms a decode worker asked one prefill worker for in one event loop pass, in order."""

    items: list[KvRoom]


class KvDones(Message, tag=22):
    """The rooms a prefill worker finished for one decode worker in one event loop pass."""

    items: list[KvDone]


ToPrefill = Union[KvHello, KvRooms, KvCancel]
ToDecode = Union[KvHelloReply, KvDones]


class ProtocolError(Exception):
    """A peer sent bytes that do not decode against the receiver's schema."""


M = TypeVar("M")
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    """One message's frame."""
    return _encoder.encode(msg)


class Decoder(Generic[M]):
    """One socket's decoder: only its receiver's messages decode; anything else is a
    ProtocolError (never another exception type, whatever the bytes)."""

    def __init__(self, union: object, name: str) -> None:
        self.name = name
        self._dec: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(union)

    def decode(self, payload: bytes) -> M:
        if len(payload) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"{self.name}: message too large")
        try:
            msg = self._dec.decode(payload)
        except Exception as e:  # msgspec raises DecodeError/ValidationError, and more on odd input
            raise ProtocolError(f"{self.name}: undecodable message: {e}") from None
        return msg

TO_WORKER: Decoder[ToWorker] = Decoder(ToWorker, "worker")
TO_FRONTEND: Decoder[ToFrontend] = Decoder(ToFrontend, "frontend")
TO_PREFILL: Decoder[ToPrefill] = Decoder(ToPrefill, "bootstrap")
TO_DECODE: Decoder[ToDecode] = Decoder(ToDecode, "decode")
