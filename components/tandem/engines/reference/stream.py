"""Loop-side plumbing of a generate() call: what the step thread hands over per request (`Emit`),
the per-request queue it lands in (`Stream`), and `race`, which waits for a task or an emit."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tandem.engines.reference.scheduler import Sequence
from tandem.runtime.wire import FinishReason


@dataclass(slots=True)
class Emit:
    """One request's share of a step: its new ids, and how it ended if it did. A decode request
    whose pages were just reserved gets an empty one (no ids, no finish)."""

    seq: Sequence
    new_ids: list[int]
    finish: FinishReason | None
    error: str = ""


class Stream:
    """Loop-side state of one generate() call."""

    __slots__ = ("seq", "queue", "ids")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.queue: asyncio.Queue[Emit] = asyncio.Queue()
        self.ids: list[int] = []  # every id delivered so far (for cumulative output)


async def race(queue: asyncio.Queue[Emit], task: asyncio.Future[Any]) -> Emit | None:
    """Wait until `task` is done or an emit arrives (during a KV handoff that can only be the
    end: abort or shutdown). Returns the emit if one came, else None (the task is done then).
    Neither the task nor a queued emit is lost if the caller is cancelled."""
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait((task, getter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        getter.cancel()  # a get that was cancelled leaves its item in the queue
    if getter.done() and not getter.cancelled():
        return getter.result()
    return None
