"""AdmissionQueue: where a request waits when no worker (or PD pair) can take it (ARCHITECTURE.md,
"Backpressure accounting").

The queue is bounded (`max_size`); each waiter has a deadline. Placing a request is the pool's job
(`place`: pick the workers and start the request on them, or None when all are full); the queue
calls it at once when nobody is waiting, and again for the head of the line each time `wake()`
says capacity may have freed, and for a newcomer that goes to the head of the line at once. The
head of the line is the waiter with the lowest `priority` (vLLM's convention), then of a tenant
with nothing in flight (`busy`; each worker keeps a place for such a tenant while tenants share:
tandem.router.accounting), then of the tenant placed least recently (each freed place goes to
the tenants in turn, however many requests each sent), then the first to arrive.

A tenant may hold its share of the queue, `max_size` divided by the tenants waiting: a request
that would take more gets Unavailable (503, Retry-After, reason `tenant_over_share`) at once,
and one that finds the queue full while under its share takes the place of the last waiter of
the tenant most over its share (which gets that 503). A request that finds the queue full
otherwise, or whose deadline passes, gets Unavailable (HTTP 503 with Retry-After) at once. A
waiter that is cancelled (its client went away) leaves the queue; if it was placed in the same
instant, `release` undoes the placement.
Its metrics (queue length, refusals by reason, wait time) live in the registry it is given.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from tandem.runtime import errors
from tandem.runtime.metrics import Registry

R = TypeVar("R")  # what waits: the request
P = TypeVar("P")  # what placing it yields: the started stream

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                      60.0, 120.0)


class _Waiter(Generic[R, P]):
    __slots__ = ("request", "future", "tenant", "key")

    def __init__(self, request: R, future: asyncio.Future[P], tenant: str,
                 key: tuple[int, int]) -> None:
        self.request = request
        self.future = future
        self.tenant = tenant
        self.key = key  # (priority, arrival): its place among its tenant's


class AdmissionQueue(Generic[R, P]):
    def __init__(self, place: Callable[[R], P | None], release: Callable[[P], None],
                 max_size: int, timeout_s: float, retry_after_s: float,
                 registry: Registry | None = None,
                 who: Callable[[R], tuple[str, int]] = lambda r: ("", 0),
                 busy: Callable[[str], bool] = lambda tenant: False) -> None:
        self._place = place
        self._release = release
        self._who = who  # a request's (tenant, priority)
        self._busy = busy  # whether a tenant has requests in flight
        self.max_size = max_size
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._tenants: dict[str, list[_Waiter[R, P]]] = {}  # each tenant's waiters, by key
        self._n = 0
        self._arrivals = itertools.count()
        self._placed: dict[str, int] = {}  # when each tenant was last placed (a count)
        self._placings = itertools.count(1)
        self._waking = False
        self._again = False
        r = registry if registry is not None else Registry()
        r.callback("tandem_router_queued_requests", "Requests waiting in the router for a worker.",
                   lambda: [((), self._n)])
        self.rejected = r.counter("tandem_router_rejected_requests_total",
                                  "Requests the router refused with 503, by reason.", ["reason"])
        self.wait = r.histogram("tandem_router_queue_wait_seconds",
                                "Seconds a request waited in the router before a worker took it.",
                                buckets=QUEUE_WAIT_BUCKETS)
        self._full = self.rejected.labels("queue_full")
        self._timeout = self.rejected.labels("queue_timeout")
        self._over = self.rejected.labels("tenant_over_share")

    def __len__(self) -> int:
        return self._n

    async def admit(self, request: R) -> P:
        """Place `request` now, or wait in line for capacity until the deadline (Unavailable)."""
        t0 = time.monotonic()
        placed = self.try_admit(request)
        if placed is not None:
            return placed
        tenant, priority = self._who(request)
        self._make_room(tenant)
        loop = asyncio.get_running_loop()
        w: _Waiter[R, P] = _Waiter(request, loop.create_future(), tenant,
                                   (priority, next(self._arrivals)))
        line = self._tenants.setdefault(tenant, [])
        line.append(w)
        line.sort(key=lambda x: x.key)
        self._n += 1
        if self._n > 1 and self._head() is w:  # first in line before others (try_admit tried
            self.wake()  # it when it was alone): placed now if it fits, a place kept for it
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
            self._remove(w)  # (cancelled while waiting; a no-op once placed or refused)
        self.wait.observe(time.monotonic() - t0)
        return placed

    def _make_room(self, tenant: str) -> None:
        """Refuse a request over its tenant's share, or the queue full; or make room for it."""
        others = len(self._tenants) - (tenant in self._tenants)
        share = max(1, self.max_size // (others + 1))
        mine = len(self._tenants.get(tenant, ()))
        if others and mine >= share:
            self._over.inc()
            raise errors.Unavailable(
                f"the server is overloaded and this client has {mine} requests waiting, its "
                f"share of the queue while {others + 1} clients wait; retry later",
                retry_after=self.retry_after_s)
        if self._n < self.max_size:
            return
        most = max((t for t in self._tenants if t != tenant),
                   key=lambda t: len(self._tenants[t]), default=None)
        if most is None or len(self._tenants[most]) <= share:
            self._full.inc()
            raise errors.Unavailable(
                f"the server is overloaded: {self._n} requests are already waiting",
                retry_after=self.retry_after_s)
        last = self._tenants[most][-1]  # (its lowest priority, latest)
        self._remove(last)
        self._over.inc()
        last.future.set_exception(errors.Unavailable(
            f"the server is overloaded and this client had more than its share of the queue "
            f"({share} places while {others + 1} clients wait); retry later",
            retry_after=self.retry_after_s))

    def _remove(self, w: _Waiter[R, P]) -> None:
        line = self._tenants.get(w.tenant)
        if line is None or w not in line:
            return
        line.remove(w)
        self._n -= 1
        if not line:
            del self._tenants[w.tenant]

    def _head(self) -> _Waiter[R, P] | None:
        tenants, placed = self._tenants, self._placed
        if not tenants:
            return None
        if len(tenants) == 1:
            return next(iter(tenants.values()))[0]
        busy = self._busy
        t = min(tenants, key=lambda t: (tenants[t][0].key[0], busy(t), placed.get(t, 0),
                                        tenants[t][0].key[1]))
        return tenants[t][0]

    def try_admit(self, request: R) -> P | None:
        """Place `request` now if nobody waits in line and a worker can take it (what `admit`
        does first); None: it was not placed, and nothing changed."""
        if self._n:
            return None
        placed = self._place(request)
        if placed is not None:
            self.wait.observe(0.0)
            self._placed[self._who(request)[0]] = next(self._placings)
        return placed

    def wake(self) -> None:
        """Capacity may have freed: place waiters, head of the line first, until one does not
        fit."""
        if not self._n:
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
        while (w := self._head()) is not None:
            if w.future.done():  # cancelled or expired, not yet removed by its owner
                self._remove(w)
                continue
            try:
                placed = self._place(w.request)
            except errors.TandemError as e:  # e.g. the chosen worker stopped taking messages
                self._remove(w)
                w.future.set_exception(e)
                continue
            if placed is None:
                return
            self._remove(w)
            self._placed[w.tenant] = next(self._placings)
            w.future.set_result(placed)

    def fail_all(self, err: errors.TandemError, reason: str = "no_worker") -> None:
        """Fail every waiter now: no worker is usable any more, or the frontend is stopping."""
        lines, self._tenants, self._n = self._tenants, {}, 0
        rejected = self.rejected.labels(reason)
        for line in lines.values():
            for w in line:
                if not w.future.done():
                    rejected.inc()
                    w.future.set_exception(err)

    def _expire(self, w: _Waiter[R, P]) -> None:
        if w.future.done():
            return
        self._timeout.inc()
        self._remove(w)
        w.future.set_exception(errors.Unavailable(
            f"no worker could take the request within {self.timeout_s:g}s",
            retry_after=self.retry_after_s))
