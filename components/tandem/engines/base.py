"""The one engine contract every engine implements (ARCHITECTURE.md, "Engine contract").

Lifecycle: `start()` once; then any number of `submit(request, sink)` calls, each returning a
`Handle`; `load()` for the router at any time; `shutdown()` at the end (safe after a partial or
failed start, and safe twice).

`submit(req, sink)`:
- raises `EngineRequestError` at once for a request the engine cannot take (too long, bad
  parameters, a role that needs a bootstrap and got none), and `EngineError` when it cannot take
  work at all (not started, shut down); in both cases it holds nothing for the request;
- otherwise returns a `Handle` and later delivers the request's outputs by calling
  `sink.on_step(outputs)` on the event loop thread, from the engine's own step: ONE call per engine
  step with every output of that step (of every request submitted with that sink), never a task or
  a wakeup per request per token. It never calls the sink before `submit` has returned.
- Each `EngineOutput` names its request (`rid`) and carries `output_ids`, cumulative (all ids so
  far) or incremental (only the new ids) as the engine's `output_mode` declares, and the counts;
  for a request with `sampling.logprobs` set, `logprobs` too, one per id, in the same mode.
  Cumulative lists may be the engine's live ones (a consumer bounds them by `completion_tokens`);
  incremental lists are the consumer's, the engine never touches them again. tandem's own engines
  are incremental by default (a step holds just the new token), SGLang cumulative (its default).
  A request's last output has a `finish_reason`; a request that fails after submission ends with
  one output whose `finish_reason` is "error" and whose `error` says why (an EngineError, or an
  EngineRequestError when the request turned out to be unacceptable). Nothing follows the last
  output.

`handle.cancel()` ends a request: no output for it reaches the sink after the call, and its pages
come back (at once, or, for pages a KV transfer may still write into, as soon as that is safe).
Cancelling a finished or already cancelled request does nothing. It is the one way to end a
request early; there is no `abort(rid)`.

A request may carry `bootstrap = (host, port, room)` (disaggregated prefill/decode). The engine
does the KV handoff itself, so the worker never touches KV: tandem's own engines through the one
handoff state machine in `tandem.engines.handoff`, SGLang through its own bootstrap server. A prefill
engine's request ends (finish_reason "length", one output) once its KV has been written; a decode
engine's outputs start with the first token the prefill side sampled. A prefill engine announces
where decode engines reach it in `bootstrap_addr` (set by `start()`).

An engine whose library only yields outputs per request (SGLang's `async_generate`) sits behind
`tandem.engines.iterator.IteratorEngine`, which turns per-request iterators into `on_step` calls
with a task per request. Outputs of tandem's own engines need none; only their PD handoff runs a
task per request beside the steps, for its KV transfer (tandem.engines.handoff).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from tandem.runtime.errors import EngineError, EngineRequestError
from tandem.runtime.kv_events import KvEvent
from tandem.runtime.wire import (
    Bootstrap, FinishReason, Load, OutputMode, SamplingParams, TokenLogprobs,
)

__all__ = [
    "Engine", "EngineError", "EngineOutput", "EngineRequest", "EngineRequestError", "Handle",
    "ModelSpec", "OutputSink",
]


@dataclass(slots=True)
class EngineRequest:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    bootstrap: Bootstrap | None = None
    # A request moved from a lost worker: the last `resume_offset` prompt ids are completion
    # tokens an earlier leg already produced. Positions (seeded draws, min_tokens) and penalties
    # count them as output, so the continuation is what an unbroken run would have produced.
    resume_offset: int = 0
    tenant: str = ""  # who sent it (wire.Generate): the engine's fair order across clients
    priority: int = 0  # lower first (vLLM's convention)
    cache_salt: str = ""  # its prefix cache partition (tandem.engines.prefix.salt_root)


class EngineOutput(msgspec.Struct):
    """(A Struct, not a dataclass: one is made per token, and a Struct is made in C.)"""

    rid: str
    output_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: EngineError | None = None  # with finish_reason "error"
    # When the request asked for logprobs: one per output id, cumulative or incremental as
    # `output_ids` are (the wire's TokenLogprobs: the model's own distribution, see wire.py).
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class ModelSpec:
    """What the rest of tandem needs to know about the loaded model."""

    name: str
    max_context: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    vocab_size: int = 0


class OutputSink(Protocol):
    """Where an engine delivers outputs: once per engine step, on the event loop thread."""

    def on_step(self, outputs: list[EngineOutput]) -> None: ...


class Handle(Protocol):
    def cancel(self) -> None: ...


class Engine(abc.ABC):
    name: str = "base"
    output_mode: OutputMode = "cumulative"
    page_size: int = 0
    num_pages: int = 0
    bootstrap_addr: str = ""  # prefill role: where decode engines reach this engine's KV handoff
    # Where an engine with a prefix cache (tandem's own) hands the KV events of each step that made
    # some (BlockStored, BlockRemoved), once per step, on the event loop; the
    # worker sets it to its publisher's `publish` (tandem.worker.kv_events) when events are on.
    on_kv_events: Callable[[list[KvEvent]], None] | None = None
    spec: ModelSpec

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    def submit(self, req: EngineRequest, sink: OutputSink) -> Handle: ...

    @abc.abstractmethod
    def load(self) -> Load: ...

    @abc.abstractmethod
    async def shutdown(self) -> None: ...
