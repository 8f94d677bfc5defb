"""AdmissionQueue: where a request waits when no worker (or PD pair) can take it (ARCHITECTURE.md,
"Backpressure accounting").

The queue is bounded (`max_size`) and FIFO; each waiter has a deadline. Placing a request is the
pool's job (`place`: pick the workers and start the request on them, or None when all are full);
the queue calls it at once when nobody is waiting, and again for the head of the line each time
`wake()` says capacity may have freed. A request that finds the queue full, or whose deadline
passes, gets Unavailable (HTTP 503 with Retry-After) at once. A waiter that is cancelled (its client
went away) leaves the queue; if it was placed in the same instant, `release` undoes the placement.
Its metrics (queue length, refusals by reason, wait time) live in the registry it is given.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from tandem.runtime import errors
from tandem.runtime.metrics import Registry

R = TypeVar("R")  # what waits: the request
P = TypeVar("P")  # what placing it yields: the started stream

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                      60.0, 120.0)


class _Waiter(Generic[R, P]):
    __slots__ = ("request", "future")

    def __init__(self, request: R, future: asyncio.Future[P]) -> None:
        self.request = request
        self.future = future


class AdmissionQueue(Generic[R, P]):
    def __init__(self, place: Callable[[R], P | None], release: Callable[[P], None],
                 max_size: int, timeout_s: float, retry_after_s: float,
                 registry: Registry | None = None) -> None:
        self._place = place
        self._release = release
        self.max_size = max_size
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._waiters: deque[_Waiter[R, P]] = deque()
        self._waking = False
        self._again = False
        r = registry if registry is not None else Registry()
        r.callback("tandem_router_queued_requests", "Requests waiting in the router for a worker.",
                   lambda: [((), len(self._waiters))])
        self.rejected = r.counter("tandem_router_rejected_requests_total",
                                  "Requests the router refused with 503, by reason.", ["reason"])
        self.wait = r.histogram("tandem_router_queue_wait_seconds",
                                "Seconds a request waited in the router before a worker took it.",
                                buckets=QUEUE_WAIT_BUCKETS)
        self._full = self.rejected.labels("queue_full")
        self._timeout = self.rejected.labels("queue_timeout")

    def __len__(self) -> int:
        return len(self._waiters)

    async def admit(self, request: R) -> P:
        """Place `request` now, or wait in line for capacity until the deadline (Unavailable)."""
        t0 = time.monotonic()
        placed = self.try_admit(request)
        if placed is not None:
            return placed
        if len(self._waiters) >= self.max_size:
            self._full.inc()
            raise errors.Unavailable(
                f"the server is overloaded: {len(self._waiters)} requests are already waiting",
                retry_after=self.retry_after_s)
        loop = asyncio.get_running_loop()
        w: _Waiter[R, P] = _Waiter(request, loop.create_future())
        self._waiters.append(w)
        timer = loop.call_later(self.timeout_s, self._expire, w)
        try:
            placed = await w.future
        except asyncio.CancelledError:
            f = w.future
            if f.done() and not f.cancelled() and f.exception() is None:
                self._release(f.result())  # placed, but its client is gone
            raise
        finally:
            timer.cancel()
            if w in self._waiters:  # cancelled while waiting
                self._waiters.remove(w)
        self.wait.observe(time.monotonic() - t0)
        return placed

    def try_admit(self, request: R) -> P | None:
        """Place `request` now if nobody waits in line and a worker can take it (what `admit`
        does first); None: it was not placed, and nothing changed."""
        if self._waiters:
            return None
        placed = self._place(request)
        if placed is not None:
            self.wait.observe(0.0)
        return placed

    def wake(self) -> None:
        """Capacity may have freed: place waiters in arrival order until one does not fit."""
        if not self._waiters:
            return
        if self._waking:  # called from inside place/release: the running loop below goes on
            self._again = True
            return
        self._waking = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._drain()
        finally:
            self._waking = False

    def _drain(self) -> None:
        while self._waiters:
            w = self._waiters[0]
            if w.future.done():  # cancelled or expired, not yet removed by its owner
                self._waiters.popleft()
                continue
            try:
                placed = self._place(w.request)
            except errors.TandemError as e:  # e.g. the chosen worker stopped taking messages
                self._waiters.popleft()
                w.future.set_exception(e)
                continue
            if placed is None:
                return
            self._waiters.popleft()
            w.future.set_result(placed)

    def fail_all(self, err: errors.TandemError, reason: str = "no_worker") -> None:
        """Fail every waiter now: no worker is usable any more, or the frontend is stopping."""
        waiters, self._waiters = self._waiters, deque()
        rejected = self.rejected.labels(reason)
        for w in waiters:
            if not w.future.done():
                rejected.inc()
                w.future.set_exception(err)

    def _expire(self, w: _Waiter[R, P]) -> None:
        if w.future.done():
            return
        self._timeout.inc()
        w.future.set_exception(errors.Unavailable(
            f"no worker could take the request within {self.timeout_s:g}s",
            retry_after=self.retry_after_s))
        try:
            self._waiters.remove(w)
        except ValueError:
            pass
