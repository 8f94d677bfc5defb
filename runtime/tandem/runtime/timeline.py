"""Request timelines, for finding where a request's first token waited (README, "Request
timelines"; perf/streaming/hops.py joins them).

With `TANDEM_TIMELINE=DIR` in its environment, each tandem process appends one line per event to
`DIR/<pid>.tl`: `<CLOCK_MONOTONIC seconds> <event> <fields...>`. CLOCK_MONOTONIC is one clock for
every process of a machine (Python's `time.monotonic` and `time.perf_counter` on Linux), so the
processes' lines join into one timeline per request. The events (rid: the frontend's request id,
which a worker's Generate carries):

- frontend: `arrive RID TENANT T0` (its body was read and its worker handles opened; TENANT: its
  tenant as the frontend keeps it, a digest, never a key or a user's name; T0: when the request
  arrived), `placed RID` (admitted: its Generate leaves for its worker with this loop pass's
  others; a request moved to another worker is placed again as `RID.N`), `first RID` (its first
  token's delta reached the response), `chunk RID` (its first bytes for the client were made: a
  token whose text is not whole yet, a broken UTF-8 character, makes none);
- worker: `recv RID` (its Generate was read), `out RID` (its first output left the engine);
- engine (the mock and reference engines' step loop): `step PREFILL_TOKENS DECODES RID...` (a step
  began: the prompt tokens it computes, how many sequences it decodes, and the sequences whose
  prompt or chunk it computes), `end` (that step ended);
- any process: `gc GENERATION MS` (a garbage collection of that generation ended, having stopped
  the process for MS milliseconds).

Off (the default) the hooks test this module's flag once per request and once per engine step,
never per token (the frontend's responses with a timeline are a class of their own:
tandem.frontend.respond._Timed; perf/results/frontend_route.md has the count). On, each event is
one line written through a line-buffered file: a diagnostic, not for a production cluster.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import IO, Any

__all__ = ["ENV", "ON", "mark"]

ENV = "TANDEM_TIMELINE"
ON = bool(os.environ.get(ENV))  # (read once, at import: the process's environment)
_file: IO[str] | None = None
_lock = threading.Lock()  # (the reference engine's steps mark from their thread)


def mark(event: str, *fields: object) -> None:
    """Append `event` with its fields, now; call only under `if timeline.ON:`. A field's
    whitespace is taken out (a request id is a peer's: it cannot add a field or a line)."""
    global _file
    line = f"{time.monotonic():.6f} {event} {' '.join(''.join(str(f).split()) for f in fields)}\n"
    with _lock:
        if _file is None:
            directory = os.environ[ENV]
            os.makedirs(directory, exist_ok=True)
            _file = open(os.path.join(directory, f"{os.getpid()}.tl"), "a", buffering=1)
        if _collections:  # (the collector's callback keeps them: it may run inside a write)
            done = _collections[:]
            del _collections[:len(done)]
            _file.write("".join(f"{t:.6f} gc {gen} {ms:.3f}\n" for t, gen, ms in done))
        _file.write(line)


_gc_began = 0.0
_collections: list[tuple[float, int, float]] = []  # (ended, generation, ms), not written yet


def _collected(phase: str, info: dict[str, Any]) -> None:
    global _gc_began
    now = time.monotonic()
    if phase == "start":
        _gc_began = now
    else:
        _collections.append((now, info["generation"], (now - _gc_began) * 1e3))


if ON:
    gc.callbacks.append(_collected)
