"""The response's phases (tandem.frontend.response_state) and the per-pass batcher the pushes ride
on (tandem.runtime.passes): where the task parks, what queues for it, and the order kept."""

from __future__ import annotations

import asyncio

import pytest

from tandem.frontend.response_state import (BLOCKED, FINISHING, FIRST, PHASES, PLACING, STREAMING,
                                            ResponseState)
from tandem.runtime.passes import PassBatcher


def test_a_streamed_response_with_the_write_now_calls() -> None:
    rs = ResponseState(stream=True, push=True, first=True)
    assert rs.phase == PLACING
    rs.park(started=False)
    assert PHASES[rs.phase] == "waiting for the first delta"
    rs.park(started=False)  # (a first delta that made no bytes: still waiting for the first)
    assert rs.phase == FIRST
    rs.park(started=True)  # the first chunk started the response
    assert rs.phase == STREAMING
    rs.queue.append(1)  # what queues for the task wakes it: nothing is handled without it now
    rs.wake()
    assert rs.phase == BLOCKED and list(rs.queue) == [1]
    rs.queue.popleft()
    rs.park(started=True)
    assert rs.phase == STREAMING
    rs.finish()
    rs.wake()
    assert rs.phase == FINISHING


@pytest.mark.parametrize("push, first, unstarted, started", [
    (True, True, FIRST, STREAMING),
    (True, False, BLOCKED, STREAMING),  # no start_nowait: the task starts the stream
    (False, False, BLOCKED, BLOCKED),  # no write-now calls at all (granian): all the task's
])
def test_where_a_stream_parks_depends_on_what_the_server_offers(
        push: bool, first: bool, unstarted: int, started: int) -> None:
    rs = ResponseState(stream=True, push=push, first=first)
    rs.park(started=False)
    assert rs.phase == unstarted
    rs.park(started=True)
    assert rs.phase == started


def test_an_aggregated_response_is_fed_at_the_pass_end_from_the_start() -> None:
    rs = ResponseState(stream=False, push=False, first=False)
    rs.park(started=False)
    assert rs.phase == STREAMING


def test_what_only_the_task_does_is_kept_for_it() -> None:
    rs = ResponseState(stream=True, push=True, first=True)
    rs.left_over(b"chunk")
    rs.stopped(2)
    err = RuntimeError("bug")
    rs.failed(err)
    assert rs.out == [b"chunk"] and rs.leaving == [2]
    assert rs.crash is err


async def test_pass_batcher_flushes_once_per_pass_in_order() -> None:
    flushed: list[list[int]] = []
    b: PassBatcher[int] = PassBatcher(flushed.append)
    for i in range(3):
        b.add(i)
    assert flushed == [] and len(b) == 3
    await asyncio.sleep(0)
    assert flushed == [[0, 1, 2]] and len(b) == 0
    b.add(3)
    await asyncio.sleep(0)
    assert flushed == [[0, 1, 2], [3]]


def test_pass_batcher_survives_a_loop_that_stopped_with_items() -> None:
    flushed: list[list[int]] = []
    b: PassBatcher[int] = PassBatcher(flushed.append)

    async def add_only(x: int) -> None:
        b.add(x)
        raise SystemExit  # the loop stops before its callback runs

    stopped = asyncio.new_event_loop()
    with pytest.raises(SystemExit):
        stopped.run_until_complete(add_only(2))
    stopped.close()

    async def add_again(x: int) -> None:
        b.add(x)
        await asyncio.sleep(0)

    asyncio.run(add_again(3))
    assert flushed == [[3]]  # a new loop gets a new callback; the stopped pass's item is dropped
