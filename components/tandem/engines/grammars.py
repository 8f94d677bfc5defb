"""Constrained output in tandem's own engines, the step loop's side of it (no torch here; the
reference engine's grammars are tandem.engines.reference.grammar, its compile processes
tandem.engines.reference.grammar_procs).

An engine's `constraint(request)` hook (tandem.engines.stepper) gives a request's grammar state:
None (unconstrained), a ready one, or `Deferred(compile)` when it must be compiled first. A
compile can take seconds on a schema of a few dozen characters (xgrammar 0.2.8: 1.3 s for the
pattern `(a|aa)*b{1,5000}`; a 22.6 KB nested schema 26 s), so it never runs on the event loop:
`Compiles` gives it one of `SLOTS` compile slots (a thread each, whose compile runs in a process
of its own that can be killed) and hands each result back to the loop, where the request then
enters the scheduler as any other does. A request cancelled while it compiles holds nothing: it
just never enters the scheduler.

No client can starve the others' grammars (tenants: the frontend's `Generate.tenant`):
- a compile runs at most `COMPILE_DEADLINE_S` on its slot: past it its process is killed, the
  slot is free at once, and the request fails with a 400 naming its grammar's field;
- slots go to tenants in turn (round-robin over the tenants that wait, each tenant's own in
  order), and one tenant runs at most `SLOTS - 1` compiles at once: a slot is always left for
  another tenant;
- a tenant has at most `MAX_PER_TENANT` compiles queued or running (past it: 503, busy), and a
  compile that waited `WAIT_DEADLINE_S` for a slot fails with a 503 (busy, retry), not a 400.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tandem.engines.sampling import grammar_param
from tandem.runtime.errors import EngineBusy, EngineError, EngineRequestError
from tandem.runtime.wire import SamplingParams

log = logging.getLogger("tandem.engine")

COMPILE_DEADLINE_S = 5.0  # a compile's time on its slot (then its process is killed)
WAIT_DEADLINE_S = 5.0  # a compile's time waiting for a slot (then: busy, 503)
SLOTS = 2  # compiles at once (a process each)
MAX_PER_TENANT = 4  # one tenant's compiles queued or running


@dataclass(slots=True)
class Deferred:
    """A grammar to compile off the event loop: `compile(deadline_s)` (on a slot's thread: the
    compile is stopped past `deadline_s`) returns its state or raises EngineRequestError; `param`
    is the field it came in."""

    compile: Callable[[float], Any]
    param: str


def refuse(p: SamplingParams, engine: str, why: str) -> None:
    """An engine that cannot constrain its output refuses a grammar, naming itself."""
    param = grammar_param(p)
    if param is not None:
        raise EngineRequestError(f"{param} (constrained output) is not supported by the {engine} "
                                 f"engine{why}", param=param)


@dataclass(slots=True, eq=False)
class _Job:
    key: Any
    job: Deferred
    tenant: str
    done: Callable[[Any], None]
    fail: Callable[[EngineError], None]
    timer: asyncio.TimerHandle | None = None
    running: bool = False


@dataclass(slots=True)
class _Tenant:
    waiting: deque[_Job] = field(default_factory=deque)
    running: int = 0
    served: int = -1  # when a slot last went to it (Compiles._served's count): least recent first


class Compiles:
    """The engine's compiles in flight, keyed by request (any hashable key: its Sequence), in
    fair order across tenants (see the module docstring)."""

    def __init__(self, deadline_s: float = COMPILE_DEADLINE_S, wait_s: float = WAIT_DEADLINE_S,
                 slots: int = SLOTS, per_tenant: int = MAX_PER_TENANT) -> None:
        self.deadline_s, self.wait_s = deadline_s, wait_s
        self.slots, self.per_tenant = slots, per_tenant
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[Any, _Job] = {}
        self._tenants: dict[str, _Tenant] = {}  # those with a compile queued or running
        self._served = 0  # slots given so far
        self._busy = 0  # slots running a compile
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, job: Deferred, done: Callable[[Any], None],
              fail: Callable[[EngineError], None], key: Any, tenant: str = "") -> None:
        """Queue `job` (on the loop): `done(grammar)` or `fail(error)` follows on the loop, once,
        unless `drop(key)` or `close()` comes first. EngineBusy at once when `tenant` has
        `per_tenant` compiles already."""
        self._loop = asyncio.get_running_loop()
        t = self._tenants.get(tenant)
        if t is not None and len(t.waiting) + t.running >= self.per_tenant:
            raise EngineBusy(f"{job.param}: this client has {self.per_tenant} grammars compiling "
                             "or waiting to compile on this worker already; retry when one "
                             "ends", param=job.param)
        if t is None:
            t = self._tenants[tenant] = _Tenant()
        j = _Job(key, job, tenant, done, fail)
        j.timer = self._loop.call_later(self.wait_s, self._waited_too_long, j)
        self._jobs[key] = j
        t.waiting.append(j)
        self._dispatch()

    def _dispatch(self) -> None:
        """Give free slots to waiting compiles: to the tenant served least recently first (round
        robin), each tenant's own in order; a tenant runs at most `slots - 1` at once, so one is
        left for another."""
        cap = max(1, self.slots - 1)
        while self._busy < self.slots:
            ready = [t for t in self._tenants.values() if t.waiting and t.running < cap]
            if not ready:
                return
            t = min(ready, key=lambda t: t.served)
            t.served, self._served = self._served, self._served + 1
            self._run(t.waiting.popleft(), t)

    def _run(self, j: _Job, t: _Tenant) -> None:
        assert self._loop is not None
        if j.timer is not None:
            j.timer.cancel()
        j.running, self._busy = True, self._busy + 1
        t.running += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.slots, thread_name_prefix="tandem-grammar")
        loop = self._loop

        def back(fut: Future[Any]) -> None:
            try:
                loop.call_soon_threadsafe(self._result, j, fut)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        self._pool.submit(j.job.compile, self.deadline_s).add_done_callback(back)

    def _result(self, j: _Job, fut: Future[Any]) -> None:
        self._busy -= 1
        t = self._tenants[j.tenant]
        t.running -= 1
        self._forget_tenant(j.tenant)
        try:
            self._end(j, fut.result(), None)
        except EngineError as e:
            self._end(j, None, e)
        except Exception as e:  # a compiler's bug fails its request, not the engine
            log.exception("grammar compile failed")
            self._end(j, None, EngineError(f"the grammar failed to compile: {e!r}"))
        self._dispatch()

    def _waited_too_long(self, j: _Job) -> None:
        self._unqueue(j)
        self._end(j, None, EngineBusy(
            f"{j.job.param} waited {self.wait_s:g}s for the grammar compiler, which other "
            "requests' grammars hold; retry", param=j.job.param))

    def _unqueue(self, j: _Job) -> None:
        t = self._tenants.get(j.tenant)
        if t is None or j.running:
            return
        try:
            t.waiting.remove(j)
        except ValueError:
            return
        self._forget_tenant(j.tenant)

    def _forget_tenant(self, tenant: str) -> None:
        t = self._tenants.get(tenant)
        if t is not None and not t.waiting and not t.running:
            del self._tenants[tenant]

    def _end(self, j: _Job, grammar: Any, error: EngineError | None) -> None:
        if self._jobs.get(j.key) is not j:  # (ended already: a cancel, shutdown)
            return
        del self._jobs[j.key]
        if j.timer is not None:
            j.timer.cancel()
        if error is None:
            j.done(grammar)
        else:
            j.fail(error)

    def drop(self, key: Any) -> bool:
        """Forget a request's compile (it was cancelled); whether it had one. A running compile
        keeps its slot until it ends (within its deadline); a waiting one leaves the queue."""
        j = self._jobs.pop(key, None)
        if j is None:
            return False
        if j.timer is not None:
            j.timer.cancel()
        self._unqueue(j)
        return True

    def close(self) -> list[Any]:
        """Stop (shutdown): the requests still compiling, which get no `done`."""
        keys = list(self._jobs)
        for key in keys:
            self.drop(key)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        return keys
