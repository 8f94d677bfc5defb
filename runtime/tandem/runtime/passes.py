"""`PassBatcher`: what is added during one event loop pass, handed over once, at the pass's end.

Several things are cheaper done once per pass than once per item: one message per peer for all the
requests placed in a pass, one write per response for the deltas that arrived in it. The batcher
schedules one callback when the first item of a pass arrives; later items of that pass ride along.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from tandem.runtime.lifecycle import running_loop

T = TypeVar("T")

__all__ = ["PassBatcher"]


class PassBatcher(Generic[T]):
    """`add(item)` during a loop pass; at the pass's end `flush(items)` runs once with every item
    added in it, in order. The loop is the one running when the pass's first item is added (a
    batcher made outside a loop works; a loop that stopped with items pending drops them, as it
    dropped its callback)."""

    __slots__ = ("_items", "_flush", "_loop")

    def __init__(self, flush: Callable[[list[T]], None]) -> None:
        self._items: list[T] = []
        self._flush = flush
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, item: T) -> None:
        if not self._items or self._loop is None or not self._loop.is_running():
            self._items.clear()
            self._loop = loop = running_loop()
            loop.call_soon(self._run)
        self._items.append(item)

    def __len__(self) -> int:
        return len(self._items)

    def _run(self) -> None:
        items, self._items = self._items, []
        self._flush(items)
