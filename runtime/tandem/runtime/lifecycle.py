"""Process lifecycle: the one place signals are handled, owned background tasks, and draining.

- `run(main)` runs `main(stop)` under uvloop, where `stop` is an asyncio.Event set on the first
  SIGTERM/SIGINT; `main` drains and returns. A second signal exits at once. A supervised task that
  dies (below) also sets `stop`, and the process then exits with status 1.
- `TaskGroup` owns background tasks: `close()` cancels and awaits every one. A `supervised` group
  treats a task that ends with an exception as fatal: it is logged and the process goes down (under
  `run`), instead of the service limping on without, say, its receive loop.
- `drain(tasks, timeout)` gives work in flight `timeout` seconds to finish, then cancels and awaits
  what is left: the frontend drains its requests with it, and the worker can too.
- `running_loop()` is `asyncio.get_running_loop()` for code that runs per request or per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any

from tandem.runtime.config import GC_THRESHOLDS

log = logging.getLogger("tandem")


_this_thread = threading.local()


def running_loop() -> asyncio.AbstractEventLoop:
    """The running event loop, as `asyncio.get_running_loop()` gives it, without the `getpid()`
    system call CPython makes on every call of that (to notice a fork): the loop this thread last
    asked for, while it still runs (a thread runs one loop at a time). A forked child that goes on
    running its parent's loop without exec would need the real call; nothing in tandem does."""
    loop = getattr(_this_thread, "loop", None)
    if loop is None or not loop.is_running():
        loop = _this_thread.loop = asyncio.get_running_loop()
    return loop


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """The process's logging (tandem.runtime.logs): `fmt` is "text" or "json"."""
    from tandem.runtime.logs import setup

    setup(level, fmt)


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Call once the process has started: what exists now lives as long as the process, so it
    leaves the collector's view (`gc.freeze`), and young collections run every `thresholds[0]`
    allocations instead of 700. With thousands of live streams, CPython's default thresholds
    promote the objects of requests in flight into the old generation, whose full collections
    then stop the event loop for 100-300 ms several times a second; cycles are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)


class _Process:
    """What `run` knows while the process runs: its stop event, and whether a task crashed."""

    stop: asyncio.Event | None = None
    crashed = False


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.Runner()
    with runner:
        runner.run(_with_signals(main))
    if _Process.crashed:
        raise SystemExit(1)


async def _with_signals(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    loop = asyncio.get_running_loop()
    stop = _Process.stop = asyncio.Event()

    def on_signal(sig: int) -> None:
        if stop.is_set():
            log.warning("second signal %s: exiting now", sig)
            os._exit(1)
        log.info("signal %s: draining", sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await main(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        _Process.stop = None


def crash(why: str, exc: BaseException | None = None) -> None:
    """A part the process cannot live without failed: log it, and stop the process (under `run`:
    drain, then exit with status 1). Outside `run` (tests) it is only logged."""
    log.critical("fatal: %s", why, exc_info=exc)
    _Process.crashed = True
    if _Process.stop is not None:
        _Process.stop.set()


async def drain(tasks: Collection[asyncio.Future[Any]], timeout: float) -> int:
    """Wait up to `timeout` seconds for `tasks` to finish, then cancel and await the rest;
    return how many had to be cancelled. (The set may be live: it is copied once.)"""
    pending = list(tasks)
    if pending and timeout > 0:
        _, left = await asyncio.wait(pending, timeout=timeout)
        pending = list(left)
    pending = [t for t in pending if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    return len(pending)


class TaskGroup:
    """Owns background tasks: every task started here is cancelled and awaited by `close()`.
    `supervised`: a task that ends with an exception is fatal (`crash`), not only logged."""

    def __init__(self, supervised: bool = False) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.supervised = supervised

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if self.supervised:
            crash(f"task {task.get_name()} died", exc)
        else:
            log.error("task %s failed", task.get_name(), exc_info=exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, timeout: float = 5.0) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout)
