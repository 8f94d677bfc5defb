"""The response loop: the only code in the frontend that loops over a request's deltas, for one
choice or many, streamed (SSE) or aggregated (one JSON body).

`ChoiceState` is one choice's state and nothing else: its detokenizer (stop strings included), the
`stream_interval` decision, its counts and its finish. It is pure: `feed(delta)` returns the SSE
bytes to write now (none when aggregated, or when the interval says wait), so it is tested without
I/O.

`respond(job, handles, writer, metrics)` enters every choice's request handle (placement; leaving
aborts what has not finished), then multiplexes them: each handle's collector says when it holds
something, and one pass takes every ready choice's (merged) delta, feeds it, and writes what they
produced as one body write. The streamed response starts at the first delta of any choice that is
not an error, so an error before it keeps its own HTTP status; after it, a failure writes what every unfinished choice
had buffered (no choice is shown a finish it did not reach), one `data: {"error": ...}` event, then
`data: [DONE]`. One failing choice fails the response. A choice cut by a stop string is left at
once (its request aborted on the worker). TTFT, inter-token latency, stream chunks, tokens and
errors are recorded here, the same way for every response.

The contract this serves: ARCHITECTURE.md, "Streaming to the client". Usage counts what the workers
produced: `completion_tokens` is every token received by every
choice, including those a stop string cut from the text; `prompt_tokens` counts each prompt once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol

import msgspec

from tandem.frontend import openai_api as api
from tandem.frontend import sse
from tandem.frontend.detokenizer import Detokenizer
from tandem.frontend.http import JSON, ClientGone, ResponseWriter, error_of
from tandem.frontend.metrics import FrontendMetrics
from tandem.runtime import errors
from tandem.runtime.collector import DeltaCollector
from tandem.runtime.wire import Delta, SamplingParams, TokenLogprobs

log = logging.getLogger("tandem.frontend")
_encode = msgspec.json.Encoder().encode


class Handle(Protocol):
    """One request on the workers (tandem.router.request.RequestHandle): entering places it,
    leaving aborts it unless it finished; its deltas arrive in `collector`."""

    rid: str
    collector: DeltaCollector

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc_info: Any) -> Any: ...


@dataclass(slots=True)
class ChoiceSpec:
    """One choice: its prompt (a completions request may carry several), its sampling (its own
    seed) and its detokenizer. A choice's `index` is its position in the job."""

    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    detokenizer: Detokenizer
    echo: str = ""  # completions `echo`: the prompt's text, before the completion's


@dataclass(slots=True)
class GenerationJob:
    """A validated, tokenized request, ready for the pool: every choice in `index` order."""

    kind: Literal["chat", "completion"]
    model: str
    stream: bool
    include_usage: bool
    interval: int
    t0: float  # time.monotonic() at arrival
    choices: list[ChoiceSpec]
    logprobs: int | None = None  # render the tokens' logprobs (None: the response has none)
    continuous_usage: bool = False  # usage in every streamed chunk
    token: api.TokenTexts | None = None  # token id -> (text, bytes), for logprobs
    # What the response loop reports back, for the access log:
    rid: str = ""
    completion_tokens: int = 0
    ttft: float | None = None

    @property
    def prompt_tokens(self) -> int:
        """Every prompt counted once, however many choices it has (as vLLM does)."""
        seen = {c.prompt_index: len(c.prompt_ids) for c in self.choices}
        return sum(seen.values())


class ChoiceState:
    """One choice's state. With an encoder it streams: `feed` returns the chunks to write now, the
    first text at once, then every `interval` tokens, always on the finish. Without one it only
    collects its text (`text`) for the aggregated body."""

    __slots__ = ("detok", "enc", "interval", "buf", "buf_tokens", "num_tokens", "num_chunks",
                 "finish", "sent", "head")

    def __init__(self, detok: Detokenizer, enc: sse.ChunkEncoder | None, interval: int,
                 role: bool = False, prefix: str = "") -> None:
        self.detok = detok
        self.enc = enc
        self.interval = interval
        self.buf: list[str] = [prefix] if prefix else []
        self.buf_tokens = 0
        self.num_tokens = 0  # every token received, those a stop string cut included
        self.num_chunks = 0  # streamed chunks that carried text
        self.finish: str | None = None
        self.sent = False  # whether any text went out yet
        self.head = enc.role() if enc is not None and role else b""  # chat: the role chunk

    def feed(self, d: Delta) -> bytes:
        """Take one (possibly merged) delta. Raises the request's error for an error delta (what
        is buffered stays for `flush`)."""
        ids = d.token_ids
        self.num_tokens += len(ids)
        self.buf_tokens += len(ids)
        fin: str | None = d.finish_reason
        if fin == "error":
            raise error_of(d)
        detok = self.detok
        text = detok.step(ids, fin is not None)
        if text:
            self.buf.append(text)
        if detok.stopped:
            fin = "stop"
        enc = self.enc
        if fin is not None:
            self.finish = fin
            if enc is None:
                return b""
            text = "".join(self.buf)
            self.buf.clear()
            self.num_chunks += bool(text)
            out = self.head + (enc.text(text, fin) if text else enc.finish(fin))
            self.head = b""
            return out
        if enc is None:
            return b""
        if self.buf and (not self.sent or self.buf_tokens >= self.interval):
            out = self.head + enc.text("".join(self.buf))
            self.head = b""
            self.sent = True
            self.buf.clear()
            self.buf_tokens = 0
            self.num_chunks += 1
            return out
        out, self.head = self.head, b""
        return out

    def flush(self) -> bytes:
        """What an unfinished streamed choice holds back, as a chunk without a finish reason."""
        if self.enc is None or self.finish is not None or not self.buf:
            return b""
        text = "".join(self.buf)
        self.buf.clear()
        out, self.head = self.head + self.enc.text(text), b""
        return out

    @property
    def text(self) -> str:
        return "".join(self.buf)


class RichChoiceState(ChoiceState):
    """A choice whose response carries more than text: its tokens' logprobs (streamed with the
    chunk that carries them, or all in the body) and/or the usage so far in every chunk."""

    __slots__ = ("kind", "token", "want_logprobs", "lps", "offset", "prompt_tokens", "continuous")

    def __init__(self, job: GenerationJob, spec: ChoiceSpec, index: int, rid: str,
                 created: int) -> None:
        enc = sse.RichChunkEncoder(job.kind, rid, created, job.model, index, self) \
            if job.stream else None
        super().__init__(spec.detokenizer, enc, job.interval, job.kind == "chat", spec.echo)
        self.kind = job.kind
        self.token = job.token
        self.want_logprobs = job.logprobs is not None and job.token is not None
        self.lps: list[TokenLogprobs] = []  # streamed: not sent yet; aggregated: all
        self.offset = len(spec.echo)
        self.prompt_tokens = len(spec.prompt_ids)
        self.continuous = job.continuous_usage

    def feed(self, d: Delta) -> bytes:
        if self.want_logprobs and d.logprobs:
            self.lps += d.logprobs
        return ChoiceState.feed(self, d)

    def take_logprobs(self) -> api.ChatLogprobs | api.CompletionLogprobs | None:
        if not self.want_logprobs or self.token is None:
            return None
        lps, self.lps = self.lps, []
        if self.kind == "chat":
            return api.chat_logprobs(lps, self.token)
        out = api.completion_logprobs(lps, self.token, self.offset)
        if out.tokens:
            self.offset = out.text_offset[-1] + len(out.tokens[-1])
        return out

    def usage_now(self) -> api.UsageInfo | None:
        return api.usage_info(self.prompt_tokens, self.num_tokens) if self.continuous else None


def _state(job: GenerationJob, spec: ChoiceSpec, index: int, rid: str,
           created: int) -> ChoiceState:
    if job.continuous_usage or job.logprobs is not None:
        return RichChoiceState(job, spec, index, rid, created)
    enc = sse.ChunkEncoder(job.kind, rid, created, job.model, index) if job.stream else None
    return ChoiceState(spec.detokenizer, enc, job.interval, job.kind == "chat", spec.echo)


class _Ready:
    """The indexes of the choices whose collectors hold something, in arrival order."""

    __slots__ = ("queue", "waiter")

    def __init__(self) -> None:
        self.queue: deque[int] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def add(self, index: int) -> None:
        self.queue.append(index)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


async def respond(job: GenerationJob, handles: Sequence[Handle], w: ResponseWriter,
                  m: FrontendMetrics) -> None:
    chat = job.kind == "chat"
    rid = job.rid = ("chatcmpl-" if chat else "cmpl-") + handles[0].rid
    created = int(time.time())
    states = [_state(job, c, i, rid, created) for i, c in enumerate(job.choices)]
    m.prompt_tokens.inc(job.prompt_tokens)
    last = [0.0] * len(states)
    placed_at = last_at = 0.0
    entered: list[Handle] = []
    ready = _Ready()
    left = len(states)
    first_at = 0.0
    failure: errors.TandemError | None = None
    out: list[bytes] = []
    try:
        try:
            for h in handles:
                await h.__aenter__()
                entered.append(h)
            placed_at = time.monotonic()
            m.queue_time.observe(placed_at - job.t0)
            for i, h in enumerate(handles):
                h.collector.listen(partial(ready.add, i))
            # The hot loop: names bound once, no allocation a pass does not need.
            queue, takes = ready.queue, [h.collector.take for h in handles]
            loop, monotonic, observe = asyncio.get_running_loop(), time.monotonic, m.itl.observe_n
            to_start = job.stream
            while left:
                if not queue:
                    ready.waiter = waiter = loop.create_future()
                    await waiter
                while queue:
                    i = queue.popleft()
                    st = states[i]
                    d = takes[i]()
                    if d is None or st.finish is not None:
                        continue  # (deltas after a stop string: the request is being left)
                    now = monotonic()
                    if last[i]:
                        k = len(d.token_ids)
                        if k:  # inter-token latency per token, not per delta
                            observe((now - last[i]) / k, k)
                    elif not first_at:
                        first_at = now
                        m.ttft.observe(now - job.t0)
                        m.prefill_time.observe(now - placed_at)
                    last[i] = now
                    data = st.feed(d)  # (an error delta raises: the status is still free)
                    if to_start:
                        to_start = False
                        await w.start(200, sse.HEADERS)
                    if data:
                        out.append(data)
                    if st.finish is not None:
                        left -= 1
                        await handles[i].__aexit__(None, None, None)  # a stop string: abort
                if left and out:
                    data = out[0] if len(out) == 1 else b"".join(out)
                    out.clear()
                    await w.body(data)
        except errors.TandemError as e:
            failure = e
        except (ClientGone, asyncio.CancelledError):
            raise
        except Exception as e:
            log.exception("request %s failed", rid)
            failure = errors.TandemError(f"Internal server error: {type(e).__name__}")
    except BaseException as e:
        m.error("client_disconnected" if isinstance(e, (ClientGone, asyncio.CancelledError))
                else "internal_error")
        raise
    finally:
        for h in entered:
            await h.__aexit__(None, None, None)
        job.completion_tokens = sum(st.num_tokens for st in states)
        m.generation_tokens.inc(job.completion_tokens)
        if first_at:
            job.ttft = first_at - job.t0
        m.stream_chunks.inc(sum(st.num_chunks for st in states))
        last_at = max(last)
        if first_at and last_at > first_at:
            m.decode_time.observe(last_at - first_at)
    await _finish(job, states, rid, created, failure, out, w, m)


async def _finish(job: GenerationJob, states: list[ChoiceState], rid: str, created: int,
                  failure: errors.TandemError | None, out: list[bytes], w: ResponseWriter,
                  m: FrontendMetrics) -> None:
    """Write the end of the response: the last chunks and [DONE], the JSON body, or the error."""
    if failure is not None:
        m.error(failure.type)
        if failure.type == "kv_transfer_error":
            m.kv_transfer_failures.inc()
        if not w.started:
            await w.error(failure)
            return
        tail = [*out, *(st.flush() for st in states), sse.event(failure.body()), sse.DONE]
        m.stream_chunks.inc(sum(bool(x) for x in tail[len(out):-2]))
        await w.body(b"".join(tail), more=False)
        return
    for st in states:
        m.finished(st.finish or "")
    usage = api.usage_info(job.prompt_tokens, sum(st.num_tokens for st in states))
    if job.stream:
        enc = states[0].enc
        if job.include_usage and enc is not None:
            out.append(enc.usage(usage))
        out.append(sse.DONE)
        if not w.started:
            await w.start(200, sse.HEADERS)
        await w.body(b"".join(out), more=False)
        return
    outs = [(st.text, st.finish) for st in states]
    lps = [st.take_logprobs() if isinstance(st, RichChoiceState) else None for st in states]
    body: api.ChatCompletion | api.Completion
    if job.kind == "chat":
        body = api.chat_completion_choices(
            rid, created, job.model, outs, usage,
            [x if isinstance(x, api.ChatLogprobs) else None for x in lps])
    else:
        body = api.text_completion_choices(
            rid, created, job.model, outs, usage,
            [x if isinstance(x, api.CompletionLogprobs) else None for x in lps])
    await w.reply(200, _encode(body), JSON)
