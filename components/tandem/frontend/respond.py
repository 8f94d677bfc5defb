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

Push. The task that owns a response is not woken for every token: where a delta goes is what
the response's `ResponseState` says (tandem.frontend.response_state: its phases, and why). While
the task waits (the response started, or it is aggregated) and nothing is queued, a delta that is
neither a choice's last nor an error is handled at the end of the event loop pass in which it
arrived (the app's `Pushes`: one callback per pass for all responses; deltas of one request that
arrive in the same pass merge in its collector first): fed to its choice and written with the
server's `body_nowait` (ResponseWriter), which writes at once when the server can take it. A
stream's first delta is pushed at once, where it arrives, and starts the response with the
server's `start_now` (the task would run one loop pass later: at saturation a pass is
milliseconds). Everything else wakes the task, which feeds through the same `_Response.one`: a
finish, an error, a choice a stop string ended (left by the task), a chunk the server cannot take
now (a slow client: the server paused writing; the task awaits `send`, while the collector merges
what arrives meanwhile), a server without the nowait calls.

The contract this serves: ARCHITECTURE.md, "Streaming to the client". Usage counts what the client
was given: `completion_tokens` is every choice's tokens up to its finish (a stop string's last token
included, none that arrived after it: a merged delta's tail past the stop is not counted, so the
count does not depend on how deltas merged); `prompt_tokens` counts each prompt once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import msgspec

from tandem.frontend import openai_api as api
from tandem.frontend import schemas
from tandem.frontend import sse
from tandem.frontend.choice import (ChoiceSpec, ChoiceState, GenerationJob, RichChoiceState,
                                    ToolCallState, state_of)
from tandem.frontend.http import JSON, ClientGone, ResponseWriter
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.response_state import FIRST, STREAMING, ResponseState
from tandem.runtime import errors, timeline
from tandem.runtime.collector import DeltaCollector
from tandem.runtime.lifecycle import running_loop
from tandem.runtime.passes import PassBatcher
from tandem.runtime.wire import Delta

__all__ = ["ChoiceSpec", "ChoiceState", "GenerationJob", "Handle", "Pushes", "new_pushes", "respond"]

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


Pushes = PassBatcher[tuple["_Response", int]]


def _push_marked(marked: list[tuple[_Response, int]]) -> None:
    for r, i in marked:  # (still STREAMING: the task waits with nothing queued, order is kept)
        if r.rs.phase == STREAMING and r.push(i):
            continue
        r.rs.queue.append(i)
        r.wake()


def new_pushes() -> Pushes:
    """The pushes of every response of one app: run at the end of the loop pass they were marked
    in, with one callback per pass (deltas of a request that arrive in the same pass merge
    first)."""
    return PassBatcher(_push_marked)


class _Response:
    """One response: its choices, its writer, and its `ResponseState` (tandem.frontend.
    response_state: where the response is, and so where a delta goes). `run` is its task; `ready`
    is where its deltas arrive; `push` handles one without the task; `one` feeds a choice, for
    both."""

    __slots__ = ("job", "handles", "w", "m", "states", "last", "first_at", "placed_at", "rs",
                 "waiter", "takes", "running", "observe", "nowait", "pushes")

    def __init__(self, job: GenerationJob, handles: Sequence[Handle], w: ResponseWriter,
                 m: FrontendMetrics, rid: str, created: int, pushes: Pushes) -> None:
        self.job, self.handles, self.w, self.m, self.pushes = job, handles, w, m, pushes
        self.states = [state_of(job, c, i, rid, created) for i, c in enumerate(job.choices)]
        self.last = [0.0] * len(self.states)  # when each choice last got a delta
        self.first_at = self.placed_at = 0.0
        self.rs = ResponseState(job.stream, w.body_nowait is not None, w.can_start_now)
        self.waiter: asyncio.Future[None] | None = None
        self.takes = [h.collector.take for h in handles]
        self.running = [h.collector.take_running for h in handles]
        self.observe = m.itl.observe_n
        # Push writes through the server's body_nowait; aggregated, it only feeds.
        self.nowait = w.body_nowait if job.stream else None

    def ready(self, i: int) -> None:
        """Choice `i`'s collector turned non-empty (the collector's listener): its delta goes where
        the response's phase says (tandem.frontend.response_state)."""
        rs = self.rs
        phase = rs.phase
        if phase == STREAMING:  # at the end of this loop pass (what else arrives merges)
            self.pushes.add((self, i))
            return
        if phase == FIRST:  # a stream's first chunk, made and written here, starts the response
            if self.push(i):
                if rs.phase == FIRST:  # (the task still waits: nothing was left for it)
                    rs.park(self.w.started)
                return
        rs.queue.append(i)
        self.wake()

    def wake(self) -> None:
        self.rs.wake()
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
        here: streamed with the server's body_nowait (and start_nowait, for the chunk that starts
        the response), or aggregated. What it cannot finish is left for the task, woken."""
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
            self.rs.failed(e)
            self.wake()
            return True
        w = self.w
        if data and (nowait is None or w.gone or not (
                nowait(data) if w.started else w.start_now(200, sse.HEADERS, data))):
            self.rs.left_over(data)  # not taken now: the task writes it (starting first)
            self.wake()
        if st.finish is not None:  # a stop string ended it: the task leaves its request
            self.rs.stopped(i)
            self.wake()
        return True

    async def run(self, entered: list[Handle]) -> None:
        """Place every choice (each one placed goes in `entered`), then take deltas until every
        choice finished (or one failed); `rs.out` keeps what was produced and not written yet."""
        job, handles, w, states, rs = self.job, self.handles, self.w, self.states, self.rs
        queue, out, leaving = rs.queue, rs.out, rs.leaving
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
            if not queue and not leaving and not out:
                if rs.crash is not None:
                    raise rs.crash
                self.waiter = waiter = loop.create_future()
                rs.park(w.started)
                try:
                    await waiter
                finally:
                    rs.wake()
            while leaving:  # push saw a stop string end these
                i = leaving.pop()
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


class _Timed(_Response):
    """A response of a process with a request timeline (tandem.runtime.timeline): `one` also
    marks the first delta and the first bytes. (A class of its own, so that without a timeline
    the route of a token tests nothing more.)"""

    __slots__ = ("chunked",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.chunked = False

    def one(self, i: int, d: Delta) -> bytes:
        first = not self.first_at
        data = super().one(i, d)
        if first:
            timeline.mark("first", self.handles[i].rid)
        if data and not self.chunked:
            self.chunked = True
            timeline.mark("chunk", self.handles[i].rid)
        return data


async def respond(job: GenerationJob, handles: Sequence[Handle], w: ResponseWriter,
                  m: FrontendMetrics, pushes: Pushes) -> None:
    chat = job.kind == "chat"
    rid = job.rid = ("chatcmpl-" if chat else "cmpl-") + handles[0].rid
    created = int(time.time())
    r = (_Timed if timeline.ON else _Response)(job, handles, w, m, rid, created, pushes)
    states = r.states
    m.prompt_tokens.inc(job.prompt_tokens)
    entered: list[Handle] = []
    failure: errors.TandemError | None = None
    out = r.rs.out
    try:
        try:
            await r.run(entered)
        except errors.TandemError as e:
            # (its traceback holds this frame, which holds it: a cycle that would keep the whole
            # request, down to its connection, for the cyclic collector; an answer needs no
            # traceback)
            failure = e.with_traceback(None)
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
        r.rs.finish()  # (nothing is pushed past here)
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
        if failure.param == "json_schema" and job.constraint is not None:  # (the engine's name
            failure.param = job.constraint.param  # for the request's grammar: its field here)
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
    usage = api.usage_info(job.prompt_tokens, sum(st.num_tokens for st in states),
                           job.cached_tokens(states))
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
    lps = [st.body_logprobs() if isinstance(st, RichChoiceState) else None for st in states]
    body: schemas.ChatCompletion | schemas.Completion
    if job.kind == "chat":
        calls = [st.calls if isinstance(st, ToolCallState) else None for st in states]
        body = api.chat_completion_choices(rid, created, job.model, outs, usage, lps, calls)
    else:
        body = api.text_completion_choices(rid, created, job.model, outs, usage, lps)
    await w.reply(200, _encode(body), JSON)
