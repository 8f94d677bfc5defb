"""RequestHandle: one request as the frontend holds it, whether one worker serves it (aggregated:
one leg) or two at once (disaggregated: a prefill leg and a decode leg, the same `Generate` with
`bootstrap` sent to both).

The handle owns the request's one `DeltaCollector`: only the reading leg's deltas (the agg or
decode worker's) reach it. Each leg checks its worker's offsets (a gap or an overlap fails the
request with StreamProtocolError and is counted on the link). A worker's error delta reaches the
reader as it is: its `ErrorKind` is mapped to an HTTP status by the frontend alone. When either leg
fails — a prefill error, a lost worker, a refused delta — the request fails through the collector
and every other unfinished leg is aborted at once. Leaving the handle (`async with`) aborts every
leg that has not finished, so a client that goes away frees its pages on every worker.

Entering waits for placement (the pool's admission queue); placement itself is synchronous
(`start`), so the router places a request in one step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tandem.router.accounting import Share
from tandem.runtime import errors
from tandem.runtime.collector import DeltaCollector
from tandem.runtime.wire import Bootstrap, Delta, ErrorKind, Generate, SamplingParams

if TYPE_CHECKING:
    from tandem.router.link import WorkerLink


class Leg(Share):
    """The request on one worker. `reads`: its deltas are the client's (agg or decode)."""

    __slots__ = ("handle", "link", "rid", "reads", "received", "finished", "over")

    def __init__(self, handle: RequestHandle, link: WorkerLink, reads: bool) -> None:
        super().__init__()
        self.handle = handle
        self.link = link
        self.rid = handle.rid
        self.reads = reads
        self.received = 0
        self.finished = False  # the worker sent the last delta: nothing to abort
        self.over = False  # no more deltas are taken (finished, or failed)

    def on_delta(self, d: Delta) -> bool:
        """Take one delta from the link; True when it was the leg's last (the worker ended it)."""
        if self.over:
            return False
        if d.offset != self.received:
            self.over = True  # unfinished: it is aborted on the worker
            self.link.protocol_errors += 1
            self.handle.leg_failed(self, errors.StreamProtocolError(
                f"delta for {self.rid} at offset {d.offset}, expected {self.received}"))
            return False
        self.received += len(d.token_ids)
        fin = d.finish_reason
        if fin is not None:
            self.over = self.finished = True
        if self.reads:
            self.handle.collector.put(d)
        elif fin == "error":
            self.handle.prefill_failed(d)
        return fin is not None

    def on_lost(self, err: errors.TandemError) -> None:
        """The link dropped the leg (worker lost, or the request could not be sent)."""
        if not self.over:
            self.over = True
            self.handle.leg_failed(self, err)


class RequestHandle:
    __slots__ = ("rid", "prompt_ids", "sampling", "collector", "legs", "_admit", "_ended")

    def __init__(self, rid: str, prompt_ids: list[int], sampling: SamplingParams,
                 admit: Callable[[RequestHandle], Awaitable[Any]]) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.collector = DeltaCollector()
        self.legs: tuple[Leg, ...] = ()
        self._admit = admit
        self._ended = False  # iteration returned the last delta

    @property
    def received(self) -> int:
        """Completion tokens the client's leg received."""
        return self.legs[0].received if self.legs else 0

    @property
    def placed(self) -> bool:
        return bool(self.legs)

    @property
    def workers(self) -> tuple[str, ...]:
        """The addresses of the workers serving it: (reader,) or (decode, prefill)."""
        return tuple(leg.link.address for leg in self.legs)

    async def __aenter__(self) -> RequestHandle:
        if not self.legs:
            await self._admit(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Delta:
        """The client's deltas, merged while the reader lags, the last one included (an error
        delta too: its kind is for the caller to map); a router failure is raised."""
        if self._ended:
            raise StopAsyncIteration
        d = await self.collector.get()
        if d.finish_reason is not None:
            self._ended = True
        return d

    def start(self, reader: WorkerLink, prefill: WorkerLink | None = None,
              bootstrap: Bootstrap | None = None) -> None:
        """Place the request: on `reader` alone, or on `reader` (decode) and `prefill` with
        `bootstrap`. Synchronous; if the second leg cannot start the first is undone."""
        msg = Generate(self.rid, self.prompt_ids, self.sampling, bootstrap)
        first = Leg(self, reader, reads=True)
        reader.start(first, msg)
        if prefill is None:
            self.legs = (first,)
            return
        second = Leg(self, prefill, reads=False)
        try:
            prefill.start(second, msg)
        except BaseException:
            reader.end(first, abort=True)
            raise
        self.legs = (first, second)

    def release(self) -> None:
        """Abort every leg that has not finished. Safe twice."""
        for leg in self.legs:  # (kept afterwards, for `received` and `workers`)
            if not leg.finished:
                leg.over = True
                leg.link.end(leg, abort=True)

    def leg_failed(self, leg: Leg, err: errors.TandemError) -> None:
        if not leg.reads:
            err = type(err)(f"prefill failed: {err.message}", retry_after=err.retry_after)
        self.collector.fail(err)
        self._abort_others(leg)

    def prefill_failed(self, d: Delta) -> None:
        """The prefill worker ended the request with an error: the client sees it, with its
        kind, as if the decode worker had sent it; the decode leg is aborted."""
        reader = self.legs[0] if self.legs else None
        if reader is None or reader.over:
            return
        self.collector.put(Delta(self.rid, reader.received, [], "error", None,
                                 f"prefill failed: {d.error or 'the engine failed'}",
                                 d.error_kind or ErrorKind.ENGINE))
        self._abort_others(None)

    def _abort_others(self, failed: Leg | None) -> None:
        for leg in self.legs:
            if leg is not failed and not leg.over:
                leg.over = True
                leg.link.end(leg, abort=True)
