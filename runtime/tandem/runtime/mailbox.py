"""Mailbox: a queue with exactly one reader, woken by one bare future. Cheaper per item than
asyncio.Queue or an asyncio.Event, which keep lists of waiters; on a per-token path (an engine
handing outputs to a request, a frontend handing deltas to a stream) that difference is paid per
token per stream."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        """Items already here: the next `get` returns without waiting."""
        return len(self._items)

    def put(self, item: T) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():  # (a reader cancelled while waiting left it cancelled)
                w.set_result(None)

    async def get(self) -> T:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()
