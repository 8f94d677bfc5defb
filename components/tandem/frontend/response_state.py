"""`ResponseState`: where one response is in its life, and so where a choice's delta goes. Pure:
no I/O, no event loop; tandem.frontend.respond acts on what it says.

A response's task places its choices, then waits for deltas; it is woken to do what only it does
(await a write the server cannot take now, leave a choice, finish, raise). A delta that arrives
while the task waits is handled without it when the server can write it now (the route of almost
every token under load; tandem.frontend.uvicorn_protocol). The phases:

    PLACING    the task enters the choices' handles (nothing arrives yet)
    FIRST      the task waits, the streamed response has not started: a choice's first delta is
               handled where it arrives, and starts the response with its chunk
    STREAMING  the task waits, the response started (or is aggregated): deltas are handled at the
               end of the loop pass they arrive in (deltas of one choice that arrive in the same
               pass merge first), in arrival order
    BLOCKED    the task acts (it awaits a write, leaves a choice), or it waits on a server that
               cannot write without it: deltas queue for the task
    FINISHING  the task writes the end; nothing is handled without it

    PLACING -> (park) FIRST | STREAMING | BLOCKED -> (wake) BLOCKED -> (park) ... -> FINISHING

Order is kept: a delta is handled without the task only while the task waits with nothing queued,
and that is what STREAMING and FIRST mean: whatever queues for the task wakes it (`queue` is only
appended to together with `wake`), which makes the phase BLOCKED until the task parks again, with
its queue empty. So the phase alone says where a
delta goes (tandem.frontend.respond, `_Response.ready`): FIRST, at once; STREAMING, at the end of
the pass, if the phase is still STREAMING then; otherwise to the task. What such handling could
not finish (a chunk the server refused now, a choice a stop string ended, an error) goes to the
task too: `out`, `leaving`, `crash`, and the task is woken.
"""

from __future__ import annotations

from collections import deque

PLACING, FIRST, STREAMING, BLOCKED, FINISHING = range(5)
PHASES = ("placing", "waiting for the first delta", "streaming", "writer blocked", "finishing")

__all__ = ["BLOCKED", "FINISHING", "FIRST", "PHASES", "PLACING", "STREAMING", "ResponseState"]


class ResponseState:
    """One response's phase and what waits for its task. `stream`: SSE (else one JSON body);
    `push`: the server can write a chunk now (else every delta of a stream is the task's); `first`:
    it can also start a response now with its first chunk."""

    __slots__ = ("phase", "queue", "out", "leaving", "crash", "_later", "_first")

    def __init__(self, stream: bool, push: bool, first: bool) -> None:
        self.phase = PLACING
        self.queue: deque[int] = deque()  # choices whose delta is the task's (appended: then wake)
        self.out: list[bytes] = []  # produced, not written yet: the task writes it
        self.leaving: list[int] = []  # choices a stop string ended: the task leaves them
        self.crash: BaseException | None = None  # what handling a delta raised: the task raises it
        # Where the task parks: for a started (or aggregated) response, and for an unstarted one.
        self._later = STREAMING if push or not stream else BLOCKED
        self._first = (FIRST if push and first else BLOCKED) if stream else STREAMING

    def park(self, started: bool) -> None:
        """The task waits (it had no work; or a first delta was handled where it arrived, leaving
        it nothing): FIRST, STREAMING or BLOCKED, by what the server offers."""
        self.phase = self._later if started else self._first

    def wake(self) -> None:
        """The task acts: until it parks again, what arrives queues for it."""
        if self.phase != FINISHING:
            self.phase = BLOCKED

    def finish(self) -> None:
        self.phase = FINISHING

    def left_over(self, data: bytes) -> None:
        """A chunk the server could not take now: the task writes it (starting first)."""
        self.out.append(data)

    def stopped(self, i: int) -> None:
        """A stop string ended choice `i`: the task leaves its request."""
        self.leaving.append(i)

    def failed(self, e: BaseException) -> None:
        self.crash = e
