"""Outbox: what a worker has for one frontend and has not sent yet, with a credit window.

Per-token messages must never pile up between processes: when a frontend falls behind, a backlog
of queued messages makes every new request's first token wait behind all of it (TTFT grows with
the backlog, not with the work). So a worker keeps at most `window` `Deltas` messages in flight per
frontend; the frontend gives a credit back for each message once it has handed its deltas to their
streams. While the window is full, new deltas of a request are merged into the one delta that
request already has waiting (token ids appended, the finish taken from the newer): the frontend
then gets fewer, fuller deltas, and costs fewer CPU-µs per token, the more it lags. Nothing is
dropped or reordered within a request; an error delta is never merged, so tokens sent before an
error still reach the client before it.

A message carries at most `batch` deltas besides the first tokens: the rest wait (and keep
merging) for a later message, oldest first, so every request gets its turn. Together with the window
this bounds the deltas a frontend holds unprocessed at window x batch, whatever the number of
streams: the frontend's event loop passes stay short, and a new request's first token never waits
behind one delta of every live stream. Deltas that carry a request's first token (offset 0) always go
at the head of the next message, whatever the batch, and do not wait for credit: while the window
is full they leave on their own (`take_first`), so time to first token does not include the
frontend's round trip for credit.
"""

from __future__ import annotations

import time

from tandem.runtime.wire import Delta


class Outbox:
    __slots__ = ("window", "batch", "in_flight", "last_heard", "_first", "_rest", "_open")

    def __init__(self, window: int, batch: int = 0) -> None:
        if window < 1:
            raise ValueError("the delta window must be at least 1 message")
        if batch < 0:
            raise ValueError("the delta batch must not be negative (0 = no limit)")
        self.window = window
        self.batch = batch  # deltas per message besides first tokens; 0 = all waiting
        self.in_flight = 0  # messages sent and not credited yet
        self.last_heard = time.monotonic()  # when this frontend last sent anything
        self._first: list[Delta] = []  # waiting deltas that start a request's output
        self._rest: list[Delta] = []
        self._open: dict[str, Delta] = {}  # rid -> its waiting delta that later ones merge into

    def __len__(self) -> int:
        """Deltas waiting to be sent."""
        return len(self._first) + len(self._rest)

    @property
    def can_send(self) -> bool:
        return self.in_flight < self.window and bool(self._first or self._rest)

    @property
    def has_first(self) -> bool:
        """First tokens are waiting (they may leave past the window: `take_first`)."""
        return bool(self._first)

    def add(self, delta: Delta) -> None:
        rid = delta.rid
        if delta.finish_reason == "error":
            self._open.pop(rid, None)
        else:
            prev = self._open.get(rid)
            if prev is not None:
                # Contiguous by construction: one DeltaMaker per request, in order.
                prev.extend(delta)  # tokens and their logprobs, finish, usage
                if delta.finish_reason is not None:
                    del self._open[rid]
                return
            if delta.finish_reason is None:
                self._open[rid] = delta
        (self._first if delta.offset == 0 else self._rest).append(delta)

    def take(self, everything: bool = False) -> list[Delta]:
        """The next message: every waiting first token, then up to `batch` other deltas (all of
        them with `everything`), oldest first. Counted as one message in flight."""
        items, rest = self._first, self._rest
        self._first = []
        n = len(rest) if everything or not self.batch else min(len(rest), self.batch)
        if n == len(rest):
            items.extend(rest)
            self._rest = []
            self._open.clear()
        else:
            items.extend(rest[:n])
            self._rest = rest[n:]
            open_ = self._open
            for d in items:  # sent: later tokens of these requests start a new delta
                if open_.get(d.rid) is d:
                    del open_[d.rid]
        self.in_flight += 1
        return items

    def take_first(self) -> list[Delta]:
        """A message of the waiting first tokens only, sent past the window (still counted in
        flight, so the credit that comes back for it balances)."""
        items, self._first = self._first, []
        open_ = self._open
        for d in items:
            if open_.get(d.rid) is d:
                del open_[d.rid]
        self.in_flight += 1
        return items

    def credit(self, n: int) -> None:
        """The frontend consumed `n` messages."""
        self.in_flight = max(0, self.in_flight - n)

    def reset(self) -> None:
        """The frontend (re)introduced itself: nothing of the old connection is in flight."""
        self.in_flight = 0
