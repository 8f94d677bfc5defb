"""The engine contract every engine implements (DESIGN §3, "Engine interface").

Lifecycle: `start()` once, then any number of concurrent `generate()` calls, `abort(rid)` at any
time, `load()` for the router, and `shutdown()` (safe after a partial start and safe twice).

`generate(req)` is an async iterator of `EngineOutput`. Its `output_ids` are cumulative (all ids so
far) or incremental (only new ids) as the engine's `output_mode` declares. The last output carries a
`finish_reason`. If the consumer stops iterating early (aclose, cancellation), the engine frees the
request's pages as if `abort(rid)` had been called. A request the engine cannot take raises
`EngineRequestError` from the first `__anext__`, before any output.

Fast path (optional): `open_stream(req, sink)` delivers the same outputs by calling `sink.put(out)`
from the engine's own step on the event loop, with no task per request and no wakeup per output.
An engine without it returns None and the caller iterates `generate()`; with it, the engine raises
`EngineRequestError` at once for a request it cannot take, calls the sink only after
`open_stream` returned, ends with one `put` carrying a `finish_reason` or one `sink.fail(error)`,
and after `handle.cancel()` calls the sink no more and frees the request's pages as `abort` would.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from tandem.runtime.protocol import Bootstrap, FinishReason, Load, OutputMode, SamplingParams


class EngineError(Exception):
    """The engine failed; the request cannot go on."""


class EngineRequestError(EngineError):
    """The request itself is unacceptable (too long, bad params). Maps to HTTP 400."""


@dataclass(slots=True)
class EngineRequest:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    bootstrap: Bootstrap | None = None


@dataclass(slots=True)
class EngineOutput:
    output_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class ModelSpec:
    """What the rest of tandem needs to know about the loaded model."""

    name: str
    max_context: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    vocab_size: int = 0


class OutputSink(Protocol):
    """Where an engine's fast path delivers one request's outputs (on the event loop)."""

    def put(self, out: EngineOutput) -> None: ...

    def fail(self, err: EngineError) -> None: ...


class StreamHandle(Protocol):
    def cancel(self) -> None: ...


class Engine(abc.ABC):
    name: str = "base"
    output_mode: OutputMode = "cumulative"
    page_size: int = 16
    num_pages: int = 0
    spec: ModelSpec

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    def open_stream(self, req: EngineRequest, sink: OutputSink) -> StreamHandle | None:
        """The fast path (see the module docstring); None = not for this engine or request."""
        return None

    @abc.abstractmethod
    async def abort(self, rid: str) -> None: ...

    @abc.abstractmethod
    def load(self) -> Load: ...

    @abc.abstractmethod
    async def shutdown(self) -> None: ...
