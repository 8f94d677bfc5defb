"""lifecycle.running_loop: the running loop without a system call, right across loops; and the
router's random ids drawn in bulk stay distinct and the right size."""

from __future__ import annotations

import asyncio
import threading

import uvloop

from tandem.runtime.lifecycle import running_loop
from tests.fakes import memory_pool


async def _same() -> asyncio.AbstractEventLoop:
    loop = running_loop()
    assert loop is asyncio.get_running_loop()
    return loop


def test_running_loop_follows_each_new_loop_in_a_thread() -> None:
    first = asyncio.run(_same())
    second = asyncio.run(_same())  # a new loop in the same thread: not the stale first one
    third = uvloop.run(_same())
    assert len({id(first), id(second), id(third)}) == 3


def test_running_loop_is_per_thread() -> None:
    seen: list[asyncio.AbstractEventLoop] = []
    started, release = threading.Event(), threading.Event()

    async def held() -> None:
        seen.append(running_loop())
        started.set()
        while not release.is_set():  # keep this thread's loop running meanwhile
            await asyncio.sleep(0.001)

    t = threading.Thread(target=lambda: asyncio.run(held()))
    t.start()
    try:
        assert started.wait(5)
        mine = asyncio.run(_same())  # the other thread's running loop is not ours
        assert mine is not seen[0]
    finally:
        release.set()
        t.join(5)


def test_request_ids_are_distinct_and_96_bits() -> None:
    pool, _ = memory_pool(["agg"])
    ids = [pool.new_rid() for _ in range(2000)]  # past several bulk draws
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 24 and int(i, 16) >= 0 for i in ids)
