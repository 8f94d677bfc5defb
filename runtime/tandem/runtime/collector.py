"""DeltaCollector: the one place a request's deltas wait between the worker link and the response.

One collector per request, one reader. `put(delta)` keeps at most ONE pending delta: when the reader
lags (a slow HTTP client), a new delta is merged into the pending one (tokens appended; the finish,
usage and error of the newest win), so a slow client never grows a queue and the reader writes one
fuller chunk instead of many. `fail(err)` ends the request with an error that the reader sees after
the pending delta (text that arrived before a failure is never lost). The reader registers a
`listen` callback, told once each time the collector turns non-empty (one response loop
multiplexes a request's several collectors this way), and calls `take()` (or `take_running()`:
only a delta after which the request goes on).

Offsets are not checked here: the request handle checks them before `put` (ARCHITECTURE.md,
"The path of a request").
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.runtime.wire import Delta


class DeltaCollector:
    __slots__ = ("_delta", "_owned", "_failure", "_signalled", "_listener")

    def __init__(self) -> None:
        self._delta: Delta | None = None
        self._owned = False  # _delta is a copy made by a merge (safe to extend in place)
        self._failure: BaseException | None = None
        self._signalled = False  # the reader was told there is something, and has not taken it
        self._listener: Callable[[], None] | None = None

    @property
    def ready(self) -> bool:
        """`take()` would return a delta or raise now."""
        return self._delta is not None or self._failure is not None

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def put(self, delta: Delta) -> None:
        p = self._delta
        if p is None:
            self._delta = delta
            self._owned = False
            if not self._signalled:
                self._signal()
            return
        if not self._owned:  # first merge: copy, so the caller's delta is never mutated
            self._delta = p.joined(delta)  # (tokens and their logprobs, if any)
            self._owned = True
            return
        p.extend(delta)

    def fail(self, err: BaseException) -> None:
        """End the request with `err` (the first failure wins), after what is pending."""
        if self._failure is None:
            self._failure = err
            if not self._signalled:
                self._signal()

    def take_running(self) -> Delta | None:
        """The pending delta if the request goes on after it: it does not finish the request and
        no failure waits behind it (otherwise None, and it stays for `take`)."""
        d = self._delta
        if d is None or d.finish_reason is not None or self._failure is not None:
            return None
        self._delta = None
        self._signalled = False
        return d

    def take(self) -> Delta | None:
        """The pending delta (merged), or None; with nothing pending, raise the failure."""
        self._signalled = False
        d = self._delta
        if d is not None:
            self._delta = None
            if self._failure is not None:
                self._signal()  # the failure is still to be seen
            return d
        if self._failure is not None:
            raise self._failure
        return None

    def listen(self, on_ready: Callable[[], None]) -> None:
        """Call `on_ready()` each time this collector turns ready; at once if it already is."""
        self._listener = on_ready
        if self.ready:  # (a signal before now went to no one)
            self._signal()

    def unlisten(self) -> None:
        """The reader is done: forget its callback (which usually holds the reader)."""
        self._listener = None

    def _signal(self) -> None:
        self._signalled = True
        listener = self._listener
        if listener is not None:
            listener()
