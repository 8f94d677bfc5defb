"""The reference engine's side of disaggregated prefill/decode (DESIGN §1 steps 3-5): the KV
handoff of one request, on the event loop, between the step thread's work.

Prefill engine (`prefill_side` set, the request carries a `bootstrap`): the request holds pages for
its prompt, the step thread prefills it and samples the first token like any prefill, and the
sequence leaves the batch as SENDING with its pages. Then `PrefillSide.wait_room` (awaited from
the start, alongside the compute) says where the decode engine wants the K/V, `PrefillSide.send`
WRITEs it there and tells the decode side, the pages are freed once the write has ended, and the
request ends with one output: the first token, finish "length". Any end before `send` calls
`PrefillSide.fail`, so the decode side learns at once.

Decode engine (`decode_side` set, the request carries a `bootstrap`): admission reserves pages for
the whole request (queueing like any request while the pool cannot), then `DecodeSide.fetch` gets
the prompt's K/V into them and returns the first token; `Scheduler.join` commits the pages and the
sequence decodes on from there. While the fetch is under way (`seq.kv_busy`) its pages belong to
it: on failure or abort the fetch calls our release callback once nothing can write into them any
more, possibly after the request has ended. Nothing else frees them.

Page owners in the pool are unique per request (`Sequence.owner`), so a release that comes late can
never free the pages of a newer request with the same rid.
"""

from __future__ import annotations

import asyncio
import threading
from functools import partial
from typing import Any

from tandem.engines.base import EngineError, EngineOutput
from tandem.engines.reference.scheduler import Scheduler, Sequence, SeqStatus
from tandem.engines.reference.stream import Emit, Stream, race
from tandem.kv.handoff import DecodeSide, KvHandoffError, PrefillSide
from tandem.kv.pages import PagePool
from tandem.runtime.wire import Bootstrap


def _ended(emit: Emit, prompt_tokens: int) -> EngineOutput:
    if emit.error:
        raise EngineError(emit.error)
    return EngineOutput([], emit.finish or "abort", prompt_tokens, 0)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if task.done() and not task.cancelled():
        task.exception()  # no "exception was never retrieved" for a task nobody awaits any more


class PdMixin:
    """KV handoff for ReferenceEngine; uses its lock, scheduler and pool."""

    prefill_side: PrefillSide | None
    decode_side: DecodeSide | None
    pool: PagePool
    _sched: Scheduler
    _wake: threading.Condition
    _stopping: bool

    # --- prefill engine ---------------------------------------------------------------------------
    async def _prefill_handoff(self, stream: Stream, bootstrap: Bootstrap) -> EngineOutput:
        side = self.prefill_side
        assert side is not None
        seq, room = stream.seq, bootstrap.room
        n = len(seq.prompt_ids)
        room_task = asyncio.ensure_future(side.wait_room(room))
        send_task: asyncio.Future[None] | None = None
        why = "the prefill request was aborted"
        try:
            emit = await stream.queue.get()  # the prefill step's first token, or the end
            if emit.error:
                why = emit.error
            if emit.error or emit.finish is not None:
                return _ended(emit, n)
            first = emit.new_ids[0]
            if (end := await race(stream.queue, room_task)) is not None:
                return _ended(end, n)
            try:
                dest = room_task.result()
            except KvHandoffError as e:
                why = str(e)
                raise EngineError(f"KV handoff failed: {e}") from e
            with self._wake:
                if seq.status is not SeqStatus.SENDING:  # aborted as the room arrived
                    return EngineOutput([], "abort", n, 0)
                seq.kv_busy = True  # from here only the end of the write frees the pages
            send_task = asyncio.ensure_future(side.send(room, dest, list(seq.pages), first))
            send_task.add_done_callback(partial(self._sent, seq))
            if (end := await race(stream.queue, send_task)) is not None:
                return _ended(end, n)  # the write goes on; its end frees the pages
            try:
                send_task.result()
            except KvHandoffError as e:
                raise EngineError(f"KV handoff failed: {e}") from e
            return EngineOutput([first], "length", n, 1)
        finally:
            room_task.cancel()
            _retrieve(room_task)
            if send_task is None:
                side.fail(room, why)
                self._release_sending(seq)

    def _sent(self, seq: Sequence, task: asyncio.Future[None]) -> None:
        _retrieve(task)
        self._release_sending(seq)

    def _release_sending(self, seq: Sequence) -> None:
        with self._wake:
            if seq.status is SeqStatus.SENDING:
                self._sched.finish(seq, "abort" if seq.abort_requested else "length")
                self._wake.notify()

    # --- decode engine ----------------------------------------------------------------------------
    async def _decode_handoff(self, stream: Stream, bootstrap: Bootstrap) -> EngineOutput | None:
        """Fetch the prompt's K/V and queue the first token on `stream`; returns None then, or the
        request's last output if it ended before decoding (abort); raises EngineError."""
        side = self.decode_side
        assert side is not None
        seq = stream.seq
        n = len(seq.prompt_ids)
        emit = await stream.queue.get()  # the pages are reserved, or the request ended waiting
        if emit.error or emit.finish is not None:
            return _ended(emit, n)
        if seq.status is not SeqStatus.FETCHING or seq.abort_requested:
            return EngineOutput([], "abort", n, 0)
        entered = False

        async def fetch() -> int:
            nonlocal entered
            entered = True  # from here the fetch releases the pages on every failure
            pages = seq.pages[: self.pool.pages_for(n)]
            return await side.fetch(bootstrap, pages, partial(self._release_fetching, seq))

        def fetch_done(task: asyncio.Future[int]) -> None:
            _retrieve(task)
            if task.cancelled() and not entered:  # cancelled before it began: nobody else will
                self._release_fetching(seq)

        task = asyncio.ensure_future(fetch())
        seq.kv_busy = True
        task.add_done_callback(fetch_done)
        committed = False
        try:
            if (end := await race(stream.queue, task)) is not None:
                return _ended(end, n)
            try:
                first = task.result()
            except KvHandoffError as e:
                raise EngineError(f"KV handoff failed: {e}") from e
            with self._wake:
                if seq.abort_requested or self._stopping or seq.status is not SeqStatus.FETCHING:
                    self._sched.finish(seq, "abort")  # the K/V is in: nothing writes any more
                    return EngineOutput([], "abort", n, 0)
                finish = self._sched.join(seq, first)
                committed = True
                self._wake.notify()
            stream.queue.put_nowait(Emit(seq, [first], finish))  # out at once: the client's TTFT
            return None
        finally:
            if not committed:
                if not task.done():
                    task.cancel()  # the fetch quarantines the pages and releases them itself
                elif not task.cancelled() and task.exception() is None:
                    self._release_fetching(seq)  # the K/V arrived, but nobody will use it

    def _release_fetching(self, seq: Sequence) -> None:
        """The fetch's release callback: the pages are safe to reuse. Idempotent; thread-safe."""
        with self._wake:
            if seq.status is SeqStatus.FETCHING:
                self._sched.finish(seq, "abort")
                self._wake.notify()
