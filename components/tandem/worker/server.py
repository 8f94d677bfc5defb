"""WorkerServer: one engine served to any number of frontends over a ZMQ ROUTER socket
(ARCHITECTURE.md, "Worker").

It owns the receive loop (one typed decoder: wire.TO_WORKER), the dispatch of what frontends
send, and the request registry. Every request goes to `engine.submit(req, self)`: the server is
the engine's one output sink, and `on_step(outputs)` is the worker's one loop over engine outputs:
each output becomes a delta (tandem.worker.deltas.DeltaMaker, one per request) for the frontend
that sent the request (tandem.worker.frontends: outboxes, credit, flushing). A failed request's
last delta carries the wire ErrorKind of its EngineError (`err.kind`).

An `Abort`, a frontend that goes away or stays silent while owing credit, or the end of the drain
cancels a request through its handle, which frees its pages. Draining (on stop): no new work is
taken; in-flight requests get the drain deadline to finish, then end with an error; what the
outboxes hold is sent past the window before the socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq

from tandem.config import WorkerConfig
from tandem.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Handle
from tandem.runtime import transport, wire
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.wire import (
    Abort,
    Credit,
    Delta,
    Deltas,
    ErrorKind,
    Generate,
    Generates,
    Hello,
    HelloReply,
    LoadQuery,
    LoadReport,
    WorkerInfo,
)
from tandem.worker.deltas import DeltaMaker
from tandem.worker.frontends import Frontends

log = logging.getLogger("tandem.worker")


class _Request:
    __slots__ = ("ident", "maker", "handle")

    def __init__(self, ident: bytes, maker: DeltaMaker, handle: Handle) -> None:
        self.ident, self.maker, self.handle = ident, maker, handle


class WorkerServer:
    def __init__(self, cfg: WorkerConfig, engine: Engine, info: WorkerInfo) -> None:
        self.cfg = cfg
        self.engine = engine
        self.info = info
        self.frontends = Frontends(cfg.delta_window, cfg.delta_batch, self._send, engine.load)
        self._sock: zmq.asyncio.Socket | None = None
        self._requests: dict[str, _Request] = {}
        self._draining = False
        self._progress = asyncio.Event()  # while draining: a request ended or a delta left

    @property
    def address(self) -> str:
        return f"tcp://{self.cfg.host}:{self.cfg.port}"

    @property
    def num_requests(self) -> int:
        """Requests in flight (submitted, not ended)."""
        return len(self._requests)

    @property
    def ready(self) -> bool:
        """Serving and taking work (bound, not draining)."""
        return self._sock is not None and not self._draining

    async def run(self, stop: asyncio.Event) -> None:
        self._sock = transport.router(self.address)
        log.info("worker %s (%s, %s) listening on %s", self.info.name, self.info.role,
                 self.info.engine, self.address)
        tasks = TaskGroup()
        tasks.spawn(self._recv_loop(), name="worker-recv")
        tasks.spawn(self._reap_silent_frontends(), name="worker-reaper")
        try:
            await stop.wait()
            await self.drain(self.cfg.drain_timeout_s)
        finally:
            await tasks.close()
            for rid in list(self._requests):  # (drain did this unless it was cut short)
                self._end(rid, ErrorKind.DRAINING, "the worker shut down")
            self.frontends.flush(force=True)  # the last words, past the window
            self._sock.close(linger=1000)  # ms for those last words to leave

    async def drain(self, timeout: float) -> None:
        """Take no new work; give in-flight requests (and their undelivered deltas) `timeout`
        seconds, then end the rest with an error."""
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._requests or self.frontends.pending:
            left = deadline - loop.time()
            if left <= 0:
                break
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)
        for rid in list(self._requests):
            self._end(rid, ErrorKind.DRAINING,
                      f"the worker shut down: not finished within its {timeout:g}s drain")

    # --- the engine's output sink: the worker's one loop over outputs -----------------------------
    def on_step(self, outputs: list[EngineOutput]) -> None:
        requests, emit = self._requests, self.frontends.emit
        for out in outputs:
            r = requests.get(out.rid)
            if r is None:
                continue
            if out.error is not None:
                self._fail(out.rid, r, out.error)
                continue
            try:
                delta = r.maker.make(out)
            except EngineError as e:  # out of step with what was sent: stop it, loudly
                r.handle.cancel()
                self._fail(out.rid, r, e)
                continue
            if delta is not None:
                emit(r.ident, delta)
            if out.finish_reason is not None:
                del requests[out.rid]
        if self._draining:
            self._progress.set()

    def _fail(self, rid: str, r: _Request, err: EngineError) -> None:
        if err.kind is ErrorKind.ENGINE:
            log.error("%s: engine error: %s", rid, err)
        self._requests.pop(rid, None)
        self.frontends.emit(r.ident, Delta(rid, r.maker.sent, [], "error", error=str(err),
                                           error_kind=err.kind))

    def _end(self, rid: str, kind: ErrorKind, why: str) -> None:
        """Cancel a request and tell its frontend why."""
        r = self._requests.pop(rid, None)
        if r is not None:
            r.handle.cancel()
            self.frontends.emit(r.ident, Delta(rid, r.maker.sent, [], "error", error=why,
                                               error_kind=kind))

    # --- receiving --------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self._sock is not None
        async for ident, msg in transport.router_messages(self._sock, wire.TO_WORKER, log):
            self.frontends.heard(ident)
            if isinstance(msg, Credit):
                self.frontends.credit(ident, msg.n)
                if self._draining:
                    self._progress.set()
            elif isinstance(msg, Generates):
                for g in msg.items:
                    self._on_generate(ident, g)
            elif isinstance(msg, Abort):
                for rid in msg.rids:
                    r = self._requests.pop(rid, None)
                    if r is not None:
                        r.handle.cancel()  # frees the pages; the frontend already knows
            elif isinstance(msg, LoadQuery):
                self._send(ident, LoadReport(msg.seq, self.engine.load()))
            elif isinstance(msg, Hello):
                self._on_hello(ident, msg)

    def _on_hello(self, ident: bytes, msg: Hello) -> None:
        self.frontends.hello(ident)
        if msg.version != wire.PROTOCOL_VERSION:
            err = f"protocol version {msg.version} != worker's {wire.PROTOCOL_VERSION}"
            self._send(ident, HelloReply(wire.PROTOCOL_VERSION, False, None, err))
            return
        self._send(ident, HelloReply(wire.PROTOCOL_VERSION, True, self.info))

    def _on_generate(self, ident: bytes, msg: Generate) -> None:
        def refuse(kind: ErrorKind, why: str) -> None:
            self.frontends.emit(ident, Delta(msg.rid, 0, [], "error", error=why, error_kind=kind))

        if self._draining:
            return refuse(ErrorKind.DRAINING, "worker is draining")
        if msg.rid in self._requests:
            return refuse(ErrorKind.DUPLICATE, "duplicate request id")
        req = EngineRequest(msg.rid, msg.prompt_ids, msg.sampling, msg.bootstrap)
        try:
            handle = self.engine.submit(req, self)
        except EngineError as e:
            return refuse(e.kind, str(e))
        self._requests[msg.rid] = _Request(ident, DeltaMaker(msg.rid, self.engine.output_mode),
                                           handle)

    async def _reap_silent_frontends(self) -> None:
        limit = self.cfg.frontend_silent_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            for ident in self.frontends.silent(limit):
                why = (f"the frontend was silent for over {limit:g}s while the worker held its "
                       "tokens")
                log.warning("frontend %r: %s; ending its requests", ident, why)
                self._drop_frontend(ident, why)

    # --- sending ----------------------------------------------------------------------------------
    def _send(self, ident: bytes, msg: wire._Tagged) -> None:
        assert self._sock is not None
        try:
            transport.send_nowait(self._sock, msg, ident)
        except zmq.ZMQError as e:
            # The frontend is gone (EHOSTUNREACH) or not reading (EAGAIN past the HWM): its
            # requests cannot be delivered, so stop them and free their pages.
            log.warning("frontend %r unreachable (%s): cancelling its requests", ident, e)
            self._drop_frontend(ident)
        if self._draining and isinstance(msg, Deltas):
            self._progress.set()

    def _drop_frontend(self, ident: bytes, why: str = "") -> None:
        """Stop every request of a frontend. With `why` it may still be there (silent, not gone):
        each request ends with an error delta, and its outbox goes out now, past the window."""
        for rid, r in list(self._requests.items()):
            if r.ident == ident:
                if why:
                    self._end(rid, ErrorKind.FRONTEND_SILENT, why)
                else:
                    del self._requests[rid]
                    r.handle.cancel()
        self.frontends.drop(ident, last_words=bool(why))
