"""IteratorEngine: the one adapter from per-request async iterators to the engine contract.

A library that only yields outputs per request (SGLang's `async_generate`) is wrapped by a subclass
that implements `_stream(req)`: an async iterator of the request's `EngineOutput`s, whose last one
has a finish_reason. This module owns everything else, and is the only place in tandem where a task
per request delivers outputs (the PD handoff of tandem's own engines has a task per request for its
KV transfer, tandem.engines.handoff; outputs never wait on it):

- `submit` runs the subclass's `_check(req)` (it raises `EngineRequestError` for a request the
  engine cannot take, holding nothing), then starts ONE task for the request. The engine owns the
  task: `handle.cancel()` cancels it and `shutdown()` cancels and awaits every task still alive.
- Outputs are gathered per sink and delivered at the end of the event-loop pass in which they were
  produced (one `loop.call_soon`), so each sink gets ONE `on_step` call per pass with every output
  of that pass, and never before `submit` has returned.
- An exception from the iterator ends the request with one output whose finish_reason is "error".
  Raised before the first output (SGLang raises its validation errors from the first `__anext__`),
  an error that `_refusal(exc)` classifies as the request's own fault becomes an
  `EngineRequestError` (the worker answers it as a bad request): `submit` cannot await, so this is
  how a late refusal reaches the caller. Any other exception becomes an `EngineError`.
- `handle.cancel()`: no output of the request reaches the sink after the call (outputs gathered but
  not yet delivered are dropped); the subclass frees the request in `_stream`'s `finally` (the task
  is cancelled there).
- `shutdown()` ends every live request with an "abort" output, delivered before it returns.
- `fail_all(error)` ends every live request with an "error" output (e.g. the library's process
  died) and refuses new work.

The "error" output keeps the count already delivered (`completion_tokens`) and, in cumulative mode,
the ids delivered so far, so a consumer slicing by count sees no new token and no gap.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator

from tandem.engines.base import (
    Engine, EngineError, EngineOutput, EngineRequest, EngineRequestError, OutputSink,
)
from tandem.runtime.passes import PassBatcher
from tandem.runtime.wire import FinishReason, Load

log = logging.getLogger("tandem.engines.iterator")

__all__ = ["IteratorEngine", "IteratorHandle"]


class IteratorHandle:
    """One submitted request: its sink, its task, and what it delivered so far."""

    __slots__ = ("rid", "sink", "task", "done", "completion_tokens", "last_ids", "prompt_tokens",
                 "pages", "_engine")

    def __init__(self, engine: IteratorEngine, rid: str, sink: OutputSink,
                 prompt_tokens: int) -> None:
        self._engine = engine
        self.rid = rid
        self.sink = sink
        self.prompt_tokens = prompt_tokens
        self.pages = 0  # pages its tokens fill, once it has produced output (0: still waiting)
        self.task: asyncio.Task[None] | None = None
        self.done = False  # a last output was delivered (or dropped by cancel): nothing follows
        self.completion_tokens = 0
        self.last_ids: list[int] = []

    def cancel(self) -> None:
        self._engine._cancel(self)


class IteratorEngine(Engine, abc.ABC):
    """Subclasses implement `start`, `_stream`, and may override `_check`, `_refusal`, `load` and
    `shutdown` (calling `super().shutdown()` first)."""

    def __init__(self) -> None:
        self._live: dict[str, IteratorHandle] = {}  # rid -> handle, until its task ends
        self._tasks: set[asyncio.Task[None]] = set()  # every task not yet finished
        # This loop pass's outputs: each sink gets its own in one on_step at the pass's end.
        self._pending: PassBatcher[tuple[IteratorHandle, EngineOutput]] = PassBatcher(self._flush)
        self._closed_reason = ""  # non-empty: submit raises EngineError with it
        self._started = False
        self._running = 0  # live requests that produced output (the rest wait)
        self._pages_held = 0  # pages the running requests' tokens fill

    # --- what a subclass provides ----------------------------------------------------------------

    @abc.abstractmethod
    def _stream(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The request's outputs; the last has a finish_reason. Cancelled when the request is."""

    def _check(self, req: EngineRequest) -> None:
        """Raise EngineRequestError for a request the engine cannot take (called by submit)."""

    def _refusal(self, exc: BaseException) -> EngineRequestError | None:
        """An exception raised before the first output that is the request's own fault, as the
        refusal to deliver; None for an engine failure."""
        if isinstance(exc, EngineRequestError):
            return exc
        if isinstance(exc, (ValueError, TypeError)):
            return EngineRequestError(str(exc) or type(exc).__name__)
        return None

    # --- the contract ----------------------------------------------------------------------------

    def _mark_started(self) -> None:
        self._started = True

    def submit(self, req: EngineRequest, sink: OutputSink) -> IteratorHandle:
        if not self._started or self._closed_reason:
            raise EngineError(f"{self.name} engine takes no work: "
                              f"{self._closed_reason or 'not started'}")
        if req.rid in self._live:
            raise EngineRequestError(f"request id {req.rid!r} is already in flight")
        self._check(req)
        handle = IteratorHandle(self, req.rid, sink, len(req.prompt_ids))
        task = asyncio.get_running_loop().create_task(self._run(req, handle),
                                                      name=f"{self.name}:{req.rid}")
        handle.task = task
        self._live[req.rid] = handle
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle

    def load(self) -> Load:
        """What the adapter knows: a live request is running once it produced output and waiting
        before; a running request fills ceil((prompt + completion) / page_size) pages (the library
        may share prefix pages: an upper bound); `num_pages` 0 = the pool's size is unknown."""
        free = max(0, self.num_pages - self._pages_held) if self.num_pages else 0
        return Load(running=self._running, waiting=len(self._live) - self._running,
                    pages_free=free, pages_total=self.num_pages)

    @property
    def num_tasks(self) -> int:
        """Tasks not yet finished (one per request in flight): 0 when idle, or nothing leaked."""
        return len(self._tasks)

    @property
    def num_undelivered(self) -> int:
        """Outputs produced in this loop pass, delivered at its end."""
        return len(self._pending)

    async def shutdown(self) -> None:
        """End every live request with an "abort" output (delivered before this returns), cancel
        and await every task; refuse new work. Safe twice and after a partial start."""
        self._closed_reason = self._closed_reason or "shut down"
        for handle in list(self._live.values()):
            if not handle.done:
                self._emit(handle, self._final(handle, "abort", None))
            self._cancel_task(handle)
        self._pending.flush_now()
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def fail_all(self, error: EngineError) -> None:
        """End every live request with an "error" output carrying `error`, and refuse new work."""
        self._closed_reason = self._closed_reason or str(error)
        for handle in list(self._live.values()):
            if not handle.done:
                self._emit(handle, self._final(handle, "error", error))
            self._cancel_task(handle)

    # --- internals -------------------------------------------------------------------------------

    async def _run(self, req: EngineRequest, handle: IteratorHandle) -> None:
        first = True
        stream = self._stream(req)
        try:
            async for out in stream:
                first = False
                if handle.done:
                    break
                self._emit(handle, out)
                if out.finish_reason is not None:
                    break
            else:
                if not handle.done:
                    self._emit(handle, self._final(handle, "error", EngineError(
                        f"{req.rid}: the {self.name} engine ended the stream without a finish")))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not handle.done:
                refusal = self._refusal(e) if first else None
                if refusal is None:
                    log.warning("%s: %s engine failed the request: %r", req.rid, self.name, e)
                error = refusal if refusal is not None else (
                    e if isinstance(e, EngineError) else EngineError(f"{self.name} engine: {e!r}"))
                self._emit(handle, self._final(handle, "error", error))
        finally:
            if self._live.get(req.rid) is handle:
                del self._live[req.rid]
                self._set_pages(handle, None)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:  # a stream left early runs its cleanup now, not at GC
                await aclose()

    def _final(self, handle: IteratorHandle, finish: FinishReason,
               error: EngineError | None) -> EngineOutput:
        ids = handle.last_ids if self.output_mode == "cumulative" else []
        return EngineOutput(handle.rid, ids, finish, handle.prompt_tokens,
                            handle.completion_tokens, error=error)

    def _set_pages(self, handle: IteratorHandle, tokens: int | None) -> None:
        """Account a request's tokens (None: it left)."""
        if tokens is None:
            pages = 0
        else:
            pages = max(1, -(-tokens // self.page_size)) if self.page_size else 1
        self._running += (pages > 0) - (handle.pages > 0)
        self._pages_held += pages - handle.pages
        handle.pages = pages

    def _emit(self, handle: IteratorHandle, out: EngineOutput) -> None:
        self._set_pages(handle, handle.prompt_tokens + out.completion_tokens)
        handle.completion_tokens = out.completion_tokens
        if self.output_mode == "cumulative":
            handle.last_ids = out.output_ids
        if out.finish_reason is not None:
            handle.done = True
        self._pending.add((handle, out))

    def _flush(self, pending: list[tuple[IteratorHandle, EngineOutput]]) -> None:
        per_sink: dict[int, tuple[OutputSink, list[EngineOutput]]] = {}
        for handle, out in pending:
            batch = per_sink.get(id(handle.sink))
            if batch is None:
                per_sink[id(handle.sink)] = (handle.sink, [out])
            else:
                batch[1].append(out)
        for sink, outs in per_sink.values():
            try:
                sink.on_step(outs)
            except Exception:  # a sink's bug must not starve the other sinks
                log.exception("%s engine: a sink failed on_step", self.name)

    def _cancel(self, handle: IteratorHandle) -> None:
        if handle.done and handle.task is not None and handle.task.done():
            return
        handle.done = True
        self._pending.remove_if(lambda pair: pair[0] is handle)
        self._cancel_task(handle)

    def _cancel_task(self, handle: IteratorHandle) -> None:
        handle.done = True
        if handle.task is not None and not handle.task.done():
            handle.task.cancel()
