"""A response with several choices: a completions request with a list of prompts and/or `n > 1`,
or a chat request with `n > 1` (DESIGN §3, "Streaming to the client").

Every choice is a `RequestStream` of its own (`pool.open` once per choice), read by a task of its
own; choice `index` is `prompt_index * n + i`. `run_choices` owns those tasks: it writes what
they produce in arrival order, and however it leaves — finished, failed, or cancelled because the
client went away — it cancels and awaits every one, so each leaves its stream context and an
unfinished request is aborted on its worker (its pages freed).

One failing choice fails the response (an exception, a cancelled stream, a lost worker). Streamed:
the text every unfinished choice had buffered goes out without a finish reason, then one error
event, then [DONE]; no choice is shown a finish it did not reach. Before any byte went out the error
gets its own HTTP status, as with one choice. Each choice coalesces by `stream_interval` as one
choice does: its first text at once, then every N tokens, always on its finish.

Usage: `completion_tokens` sums every token received by every choice; `prompt_tokens` counts each
prompt once (as vLLM does).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from tandem.frontend import openai_api as api
from tandem.frontend import sse
from tandem.frontend.generate import (_NO_RESULT, ChoiceSpec, Exchange,
                                      FrontendMetrics, GenerationJob, Pool, RequestStream,
                                      _left_because)
from tandem.runtime import errors

log = logging.getLogger("tandem.frontend")
_encode = msgspec.json.Encoder().encode
_JSON = b"application/json"


class _Outbox:
    """What the choice tasks hand to the writer: SSE bytes in arrival order, the first failure."""

    __slots__ = ("parts", "wake", "failure", "finished", "first_at")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.wake = asyncio.Event()
        self.failure: errors.TandemError | None = None
        self.finished = 0
        self.first_at = 0.0

    def put(self, data: bytes) -> None:
        self.parts.append(data)
        self.wake.set()


class _Choice:
    """One choice's state. With an encoder it streams (SSE chunks into the outbox, coalesced by
    `interval`); without one it only collects its text for the aggregated body."""

    __slots__ = ("spec", "enc", "interval", "out", "buf", "buf_tokens", "n_tokens", "finish",
                 "head", "sent")

    def __init__(self, spec: ChoiceSpec, enc: sse.ChunkEncoder | None, interval: int, chat: bool,
                 out: _Outbox) -> None:
        self.spec = spec
        self.out = out
        self.enc = enc
        self.interval = interval
        self.buf: list[str] = []
        self.buf_tokens = 0
        self.n_tokens = 0
        self.finish: str | None = None
        self.head = enc.role() if enc is not None and chat else b""
        self.sent = False

    async def run(self, stream: RequestStream) -> None:
        """Read the stream to its finish; a failure is recorded in the outbox, not raised."""
        out = self.out
        try:
            async with stream:
                it = stream.__aiter__()
                async for delta in it:
                    if not out.first_at:
                        out.first_at = time.monotonic()
                    if self._step(delta.token_ids, delta.finish_reason, delta.error, out,
                                  it.waiting()):
                        return
                raise errors.EngineFailed(_NO_RESULT)
        except errors.TandemError as e:
            self._fail(e, out)
        except Exception as e:  # CancelledError is a BaseException: it propagates
            log.exception("a choice of request %s failed", stream.rid)
            self._fail(errors.TandemError(f"Internal server error: {type(e).__name__}"), out)

    def _step(self, ids: list[int], fin: str | None, error: str, out: _Outbox,
              more: int = 0) -> bool:
        """Take one delta; True once the choice is finished. With `more` deltas already waiting
        the text stays buffered: they go out in the same chunk."""
        self.n_tokens += len(ids)
        self.buf_tokens += len(ids)
        if fin == "error":
            raise errors.EngineFailed(error or "The engine failed.")
        detok = self.spec.detokenizer
        text = detok.step(ids, fin is not None)
        if text:
            self.buf.append(text)
        if detok.stopped:
            fin = "stop"
        enc = self.enc
        if fin is not None:
            self.finish = fin
            if enc is not None:
                text = "".join(self.buf)
                self.buf.clear()
                out.put(self.head + (enc.text(text, fin) if text else enc.finish(fin)))
                self.head = b""
            out.finished += 1
            out.wake.set()
            return True
        if enc is not None and self.buf and not more and (
                not self.sent or self.buf_tokens >= self.interval):
            out.put(self.head + enc.text("".join(self.buf)))
            self.head = b""
            self.sent = True
            self.buf.clear()
            self.buf_tokens = 0
        return False

    def ended(self, task: asyncio.Future[None]) -> None:
        """A choice task cancelled before its finish (by anyone but `run_choices` on its way out)
        is a failure: nothing may make it look finished."""
        out = self.out
        if self.finish is None and out.failure is None:
            out.failure = errors.EngineFailed("A choice of this request was cancelled.")
            out.wake.set()

    def _fail(self, e: errors.TandemError, out: _Outbox) -> None:
        if out.failure is None:
            out.failure = e
        out.wake.set()

    def unsent(self) -> bytes:
        """What this unfinished choice holds back, as a chunk without a finish reason."""
        if self.enc is None or self.finish is not None:
            return b""
        text = "".join(self.buf)
        self.buf.clear()
        return self.head + self.enc.text(text) if text else b""


async def run_choices(pool: Pool, job: GenerationJob, ex: Exchange, m: FrontendMetrics) -> None:
    chat = job.kind == "chat"
    rid = api.new_id("")
    created = int(time.time())
    full_rid = ("chatcmpl-" if chat else "cmpl-") + rid
    out = _Outbox()
    choices = [
        _Choice(spec, sse.ChunkEncoder(job.kind, full_rid, created, job.model, i)
                if job.stream else None, job.interval, chat, out)
        for i, spec in enumerate(job.choices)]
    try:
        streams = [pool.open(c.spec.prompt_ids, c.spec.sampling) for c in choices]
    except errors.TandemError as e:
        m.errors.labels(e.type).inc()
        await ex.error(e)
        return
    prompt_tokens = _prompt_tokens(job.choices)
    m.prompt_tokens.inc(prompt_tokens)
    tasks = [asyncio.ensure_future(c.run(s)) for c, s in zip(choices, streams)]
    for c, t in zip(choices, tasks):
        t.add_done_callback(c.ended)
    try:
        if job.stream:
            await _write_stream(choices, out, ex)
        else:
            while out.failure is None and out.finished < len(choices):
                out.wake.clear()
                await out.wake.wait()
    except BaseException as e:
        m.errors.labels(_left_because(e)).inc()
        raise
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        n_tokens = sum(c.n_tokens for c in choices)
        m.generation_tokens.inc(n_tokens)
    if out.first_at:
        m.ttft.observe(out.first_at - job.t0)
    failure = out.failure
    usage = api.usage_info(prompt_tokens, n_tokens)
    if failure is not None:
        m.errors.labels(failure.type).inc()
        if not ex.started:
            await ex.error(failure)
            return
        tail = [*out.parts, *(c.unsent() for c in choices), sse.event(failure.body()), sse.DONE]
        await ex.body(b"".join(tail), more=False)
        return
    for c in choices:
        assert c.finish is not None
        m.finished.labels(c.finish).inc()
    outs = [("".join(c.buf), c.finish) for c in choices]
    if job.stream:
        tail = out.parts
        enc0 = choices[0].enc
        if job.include_usage and enc0 is not None:
            tail.append(enc0.usage(usage))
        tail.append(sse.DONE)
        if not ex.started:
            await ex.start(200, sse.HEADERS)
        await ex.body(b"".join(tail), more=False)
    elif chat:
        await ex.reply(200, _encode(api.chat_completion_choices(full_rid, created, job.model, outs,
                                                                usage)), _JSON)
    else:
        await ex.reply(200, _encode(api.text_completion_choices(full_rid, created, job.model, outs,
                                                                usage)), _JSON)


async def _write_stream(choices: list[_Choice], out: _Outbox, ex: Exchange) -> None:
    """Write the choices' chunks as they come, until every choice finished or one failed; the
    last batch (and the failure, if any) is left in the outbox for the caller to write."""
    while True:
        await out.wake.wait()
        out.wake.clear()
        if out.failure is not None or out.finished == len(choices):
            return
        if out.parts:
            data = b"".join(out.parts)
            out.parts.clear()
            if not ex.started:
                await ex.start(200, sse.HEADERS)
            await ex.body(data)
            # Let the choice tasks run before the next write, so chunks batch under load.
            await asyncio.sleep(0)


def _prompt_tokens(specs: list[ChoiceSpec]) -> int:
    seen: dict[int, int] = {}
    for s in specs:
        seen[s.prompt_index] = len(s.prompt_ids)
    return sum(seen.values())

