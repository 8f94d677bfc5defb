"""What a process refused from its peers, counted, and the one rate-limited warning.

`bad_messages`: frames dropped because they did not decode, by decoder name ("worker",
"frontend", ...). `protocol_errors`: messages that decoded but were refused or could not be
answered, by (socket kind, what was wrong), through `refused()`. Both are process-wide; the worker
exports them on its health port's `/metrics` (tandem.worker.metrics). Bad input must not flood the
log: each kind of refusal warns through its own `Throttled`, at most once a second.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["Throttled", "bad_messages", "dropped", "protocol_errors", "refused"]


class Throttled:
    """A warning logged at most once every `every_s` seconds; a call in between is not logged
    (what it counts is the caller's to say in the next line it logs)."""

    __slots__ = ("log", "every_s", "clock", "_last")

    def __init__(self, log: logging.Logger, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.every_s, self.clock = log, every_s, clock
        self._last: float | None = None

    def due(self) -> bool:
        """Whether a warning now would be logged (and, if so, the clock restarts)."""
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            return False
        self._last = now
        return True

    def warning(self, msg: str, *args: object) -> None:
        if self.due():
            self.log.warning(msg, *args)


bad_messages: Counter[str] = Counter()
protocol_errors: Counter[tuple[str, str]] = Counter()
_throttles: dict[tuple[str, int], Throttled] = {}  # (counter, logger) -> its warning


def _throttle(counter: str, log: logging.Logger) -> Throttled:
    t = _throttles.get((counter, id(log)))
    if t is None:
        t = _throttles[(counter, id(log))] = Throttled(log)
    return t


def dropped(name: str, err: Exception, log: logging.Logger) -> None:
    """Count one frame that did not decode on a `name` socket, and warn (rate-limited)."""
    bad_messages[name] += 1
    _throttle("bad", log).warning("dropped a bad message (%d on %s sockets so far): %s",
                                  bad_messages[name], name, err)


def refused(socket: str, what: str, log: logging.Logger, detail: object = "") -> None:
    """Count one refused message (or unanswerable peer) in `protocol_errors`, and warn
    (rate-limited, over all kinds of refusal)."""
    protocol_errors[(socket, what)] += 1
    _throttle("refused", log).warning("%s socket: %s (%d so far)%s", socket, what,
                                      protocol_errors[(socket, what)],
                                      f": {detail}" if detail else "")
