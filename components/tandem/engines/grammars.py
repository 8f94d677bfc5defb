"""Constrained output in tandem's own engines, the step loop's side of it (no torch here; the
reference engine's grammars are tandem.engines.reference.grammar).

An engine's `constraint(request)` hook (tandem.engines.stepper) gives a request's grammar state:
None (unconstrained), a ready one, or `Deferred(compile)` when it must be compiled first. A
compile can take seconds on a schema of a few dozen characters (xgrammar 0.2.8: 1.3 s for the
pattern `(a|aa)*b{1,5000}`, 2 s for 200 nested objects), so it never runs on the event loop:
`Compiles` runs them one at a time on a thread of its own (the compiler releases the GIL) and
hands each result back to the loop, where the request then enters the scheduler as any other
does. Each compile has a deadline (`COMPILE_DEADLINE_S` from submit): past it the request fails
with a 400 naming its grammar's field, and a compile that has not begun by then is skipped; one
that is running cannot be stopped, but it holds one thread and no page. A request cancelled
while it compiles holds nothing: it just never enters the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tandem.engines.sampling import grammar_param
from tandem.runtime.errors import EngineError, EngineRequestError
from tandem.runtime.wire import SamplingParams

log = logging.getLogger("tandem.engine")

COMPILE_DEADLINE_S = 5.0


@dataclass(slots=True)
class Deferred:
    """A grammar to compile off the event loop: `compile()` returns its state or raises
    EngineRequestError; `param` is the field it came in."""

    compile: Callable[[], Any]
    param: str


def refuse(p: SamplingParams, engine: str, why: str) -> None:
    """An engine that cannot constrain its output refuses a grammar, naming itself."""
    param = grammar_param(p)
    if param is not None:
        raise EngineRequestError(f"{param} (constrained output) is not supported by the {engine} "
                                 f"engine{why}", param=param)


class Compiles:
    """The engine's compiles in flight, keyed by request (any hashable key: its Sequence)."""

    def __init__(self, deadline_s: float = COMPILE_DEADLINE_S) -> None:
        self.deadline_s = deadline_s
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[Any, tuple[Callable[[Any], None], Callable[[EngineError], None],
                                       asyncio.TimerHandle]] = {}

    def start(self, job: Deferred, done: Callable[[Any], None],
              fail: Callable[[EngineError], None], key: Any) -> None:
        """Compile `job` (on the loop): `done(grammar)` or `fail(error)` follows on the loop,
        once, unless `drop(key)` or `close()` comes first."""
        loop = asyncio.get_running_loop()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
        due = time.monotonic() + self.deadline_s
        late = EngineRequestError(f"{job.param} did not compile within {self.deadline_s:g}s; "
                                  "simplify it", param=job.param)
        timer = loop.call_later(self.deadline_s, self._end, key, None, late)
        self._pending[key] = (done, fail, timer)

        def run() -> Any:
            if time.monotonic() > due:  # (it waited past its deadline: it failed already)
                return None
            return job.compile()

        def back(fut: Future[Any]) -> None:
            try:
                loop.call_soon_threadsafe(self._result, key, fut)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        self._pool.submit(run).add_done_callback(back)

    def _result(self, key: Any, fut: Future[Any]) -> None:
        try:
            self._end(key, fut.result(), None)
        except EngineError as e:
            self._end(key, None, e)
        except Exception as e:  # a compiler's bug fails its request, not the engine
            log.exception("grammar compile failed")
            self._end(key, None, EngineError(f"the grammar failed to compile: {e!r}"))

    def _end(self, key: Any, grammar: Any, error: EngineError | None) -> None:
        entry = self._pending.pop(key, None)
        if entry is None:  # (ended already: its deadline, a cancel, shutdown)
            return
        done, fail, timer = entry
        timer.cancel()
        if error is None:
            done(grammar)
        else:
            fail(error)

    def drop(self, key: Any) -> bool:
        """Forget a request's compile (it was cancelled); whether it had one."""
        entry = self._pending.pop(key, None)
        if entry is not None:
            entry[2].cancel()
        return entry is not None

    def close(self) -> list[Any]:
        """Stop (shutdown): the requests still compiling, which get no `done`."""
        keys = list(self._pending)
        for key in keys:
            self.drop(key)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        return keys
