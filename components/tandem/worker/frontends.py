"""Frontends: what a worker keeps per frontend, and the one flush policy (ARCHITECTURE.md,
"Backpressure").

Per frontend a `FrontendLink`: its Outbox (tandem.worker.outbox: credit window, merging, first
tokens first) and when it last said anything. Every delta produced while the event loop runs one
iteration leaves as ONE `Deltas` message per frontend on the next iteration (so the wire carries at
most one message per engine step per frontend, never one per token), within the frontend's window;
while the window is full, first tokens still leave on their own. `silent()` names the frontends
that owe credit and said nothing for too long; the server ends their requests.

Sending goes through the `send` callable the server gives (it owns the socket and decides what a
failed send means); nothing here does I/O of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tandem.runtime.passes import PassBatcher
from tandem.runtime.wire import Delta, Deltas, Load
from tandem.worker.outbox import Outbox


class FrontendLink:
    """One frontend as a worker sees it."""

    __slots__ = ("ident", "outbox", "last_heard", "prefills")

    def __init__(self, ident: bytes, outbox: Outbox) -> None:
        self.ident = ident
        self.outbox = outbox
        self.last_heard = time.monotonic()  # when this frontend last sent anything
        self.prefills: frozenset[str] = frozenset()  # bootstrap addresses it announced

    def silent_for(self, now: float) -> float:
        """How long it has owed credit without a word (0 when it owes nothing)."""
        return now - self.last_heard if self.outbox.in_flight else 0.0


class Frontends:
    def __init__(self, window: int, batch: int, send: Callable[[bytes, Deltas], None],
                 load: Callable[[], Load]) -> None:
        self.window, self.batch = window, batch
        self._send, self._load = send, load
        self._links: dict[bytes, FrontendLink] = {}
        self._due: PassBatcher[FrontendLink] = PassBatcher(self._flush_due)  # this pass's

    def __contains__(self, ident: bytes) -> bool:
        return ident in self._links

    @property
    def pending(self) -> bool:
        """Deltas are waiting for some frontend (for its credit, or for the next flush)."""
        return any(len(link.outbox) for link in self._links.values())

    # --- what a frontend said ---------------------------------------------------------------------
    def heard(self, ident: bytes) -> None:
        link = self._links.get(ident)
        if link is not None:
            link.last_heard = time.monotonic()

    def hello(self, ident: bytes) -> None:
        """A (re)connection: credit owed on the old connection will not come."""
        link = self._links.get(ident)
        if link is not None:
            link.outbox.reset()

    def announce(self, ident: bytes, prefills: frozenset[str]) -> None:
        """The prefill workers' bootstrap addresses (host:port) this frontend uses."""
        self._link(ident).prefills = prefills

    def announced(self, ident: bytes, address: str) -> bool:
        """Whether this frontend announced a prefill worker at `address` (host:port)."""
        link = self._links.get(ident)
        return link is not None and address in link.prefills

    def credit(self, ident: bytes, n: int) -> None:
        link = self._links.get(ident)
        if link is not None:
            link.outbox.credit(n)
            if link.outbox.can_send:
                self._send(ident, Deltas(link.outbox.take(), self._load()))

    # --- deltas -----------------------------------------------------------------------------------
    def emit(self, ident: bytes, delta: Delta) -> None:
        self.emit_all(ident, [delta])

    def emit_all(self, ident: bytes, deltas: list[Delta]) -> None:
        """Queue deltas for a frontend, in order; the next flush sends what its window allows."""
        link = self._links.get(ident)
        if link is None:  # (`_link`, inline: once per step per frontend)
            link = self._links[ident] = FrontendLink(ident, Outbox(self.window, self.batch))
        box = link.outbox
        box.add_all(deltas)
        if box.in_flight < box.window or box.has_first:
            self._due.add(link)

    def _link(self, ident: bytes) -> FrontendLink:
        link = self._links.get(ident)
        if link is None:
            link = self._links[ident] = FrontendLink(ident, Outbox(self.window, self.batch))
        return link

    def _flush_due(self, links: list[FrontendLink]) -> None:
        self._flush(dict.fromkeys(links), force=False)

    def flush(self, force: bool = False) -> None:
        """Send what each frontend's window allows (`force`: everything, past the window)."""
        self._flush(list(self._links.values()), force)

    def _flush(self, links: Iterable[FrontendLink], force: bool) -> None:
        load: Load | None = None  # the engine's load, once per flush (it changes per step)
        for link in links:
            ident = link.ident
            if self._links.get(ident) is not link:
                continue  # dropped since
            box = link.outbox
            if force and len(box):
                items = box.take(everything=True)
            elif box.can_send:
                items = box.take()
            elif box.has_first:  # the window is full: first tokens go on their own
                items = box.take_first()
            else:
                continue
            if load is None:
                load = self._load()
            self._send(ident, Deltas(items, load))

    # --- ending -----------------------------------------------------------------------------------
    def silent(self, limit_s: float) -> list[bytes]:
        now = time.monotonic()
        return [i for i, link in self._links.items() if link.silent_for(now) > limit_s]

    def drop(self, ident: bytes, last_words: bool) -> None:
        """Forget a frontend; with `last_words`, first send what its outbox holds, past the
        window (ZMQ keeps it for a frontend that resumes)."""
        link = self._links.pop(ident, None)
        if last_words and link is not None and len(link.outbox):
            self._send(ident, Deltas(link.outbox.take(everything=True), self._load()))
