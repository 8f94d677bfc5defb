"""The engine contract every engine implements (DESIGN §3, "Engine interface").

Lifecycle: `start()` once, then any number of concurrent `generate()` calls, `abort(rid)` at any
time, `load()` for the router, and `shutdown()` (safe after a partial start and safe twice).

`generate(req)` is an async iterator of `EngineOutput`. Its `output_ids` are cumulative (all ids so
far) or incremental (only new ids) as the engine's `output_mode` declares. The last output carries a
`finish_reason`. If the consumer stops iterating early (aclose, cancellation), the engine frees the
request's pages as if `abort(rid)` had been called. A request the engine cannot take raises
`EngineRequestError` from the first `__anext__`, before any output.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

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

    @abc.abstractmethod
    async def abort(self, rid: str) -> None: ...

    @abc.abstractmethod
    def load(self) -> Load: ...

    @abc.abstractmethod
    async def shutdown(self) -> None: ...
