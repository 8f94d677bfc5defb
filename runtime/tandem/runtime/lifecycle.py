"""Process lifecycle: uvloop, SIGTERM/SIGINT turned into a stop event, and owned background tasks.

`run(main)` runs `main(stop)` where `stop` is an asyncio.Event set on the first SIGTERM/SIGINT;
`main` drains and returns. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from tandem.runtime.config import GC_THRESHOLDS

log = logging.getLogger("tandem")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Call once the process has started: what exists now lives as long as the process, so it
    leaves the collector's view (`gc.freeze`), and young collections run every `thresholds[0]`
    allocations instead of 700. With thousands of live streams, CPython's default thresholds
    promote the objects of requests in flight into the old generation, whose full collections
    then stop the event loop for 100-300 ms several times a second; cycles are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.Runner()
    with runner:
        runner.run(_with_signals(main))


async def _with_signals(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: int) -> None:
        if stop.is_set():
            log.warning("second signal %s: exiting now", sig)
            os._exit(1)
        log.info("signal %s: draining", sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await main(stop)


class TaskGroup:
    """Owns background tasks: every task started here is cancelled and awaited by `close()`."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, timeout: float = 5.0) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout)
