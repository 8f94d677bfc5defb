"""Waiting for a condition in tests: always on the condition itself, always within a deadline (a
deadline for a hang, never a bound on how fast the code is). Never "sleep, then assert".

`until` (async): lets the event loop run, one pass at a time (`every=0`) or every `every`
seconds, until `cond()` holds; TimeoutError past `timeout`. `wait_for` (sync, for clusters of
processes): polls `cond()` every `every` seconds; AssertionError naming `what` past `timeout`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["until", "wait_for"]


async def until(cond: Callable[[], object], timeout: float = 10.0, every: float = 0.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(every)


def wait_for(cond: Callable[[], object], what: str, timeout: float = 10.0,
             every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(every)
