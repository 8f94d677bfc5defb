"""One generation request from `pool.open` to the last byte of the response.

`run_generation` is the only code that loops over a request's deltas in the frontend: it feeds them
to the request's detokenizer, coalesces streamed text by `stream_interval` (the first text at once,
then every N tokens, always on finish; deltas that are already here when one is taken go out in
the same chunk, so a frontend that lags writes fewer, fuller chunks), and writes SSE chunks or one
aggregated JSON body. It leaves the `RequestStream` context as soon as a stop string completes, an
error arrives or the client is gone — leaving early is what aborts the request on the worker.

Usage counts what the worker produced: `completion_tokens` is every token received, including
those a stop string cut from the text.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from tandem.frontend import openai_api as api
from tandem.frontend import sse
from tandem.frontend.detokenizer import Detokenizer
from tandem.runtime import errors
from tandem.runtime.metrics import ITL_BUCKETS, TTFT_BUCKETS, Registry
from tandem.runtime.wire import Delta, SamplingParams, WorkerInfo

log = logging.getLogger("tandem.frontend")
_encode = msgspec.json.Encoder().encode
_JSON = b"application/json"


class DeltaSource(Protocol):
    """A request's deltas, in order; `waiting()` says how many are already here (the frontend
    merges those into one chunk instead of writing one chunk per delta)."""

    def waiting(self) -> int: ...

    def __aiter__(self) -> DeltaSource: ...

    def __anext__(self) -> Awaitable[Delta]: ...


class RequestStream(Protocol):
    """What `WorkerPool.open` returns (tandem.router.pool): an async context manager that aborts
    the request when left early, and an async iterator of the request's deltas."""

    rid: str

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc_info: Any) -> Any: ...

    def __aiter__(self) -> DeltaSource: ...


class Pool(Protocol):
    """The part of tandem.router.pool.WorkerPool the frontend uses."""

    @property
    def info(self) -> WorkerInfo | None: ...

    def ready(self) -> bool: ...

    async def snapshot(self) -> list[dict[str, Any]]: ...

    def open(self, prompt_ids: list[int], sampling: SamplingParams) -> RequestStream: ...

    def metrics(self) -> str: ...


class ClientGone(Exception):
    """The HTTP client disconnected (a write failed, or the server said `http.disconnect`)."""


class Exchange:
    """The response side of one HTTP exchange. A failed write marks the client gone and raises
    `ClientGone`; `status` is what was sent (0 until the response starts)."""

    __slots__ = ("_send", "status", "finished", "gone")

    def __init__(self, send: Callable[[MutableMapping[str, Any]], Awaitable[None]]):
        self._send = send
        self.status = 0
        self.finished = False
        self.gone = False

    @property
    def started(self) -> bool:
        return self.status != 0

    async def _emit(self, message: MutableMapping[str, Any]) -> None:
        if self.gone:
            raise ClientGone()
        try:
            await self._send(message)
        except Exception as e:  # the server's way to say the peer is gone varies by server
            self.gone = True
            raise ClientGone() from e

    async def start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.status = status
        await self._emit({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = True) -> None:
        if not more:
            self.finished = True
        await self._emit({"type": "http.response.body", "body": data, "more_body": more})

    async def reply(self, status: int, body: bytes, content_type: bytes,
                    headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        await self.start(status, [(b"content-type", content_type),
                                  (b"content-length", str(len(body)).encode()), *headers])
        await self.body(body, more=False)

    async def error(self, err: errors.TandemError) -> None:
        """The error's status and OpenAI body; `Retry-After` when the error says when to retry."""
        headers: list[tuple[bytes, bytes]] = []
        if err.retry_after is not None or isinstance(err, errors.Unavailable):
            seconds = max(1, math.ceil(err.retry_after or 1))
            headers.append((b"retry-after", str(seconds).encode()))
        await self.reply(err.status, _encode(err.body()), _JSON, headers)


class FrontendMetrics:
    """The frontend's own Prometheus series (names in the style of vLLM, under `tandem_`)."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.counter("tandem_http_requests_total",
                                  "HTTP requests by endpoint and status.", ("endpoint", "status"))
        self.in_flight = r.gauge("tandem_requests_in_flight",
                                 "Generation requests being served now.")
        self.prompt_tokens = r.counter("tandem_prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = r.counter("tandem_generation_tokens_total",
                                           "Completion tokens received from workers.")
        self.stream_chunks = r.counter(
            "tandem_stream_chunks_total",
            "Streamed SSE chunks that carry text. generation_tokens_total over this is tokens "
            "per chunk: above 1 when stream_interval asks for it or when the frontend lags and "
            "merges the deltas that are already waiting (inter-token latency then grows).")
        self.finished = r.counter("tandem_request_success_total",
                                  "Generation requests finished, by finish reason.",
                                  ("finished_reason",))
        self.errors = r.counter("tandem_request_errors_total",
                                "Generation requests that failed, by error type.", ("type",))
        self.ttft = r.histogram("tandem_time_to_first_token_seconds",
                                "From request arrival to the first delta.", buckets=TTFT_BUCKETS)
        self.itl = r.histogram("tandem_inter_token_latency_seconds",
                               "Time between consecutive deltas of a request.",
                               buckets=ITL_BUCKETS)
        self.e2e = r.histogram("tandem_e2e_request_latency_seconds",
                               "From request arrival to the end of the response.")


@dataclass(slots=True)
class ChoiceSpec:
    """One choice of a request with several (tandem.frontend.choices): its own prompt (a
    completions request may carry several), sampling (its own seed) and detokenizer."""

    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    detokenizer: Detokenizer


@dataclass(slots=True)
class GenerationJob:
    """A validated, tokenized request, ready for the pool. `choices` is empty for a request with
    one choice (described by `prompt_ids`, `sampling`, `detokenizer`), else lists every choice in
    `index` order."""

    kind: Literal["chat", "completion"]
    model: str
    stream: bool
    include_usage: bool
    interval: int
    prompt_ids: list[int]
    sampling: SamplingParams
    detokenizer: Detokenizer
    t0: float  # time.monotonic() at arrival
    choices: list[ChoiceSpec] = field(default_factory=list)


_NO_RESULT = "The worker ended the request without a finish reason."
# Yield to the event loop every 64 deltas even when deltas and writes never wait (a backlog of
# queued deltas; a server that drops writes to a gone client): other streams get their turn and
# the disconnect watcher gets to run.
_YIELD_MASK = 63


def _left_because(e: BaseException) -> str:
    return "client_disconnected" if isinstance(e, (ClientGone, asyncio.CancelledError)) \
        else "internal_error"


async def run_generation(pool: Pool, job: GenerationJob, ex: Exchange,
                         m: FrontendMetrics) -> None:
    try:
        stream = pool.open(job.prompt_ids, job.sampling)
    except errors.TandemError as e:
        m.errors.labels(e.type).inc()
        await ex.error(e)
        return
    m.prompt_tokens.inc(len(job.prompt_ids))
    if job.stream:
        await _stream(stream, job, ex, m)
    else:
        await _aggregate(stream, job, ex, m)


async def _stream(stream: RequestStream, job: GenerationJob, ex: Exchange,
                  m: FrontendMetrics) -> None:
    chat = job.kind == "chat"
    enc = sse.ChunkEncoder(job.kind, ("chatcmpl-" if chat else "cmpl-") + stream.rid,
                           int(time.time()), job.model)
    detok = job.detokenizer
    interval = job.interval
    itl = m.itl.child()
    buf: list[str] = []
    buf_tokens = 0
    n_tokens = 0
    finish: str | None = None
    failure: errors.TandemError | None = None
    head = b""  # the role chunk, sent with the first text
    n_deltas = 0
    n_chunks = 0
    sent = False  # whether any text went out yet: the first text goes at once
    try:
        async with stream:
            it = stream.__aiter__()
            try:
                delta = await it.__anext__()
            except errors.TandemError as e:
                failure = e
            except StopAsyncIteration:
                failure = errors.EngineFailed(_NO_RESULT)
            else:
                last = time.monotonic()
                m.ttft.observe(last - job.t0)
                await ex.start(200, sse.HEADERS)
                head = enc.role() if chat else b""
                try:
                    while True:
                        ids = delta.token_ids
                        n_tokens += len(ids)
                        buf_tokens += len(ids)
                        fin = delta.finish_reason
                        if fin == "error":
                            raise errors.EngineFailed(delta.error or "The engine failed.")
                        text = detok.step(ids, fin is not None)
                        if text:
                            buf.append(text)
                        if detok.stopped:
                            fin = "stop"
                        if fin is not None:
                            finish = fin
                            break
                        if it.waiting():
                            pass  # the next delta is already here: it goes in the same chunk
                        elif buf and (not sent or buf_tokens >= interval):
                            n_chunks += 1
                            await ex.body(head + enc.text("".join(buf)))
                            head = b""
                            sent = True
                            buf.clear()
                            buf_tokens = 0
                        elif head:
                            await ex.body(head)
                            head = b""
                        n_deltas += 1
                        if not n_deltas & _YIELD_MASK:
                            await asyncio.sleep(0)
                        delta = await it.__anext__()
                        now = time.monotonic()
                        itl.observe(now - last)
                        last = now
                except errors.TandemError as e:
                    failure = e
                except StopAsyncIteration:
                    failure = errors.EngineFailed(_NO_RESULT)
                except ClientGone:
                    raise
                except Exception as e:
                    log.exception("streaming request %s failed", stream.rid)
                    failure = errors.TandemError(f"Internal server error: {type(e).__name__}")
    except BaseException as e:
        m.generation_tokens.inc(n_tokens)
        m.stream_chunks.inc(n_chunks)
        m.errors.labels(_left_because(e)).inc()
        raise
    m.generation_tokens.inc(n_tokens)
    if failure is not None and not ex.started:
        m.errors.labels(failure.type).inc()
        await ex.error(failure)
        return
    out = [head]
    text = "".join(buf)
    m.stream_chunks.inc(n_chunks + bool(text))
    if failure is None:
        assert finish is not None
        out.append(enc.text(text, finish) if text else enc.finish(finish))
        if job.include_usage:
            out.append(enc.usage(api.usage_info(len(job.prompt_ids), n_tokens)))
        m.finished.labels(finish).inc()
    else:
        if text:
            out.append(enc.text(text))
        out.append(sse.event(failure.body()))
        m.errors.labels(failure.type).inc()
    out.append(sse.DONE)
    await ex.body(b"".join(out), more=False)


async def _aggregate(stream: RequestStream, job: GenerationJob, ex: Exchange,
                     m: FrontendMetrics) -> None:
    detok = job.detokenizer
    parts: list[str] = []
    n_tokens = 0
    finish: str | None = None
    failure: errors.TandemError | None = None
    last = 0.0
    n_deltas = 0
    try:
        async with stream:
            try:
                async for delta in stream:
                    n_deltas += 1
                    if not n_deltas & _YIELD_MASK:
                        await asyncio.sleep(0)
                    now = time.monotonic()
                    if last:
                        m.itl.observe(now - last)
                    else:
                        m.ttft.observe(now - job.t0)
                    last = now
                    n_tokens += len(delta.token_ids)
                    fin = delta.finish_reason
                    if fin == "error":
                        raise errors.EngineFailed(delta.error or "The engine failed.")
                    text = detok.step(delta.token_ids, fin is not None)
                    if text:
                        parts.append(text)
                    if detok.stopped:
                        fin = "stop"
                    if fin is not None:
                        finish = fin
                        break
                else:
                    failure = errors.EngineFailed(_NO_RESULT)
            except errors.TandemError as e:
                failure = e
            except Exception as e:
                log.exception("request %s failed", stream.rid)
                failure = errors.TandemError(f"Internal server error: {type(e).__name__}")
    except BaseException as e:
        m.generation_tokens.inc(n_tokens)
        m.errors.labels(_left_because(e)).inc()
        raise
    m.generation_tokens.inc(n_tokens)
    if failure is not None:
        m.errors.labels(failure.type).inc()
        await ex.error(failure)
        return
    assert finish is not None
    m.finished.labels(finish).inc()
    usage = api.usage_info(len(job.prompt_ids), n_tokens)
    text = "".join(parts)
    created = int(time.time())
    body: api.ChatCompletion | api.Completion
    if job.kind == "chat":
        body = api.chat_completion("chatcmpl-" + stream.rid, created, job.model, text, finish,
                                   usage)
    else:
        body = api.text_completion("cmpl-" + stream.rid, created, job.model, text, finish, usage)
    await ex.reply(200, _encode(body), _JSON)
