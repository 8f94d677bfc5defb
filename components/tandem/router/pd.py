"""PDStream: one request served by a prefill worker and a decode worker at once (dual dispatch).

The same Generate (with `bootstrap = (P's bootstrap host, port, room)`) goes to P and to D. The
client reads D's deltas. A task owned by the stream watches P's answer: if P fails, the failure is
pushed into D's stream so the client gets it, and leaving the stream aborts D (whose pages the
handoff quarantines until no write can land). Leaving the stream early cancels and awaits the
watcher, which aborts P.
"""

from __future__ import annotations

import asyncio
import contextlib

from tandem.router.client import RequestStream, WorkerClient
from tandem.runtime import errors
from tandem.runtime.wire import Bootstrap, Delta, Generate


class PDStream:
    __slots__ = ("rid", "prefill", "decode", "_watcher")

    def __init__(self, p: WorkerClient, d: WorkerClient, msg: Generate) -> None:
        self.rid = msg.rid
        self.prefill = RequestStream(p, msg)
        self.decode = RequestStream(d, msg)
        self._watcher: asyncio.Task[None] | None = None

    @property
    def received(self) -> int:
        return self.decode.received

    @property
    def finished(self) -> bool:
        return self.decode.finished

    def start(self) -> None:
        """Send the request to D, then P (synchronous, so the router can place it in one step)."""
        self.decode.start()
        try:
            self.prefill.start()
        except BaseException:
            self.decode.release()
            raise

    def release(self) -> None:
        """Undo `start` before the stream was entered (its client went away while placed)."""
        self.decode.release()
        self.prefill.release()

    async def __aenter__(self) -> PDStream:
        if not self.decode._opened:
            self.start()
        self._watcher = asyncio.get_running_loop().create_task(self._watch_prefill())
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.decode.__aexit__(*exc)
        finally:
            w, self._watcher = self._watcher, None
            if w is not None:
                if not w.done():
                    w.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await w

    async def _watch_prefill(self) -> None:
        # The prefill stream was entered in __aenter__; leaving it here aborts P if unfinished.
        try:
            try:
                async for _ in self.prefill:
                    pass
            finally:
                await self.prefill.__aexit__(None, None, None)
        except errors.TandemError as e:
            if not self.decode.finished:
                cls = type(e) if isinstance(e, (errors.WorkerLost, errors.Unavailable)) \
                    else errors.EngineFailed
                self.decode.push(cls(f"prefill failed: {e.message}"))

    def __aiter__(self) -> PDStream:
        return self

    def waiting(self) -> int:
        return self.decode.waiting()

    async def __anext__(self) -> Delta:
        return await self.decode.__anext__()


def bootstrap_of(p: WorkerClient, room: int) -> Bootstrap:
    assert p.info is not None and p.info.bootstrap_addr
    host, _, port = p.info.bootstrap_addr.rpartition(":")
    return Bootstrap(host, int(port), room)
