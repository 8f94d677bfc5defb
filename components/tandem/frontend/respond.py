"""The response loop: the only code in the frontend that loops over a request's deltas, for one
choice or many, streamed (SSE) or aggregated (one JSON body). Each choice's state is a
tandem.frontend.choice.ChoiceState (pure: a delta in, the bytes to write out).

`respond(job, handles, writer, metrics)` enters every choice's request handle (placement; leaving
aborts what has not finished), then multiplexes them: each handle's collector says when it holds
something, and one pass takes every ready choice's (merged) delta, feeds it, and writes what they
produced as one body write. The streamed response starts at the first delta of any choice that is
not an error, so an error before it keeps its own HTTP status; after it, a failure writes what
every unfinished choice had buffered (no choice is shown a finish it did not reach), one
`data: {"error": ...}` event, then `data: [DONE]`. One failing choice fails the response. A
choice cut by a stop string is left at once (its request aborted on the worker). TTFT,
inter-token latency, stream chunks, tokens and errors are recorded here, the same way for every
response.

Push. The task that owns a response is not woken for every token. While it waits (the response
started, or it is aggregated) and nothing is queued, a delta that is neither a choice's last nor
an error is handled at the end of the event loop pass in which it arrived (one callback per pass
for all responses, `_Pusher`; deltas of one request that arrive in the same pass merge in its
collector first): fed to its choice and written with the server's `body_nowait`
(ResponseWriter), which writes at once when the server can take it. A stream's first delta is
pushed at once, where it arrives, and starts the response with the server's `start_now` (the task
waits with nothing queued, and would run one loop pass later: at saturation a pass is
milliseconds). Everything else wakes the task, which does the same through the same
`_Response.one`: a finish, an error, a choice a stop string ended (left by the task), a chunk the
server cannot take now (a slow client: the server paused writing; the task awaits `send`, while
the collector merges what arrives meanwhile), a server without the nowait calls. Order is kept:
push only runs while the task waits with nothing queued.

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
from functools import partial
from typing import Any, Protocol

import msgspec

from tandem.frontend import openai_api as api
from tandem.frontend import sse
from tandem.frontend.choice import (ChoiceSpec, ChoiceState, GenerationJob, RichChoiceState,
                                    state_of)
from tandem.frontend.http import JSON, ClientGone, ResponseWriter
from tandem.frontend.metrics import FrontendMetrics
from tandem.runtime import errors
from tandem.runtime.collector import DeltaCollector
from tandem.runtime.lifecycle import running_loop
from tandem.runtime.wire import Delta

__all__ = ["ChoiceSpec", "ChoiceState", "GenerationJob", "Handle", "respond"]

log = logging.getLogger("tandem.frontend")
_encode = msgspec.json.Encoder().encode


class Handle(Protocol):
    """One request on the workers (tandem.router.request.RequestHandle): entering places it
    (`enter_now` places it at once when that needs no wait), leaving or `release` aborts it
    unless it finished (safe twice); its deltas arrive in `collector`."""

    rid: str
    collector: DeltaCollector

    def enter_now(self) -> bool: ...

    def release(self) -> None: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc_info: Any) -> Any: ...


class _Pusher:
    """Runs the pushes marked during one event loop pass at its end, with one callback per pass
    for every response: deltas of a request that arrive in the same pass merge first. A push its
    response cannot take (see `_Response.push`) goes to the response's task."""

    __slots__ = ("marked", "loop")

    def __init__(self) -> None:
        self.marked: list[tuple[_Response, int]] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    def mark(self, r: _Response, i: int) -> None:
        if not self.marked or self.loop is None or not self.loop.is_running():
            self.marked.clear()  # (a loop that stopped took its callback; one runs per thread)
            self.loop = loop = running_loop()
            loop.call_soon(self.run)
        self.marked.append((r, i))

    def run(self) -> None:
        marked, self.marked = self.marked, []
        for r, i in marked:
            if not (r.parked and not r.queue and r.push(i)):
                r.queue.append(i)
                r.wake()


_PUSHER = _Pusher()


class _Response:
    """One response's loop state, shared by its task (`run`) and by `push`."""

    __slots__ = ("job", "handles", "w", "m", "states", "last", "first_at", "placed_at", "queue",
                 "waiter", "parked", "leaving", "crash", "takes", "running", "observe", "out",
                 "nowait")

    def __init__(self, job: GenerationJob, handles: Sequence[Handle], w: ResponseWriter,
                 m: FrontendMetrics, rid: str, created: int) -> None:
        self.job, self.handles, self.w, self.m = job, handles, w, m
        self.states = [state_of(job, c, i, rid, created) for i, c in enumerate(job.choices)]
        self.last = [0.0] * len(self.states)  # when each choice last got a delta
        self.first_at = self.placed_at = 0.0
        self.queue: deque[int] = deque()  # choices whose collector holds something, for the task
        self.waiter: asyncio.Future[None] | None = None
        self.parked = False  # the task waits and push may handle deltas
        self.leaving: list[int] = []  # choices push saw a stop string end: the task leaves them
        self.crash: BaseException | None = None  # what push raised: the task raises it
        self.takes = [h.collector.take for h in handles]
        self.running = [h.collector.take_running for h in handles]
        self.observe = m.itl.observe_n
        self.out: list[bytes] = []  # produced, not written yet (the task writes it)
        # Push writes through the server's body_nowait; aggregated, it only feeds.
        self.nowait = w.body_nowait if job.stream else None

    def ready(self, i: int) -> None:
        """Choice `i`'s collector turned non-empty (the collector's listener). A stream's first
        chunk is made and written here at once, starting the response (`push`, when the server
        offers START_NOWAIT); later deltas are pushed at the end of the loop pass. What push cannot
        write (a finish, an error, a server without the nowait calls) wakes the task at once, not
        one loop pass later through the pusher. (Parked and streamed means started.)"""
        if self.parked and not self.queue and (self.nowait is not None or not self.job.stream):
            _PUSHER.mark(self, i)  # at the end of this loop pass (what else arrives merges)
            return
        # (A pending waiter means nothing is queued, out, leaving or crashed: each of those
        # wakes the task.)
        waiter = self.waiter
        if (self.nowait is not None and self.w.can_start_now and not self.w.started
                and waiter is not None and not waiter.done() and self.push(i)):
            if not waiter.done():  # (the task still waits: later deltas are pushed)
                self.parked = self.w.started
            return
        self.queue.append(i)
        self.wake()

    def wake(self) -> None:
        self.parked = False
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def one(self, i: int, d: Delta) -> bytes:
        """Choice `i` takes delta `d`: metrics, then its bytes (an error delta raises)."""
        now = time.monotonic()
        last = self.last[i]
        if last:
            k = len(d.token_ids)
            if k:  # inter-token latency per token, not per delta
                self.observe((now - last) / k, k)
        elif not self.first_at:
            self.first_at = now
            self.m.ttft.observe(now - self.job.t0)
            self.m.prefill_time.observe(now - self.placed_at)
        self.last[i] = now
        return self.states[i].feed(d)

    def push(self, i: int) -> bool:
        """Handle choice `i`'s delta here, without the task (which waits with nothing queued);
        False: it is the task's (a finish, a failure). Only called when its chunks can be written
        here: streamed with the server's body_nowait (and START_NOWAIT, for the chunk that starts
        the response), or aggregated."""
        st = self.states[i]
        nowait = self.nowait
        d = self.running[i]()
        if d is None:  # a failure, a finish: the task's
            return False
        if st.finish is not None:
            return True  # after a stop string: dropped, as the task would
        try:
            data = self.one(i, d)
        except Exception as e:  # (a bug: the task raises it as its own)
            self.crash = e
            self.wake()
            return True
        w = self.w
        if data and (nowait is None or w.gone or not (
                nowait(data) if w.started else w.start_now(200, sse.HEADERS, data))):
            self.out.append(data)  # not taken now: the task writes it (starting first), waiting
            self.wake()
        if st.finish is not None:  # a stop string ended it: the task leaves its request
            self.leaving.append(i)
            self.wake()
        return True

    async def run(self, entered: list[Handle]) -> None:
        """Place every choice (each one placed goes in `entered`), then take deltas until every
        choice finished (or one failed); `out` keeps what was produced and not written yet."""
        job, handles, w, states, queue = self.job, self.handles, self.w, self.states, self.queue
        out = self.out
        for h in handles:
            await h.__aenter__()
            entered.append(h)
        self.placed_at = time.monotonic()
        self.m.queue_time.observe(self.placed_at - job.t0)
        for i, h in enumerate(handles):
            h.collector.listen(partial(self.ready, i))
        loop = running_loop()
        stream = job.stream
        left = len(states)
        while left:
            if not queue and not self.leaving and not out:
                if self.crash is not None:
                    raise self.crash
                self.waiter = waiter = loop.create_future()
                self.parked = w.started or not stream
                try:
                    await waiter
                finally:
                    self.parked = False
            while self.leaving:  # push saw a stop string end these
                i = self.leaving.pop()
                left -= 1
                await handles[i].__aexit__(None, None, None)
            while queue:
                i = queue.popleft()
                st = states[i]
                d = self.takes[i]()
                if d is None or st.finish is not None:
                    continue  # (deltas after a stop string: the request is being left)
                data = self.one(i, d)  # (an error delta raises: the status is still free)
                if stream and not w.started:
                    await w.start(200, sse.HEADERS)
                if data:
                    out.append(data)
                if st.finish is not None:
                    left -= 1
                    await handles[i].__aexit__(None, None, None)  # a stop string: abort
            if left and out:
                if not w.started:  # (a first chunk push made but could not write)
                    await w.start(200, sse.HEADERS)
                data = out[0] if len(out) == 1 else b"".join(out)
                out.clear()
                await w.body(data)
async def respond(job: GenerationJob, handles: Sequence[Handle], w: ResponseWriter,
                  m: FrontendMetrics) -> None:
    chat = job.kind == "chat"
    rid = job.rid = ("chatcmpl-" if chat else "cmpl-") + handles[0].rid
    created = int(time.time())
    r = _Response(job, handles, w, m, rid, created)
    states = r.states
    m.prompt_tokens.inc(job.prompt_tokens)
    entered: list[Handle] = []
    failure: errors.TandemError | None = None
    out = r.out
    try:
        try:
            await r.run(entered)
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
        r.parked = False  # (nothing is pushed past here)
        for h in handles:
            h.collector.unlisten()  # (its listener holds `r`: no cycle outlives the request)
        for h in entered:
            await h.__aexit__(None, None, None)
        job.completion_tokens = sum(st.num_tokens for st in states)
        m.generation_tokens.inc(job.completion_tokens)
        first_at = r.first_at
        if first_at:
            job.ttft = first_at - job.t0
        m.stream_chunks.inc(sum(st.num_chunks for st in states))
        last_at = max(r.last)
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
