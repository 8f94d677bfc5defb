"""One choice of a response, as the response loop (tandem.frontend.respond) feeds it.

`ChoiceSpec` and `GenerationJob` are a validated, tokenized request. `ChoiceState` is one choice's
state and nothing else: its detokenizer (stop strings included), the `stream_interval` decision,
its counts and its finish. It is pure: `feed(delta)` returns the SSE bytes to write now (none when
aggregated, or when the interval says wait), so it is tested without I/O. `RichChoiceState` is the
one a choice gets when its chunks carry more than text (logprobs, usage in every chunk);
`ToolCallState` the one whose output is a tool call (tandem.frontend.structured).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from tandem.frontend import openai_api as api
from tandem.frontend import schemas
from tandem.frontend import sse
from tandem.frontend.detokenizer import Detokenizer
from tandem.frontend.http import error_of
from tandem.frontend.structured import Constraint, call_head, parse_tool_call
from tandem.runtime.wire import Delta, SamplingParams, TokenLogprobs


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
    user: str = ""  # the request's `user` (a conversation key for the router, with no header)
    priority: int = 0  # lower first (vLLM's): its place in the queues
    cache_salt: str | None = None  # the client's `cache_salt` (checked; tandem.frontend.salt)
    constraint: Constraint | None = None  # its output's grammar; a tool call: ToolCallState
    # What the response loop reports back, for the access log:
    rid: str = ""
    completion_tokens: int = 0
    ttft: float | None = None

    @property
    def prompt_tokens(self) -> int:
        """Every prompt counted once, however many choices it has (as vLLM does)."""
        choices = self.choices
        if len(choices) == 1:  # (the usual request: once for metrics, usage and the access log)
            return len(choices[0].prompt_ids)
        seen = {c.prompt_index: len(c.prompt_ids) for c in choices}
        return sum(seen.values())

    def cached_tokens(self, states: Sequence[ChoiceState]) -> int:
        """The prompt tokens served from cache, every prompt counted once (its choices' most)."""
        if len(states) == 1:
            return states[0].cached
        most: dict[int, int] = {}
        for spec, st in zip(self.choices, states):
            most[spec.prompt_index] = max(most.get(spec.prompt_index, 0), st.cached)
        return sum(most.values())


class ChoiceState:
    """One choice's state. With an encoder it streams: `feed` returns the chunks to write now, the
    first text at once, then every `interval` tokens, always on the finish. Without one it only
    collects its text (`text`) for the aggregated body."""

    __slots__ = ("detok", "enc", "interval", "buf", "buf_tokens", "num_tokens", "num_chunks",
                 "finish", "sent", "head", "direct", "cached")

    def __init__(self, detok: Detokenizer, enc: sse.ChunkEncoder | None, interval: int,
                 role: bool = False, prefix: str = "") -> None:
        self.detok = detok
        self.enc = enc
        self.interval = interval
        self.buf: list[str] = [prefix] if prefix else []
        self.buf_tokens = 0
        self.num_tokens = 0  # the tokens the client is given: to a stop string's last one
        self.num_chunks = 0  # streamed chunks that carried text
        self.finish: str | None = None
        self.sent = False  # whether any text went out yet
        self.head = enc.role() if enc is not None and role else b""  # chat: the role chunk
        # Once the first text went out, a stream that sends every text at once and has no stop
        # strings turns each delta's text straight into a chunk: the detokenizer's own step.
        self.direct: Callable[[Sequence[int]], str] | None = None
        self.cached = 0  # prompt tokens the worker had cached (the first delta's usage says)

    def feed(self, d: Delta) -> bytes:
        """Take one (possibly merged) delta. Raises the request's error for an error delta (what
        is buffered stays for `flush`)."""
        ids = d.token_ids
        fin: str | None = d.finish_reason
        direct = self.direct
        if direct is not None and fin is None and ids:  # (see __init__: streamed, so enc)
            self.num_tokens += len(ids)
            text = direct(ids)
            if not text:
                return b""
            self.num_chunks += 1
            return self.enc.text(text)  # type: ignore[union-attr]
        self.num_tokens += len(ids)
        self.buf_tokens += len(ids)
        if d.usage is not None:
            self.cached = d.usage.cached_tokens
        if fin == "error":
            raise error_of(d)
        detok = self.detok
        text = detok.step(ids, fin is not None)
        if text:
            self.buf.append(text)
        if detok.stopped:
            fin = "stop"
            after = len(ids) - detok.used
            if after:  # tokens past the stop string's end: never given, never counted
                self.num_tokens -= after
                self.buf_tokens -= after
                self.cut(after)
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
            if self.interval <= 1:
                self.direct = detok.direct
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

    def cut(self, n: int) -> None:
        """The last `n` tokens fed came after a stop string: forget what was kept of them."""


class RichChoiceState(ChoiceState):
    """A choice whose response carries more than text: its tokens' logprobs (streamed with the
    chunk that carries them, or all in the body) and/or the usage so far in every chunk."""

    __slots__ = ("kind", "token", "want_logprobs", "lps", "offset", "prompt_tokens", "continuous",
                 "json", "__weakref__")

    def __init__(self, job: GenerationJob, spec: ChoiceSpec, index: int, rid: str,
                 created: int) -> None:
        # The encoder asks this state for each chunk's extras through a weak proxy: no reference
        # cycle, so a finished request is freed at once, not by the garbage collector.
        enc = sse.RichChunkEncoder(job.kind, rid, created, job.model, index, weakref.proxy(self)) \
            if job.stream else None
        super().__init__(spec.detokenizer, enc, job.interval, job.kind == "chat", spec.echo)
        self.kind = job.kind
        self.token = job.token
        self.want_logprobs = job.logprobs is not None and job.token is not None
        self.lps: list[TokenLogprobs] = []  # not sent (streamed) or rendered (aggregated) yet
        self.offset = len(spec.echo)
        self.prompt_tokens = len(spec.prompt_ids)
        self.continuous = job.continuous_usage
        # Aggregated: the body's logprobs, rendered as each delta is fed (its tokens past a stop
        # string cut first), not all at the end.
        self.json: api.LogprobsJson | None = None
        if self.want_logprobs and not job.stream:
            self.json = api.LogprobsJson(schemas.ChatLogprobs([]) if job.kind == "chat"
                                         else schemas.CompletionLogprobs([], [], [], []))

    def feed(self, d: Delta) -> bytes:
        if self.want_logprobs and d.logprobs:
            self.lps += d.logprobs
        out = ChoiceState.feed(self, d)
        if self.json is not None and self.lps:
            self.json.add(self.take_logprobs())
        return out

    def cut(self, n: int) -> None:
        if self.want_logprobs and self.lps:
            del self.lps[max(0, len(self.lps) - n):]

    def take_logprobs(self) -> schemas.ChatLogprobs | schemas.CompletionLogprobs | None:
        if not self.want_logprobs or self.token is None:
            return None
        lps, self.lps = self.lps, []
        if self.kind == "chat":
            return api.chat_logprobs(lps, self.token)
        out = api.completion_logprobs(lps, self.token, self.offset)
        if out.tokens:
            self.offset = out.text_offset[-1] + len(out.tokens[-1])
        return out

    def body_logprobs(self) -> msgspec.Raw | None:
        """The logprobs of an aggregated response's choice, as its body's JSON (once, at the
        end); None when the request asked for none."""
        if self.json is None:
            return None
        if self.lps:
            self.json.add(self.take_logprobs())
        return self.json.raw()

    def usage_now(self) -> schemas.UsageInfo | None:
        return api.usage_info(self.prompt_tokens, self.num_tokens, self.cached) \
            if self.continuous else None


class ToolCallState(ChoiceState):
    """A choice whose output is a tool call, `{"name": ..., "arguments": {...}}` as its grammar
    makes it, which becomes the message's `tool_calls`, finish_reason "tool_calls". Streamed: the
    role chunk, then once the name is written a `delta.tool_calls` chunk with the call's id and
    name, then its arguments' JSON as it comes (the last character held back: it may be the
    wrapper's closing brace). An output cut short (max_tokens, a stop string) is no call: before
    its name it goes out as content, after it as the arguments so far; either way with its own
    finish reason."""

    __slots__ = ("calls", "call_id", "args_at", "args_sent")

    def __init__(self, detok: Detokenizer, enc: sse.ChunkEncoder | None) -> None:
        super().__init__(detok, None, 1, False)
        self.head = enc.role() if enc is not None else b""
        self.calls: list[schemas.ToolCall] | None = None
        self.enc = enc
        self.call_id = api.new_id("call_")
        self.args_at = -1  # where the arguments start in the text, once the name was streamed
        self.args_sent = 0  # characters of the arguments streamed

    def feed(self, d: Delta) -> bytes:
        enc, self.enc = self.enc, None  # (collect only)
        try:
            ChoiceState.feed(self, d)
        finally:
            self.enc = enc
        out, self.head = self.head, b""
        text = self.text
        if self.finish is not None:
            call = parse_tool_call(text) if self.finish == "stop" else None
            if call is not None:
                self.calls = [schemas.ToolCall(self.call_id, "function",
                                               schemas.FunctionCall(*call))]
                self.finish = "tool_calls"
            if enc is None:
                return b""
            if self.args_at < 0 and call is None:  # (no call began: the text is content)
                return out + (enc.text(text, self.finish) if text else enc.finish(self.finish))
            if self.args_at < 0:
                out += enc.tool_call("", self.call_id, call[0])  # type: ignore[index]
            rest = call[1][self.args_sent:] if call is not None else \
                text[self.args_at + self.args_sent:]
            return out + (enc.tool_call(rest) if rest else b"") + enc.finish(self.finish)
        if enc is None:
            return b""
        if self.args_at < 0:
            head = call_head(text)
            if head is None:
                return out
            self.args_at = head[1]
            out += enc.tool_call("", self.call_id, head[0])
        new = text[self.args_at + self.args_sent:-1]
        if new:
            self.args_sent += len(new)
            out += enc.tool_call(new)
        return out


def state_of(job: GenerationJob, spec: ChoiceSpec, index: int, rid: str,
           created: int) -> ChoiceState:
    if job.constraint is not None and job.constraint.tool_call:
        return ToolCallState(spec.detokenizer, sse.ChunkEncoder(job.kind, rid, created, job.model,
                                                                index) if job.stream else None)
    if job.continuous_usage or job.logprobs is not None:
        return RichChoiceState(job, spec, index, rid, created)
    enc = sse.ChunkEncoder(job.kind, rid, created, job.model, index) if job.stream else None
    return ChoiceState(spec.detokenizer, enc, job.interval, job.kind == "chat", spec.echo)
