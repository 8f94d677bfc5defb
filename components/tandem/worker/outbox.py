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

While the frontend is behind, a message carries at most `batch` deltas besides the first tokens:
the rest wait (and keep merging) for a later message, oldest first, so every request gets its turn.
Together with the window this bounds what a frontend holds unprocessed while it lags at window x
batch deltas, whatever the number of streams: the frontend's event loop passes stay short, a new
request's first token never waits behind one delta of every live stream, and an overloaded
frontend gets fewer, fuller deltas (how the batch was chosen: commit e8cd4d4, and
perf/results/sweep.md, run 4). A frontend that keeps up (nothing in flight, its last
credit at least `idle_s` ago: not a send that its credit just released) takes everything that
waits in one message, so a paced engine's step is one message, not one per `batch` deltas (each
ZMQ send costs the worker tens of µs). Deltas that carry a request's first token (offset 0) always go
at the head of the next message, whatever the batch, and do not wait for credit: while the window
is full they leave on their own (`take_first`), so time to first token does not include the
frontend's round trip for credit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from tandem.runtime.wire import Delta


IDLE_S = 0.002  # see Outbox: how long a frontend with nothing in flight counts as keeping up


class Outbox:
    __slots__ = ("window", "batch", "in_flight", "idle_since", "_first", "_rest",
                 "_open", "_idle_s", "_clock")

    def __init__(self, window: int, batch: int = 0, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window < 1:
            raise ValueError("the delta window must be at least 1 message")
        if batch < 0:
            raise ValueError("the delta batch must not be negative (0 = no limit)")
        self.window = window
        self.batch = batch  # deltas per message besides first tokens; 0 = all waiting
        self.in_flight = 0  # messages sent and not credited yet
        self._idle_s, self._clock = idle_s, clock
        self.idle_since = -math.inf  # when in_flight last fell to 0 by credit (never: idle)
        self._first: list[Delta] = []  # waiting deltas that start a request's output
        self._rest: list[Delta] = []
        self._open: dict[str, Delta] | None = None  # see _index; None: not built

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

    def _index(self) -> dict[str, Delta]:
        """rid -> its waiting delta that later ones merge into: its latest, unless that one ends
        it (built when first needed: while deltas leave as fast as they come, nothing waits and
        nothing merges, and two deltas of a request may wait unmerged, in order)."""
        open_ = self._open
        if open_ is None:
            latest: dict[str, Delta] = {}
            for d in (*self._rest, *self._first):
                prev = latest.get(d.rid)
                if prev is None or d.offset >= prev.offset:
                    latest[d.rid] = d
            open_ = self._open = {r: d for r, d in latest.items() if d.finish_reason is None}
        return open_

    def add(self, delta: Delta) -> None:
        if self._open is None and not (self._first or self._rest):  # nothing to merge into
            (self._first if delta.offset == 0 else self._rest).append(delta)
            return
        open_ = self._index()
        rid = delta.rid
        if delta.finish_reason == "error":
            open_.pop(rid, None)
        else:
            prev = open_.get(rid)
            if prev is not None:
                # Contiguous by construction: one DeltaMaker per request, in order.
                prev.extend(delta)  # tokens and their logprobs, finish, usage
                if delta.finish_reason is not None:
                    del open_[rid]
                return
            if delta.finish_reason is None:
                open_[rid] = delta
        (self._first if delta.offset == 0 else self._rest).append(delta)

    def add_all(self, deltas: list[Delta]) -> None:
        """`add` each, in order."""
        if self._open is None and not (self._first or self._rest):
            # Nothing waits: nothing to merge into (one engine step has one delta per request;
            # where an engine gives two, they wait unmerged, in order: see _index).
            for delta in deltas:
                (self._first if delta.offset == 0 else self._rest).append(delta)
            return
        for delta in deltas:
            self.add(delta)

    def take(self, everything: bool = False) -> list[Delta]:
        """The next message: every waiting first token, then up to `batch` other deltas (all of
        them with `everything`), oldest first. Counted as one message in flight."""
        items, rest = self._first, self._rest
        self._first = []
        if everything or not self.batch or self._idle():
            n = len(rest)  # (an idle frontend takes a whole step's deltas in one message)
        else:
            n = min(len(rest), self.batch)
        if n == len(rest):
            items.extend(rest)
            self._rest = []
            self._open = None
        else:
            items.extend(rest[:n])
            self._rest = rest[n:]
            self._forget(items)
        self.in_flight += 1
        return items

    def take_first(self) -> list[Delta]:
        """A message of the waiting first tokens only, sent past the window (still counted in
        flight, so the credit that comes back for it balances)."""
        items, self._first = self._first, []
        self._forget(items)
        self.in_flight += 1
        return items

    def _forget(self, sent: list[Delta]) -> None:
        """Sent: later tokens of these requests start a new delta."""
        open_ = self._open
        if open_ is not None:
            for d in sent:
                if open_.get(d.rid) is d:
                    del open_[d.rid]

    def _idle(self) -> bool:
        """The frontend took everything sent over `idle_s` ago: it keeps up, with time to spare
        (a send right after its credit, the overloaded case, is not idle)."""
        return not self.in_flight and self._clock() - self.idle_since > self._idle_s

    def credit(self, n: int) -> None:
        """The frontend consumed `n` messages."""
        if self.in_flight and n >= self.in_flight:
            self.idle_since = self._clock()
        self.in_flight = max(0, self.in_flight - n)

    def reset(self) -> None:
        """The frontend (re)introduced itself: nothing of the old connection is in flight."""
        self.in_flight = 0
