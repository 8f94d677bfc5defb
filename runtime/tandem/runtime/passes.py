"""`PassBatcher`: what is added during one event loop pass, handed over once, at the pass's end.

Several things are cheaper done once per pass than once per item: one message per peer for all the
requests placed in a pass (a frontend's `Generates`, `Abort` and `Credit`; a decode side's
`KvRooms` and `KvCancel`; a prefill side's `KvDones`), one `Deltas` per frontend for a step, one
`on_step` per sink for an iterator engine's outputs, one write per response for the deltas that
arrived in it. This is the one way the code does that: the batcher schedules one callback when the
first item of a pass arrives; later items of that pass ride along.
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
    added in it, in order (never with none). The end of the pass is a `call_soon` on the loop
    running when the pass's first item is added, or `defer(callback)` when one is given (tests
    drive passes by hand). A batcher made outside a loop works; a loop that stopped with items
    pending drops them, as it dropped its callback."""

    __slots__ = ("_items", "_flush", "_loop", "_defer")

    def __init__(self, flush: Callable[[list[T]], None],
                 defer: Callable[[Callable[[], None]], None] | None = None) -> None:
        self._items: list[T] = []
        self._flush = flush
        self._loop: asyncio.AbstractEventLoop | None = None
        self._defer = defer

    def add(self, item: T) -> None:
        if not self._items:
            self._schedule()
        elif self._defer is None and (self._loop is None or not self._loop.is_running()):
            self._items.clear()  # (left by a loop that stopped: its callback will not come)
            self._schedule()
        self._items.append(item)

    def _schedule(self) -> None:
        if self._defer is not None:
            self._defer(self.flush_now)
        else:
            self._loop = loop = running_loop()
            loop.call_soon(self.flush_now)

    def remove_if(self, pred: Callable[[T], bool]) -> int:
        """Take back the pending items `pred` picks; how many there were."""
        items = self._items
        if not items:
            return 0
        keep = [item for item in items if not pred(item)]
        n = len(items) - len(keep)
        if n:
            items[:] = keep
        return n

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def flush_now(self) -> None:
        """Hand over what is pending now (the pass's end calls this; so may a closing owner)."""
        items, self._items = self._items, []
        if items:
            self._flush(items)
