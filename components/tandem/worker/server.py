"""WorkerServer: one engine served to any number of frontends over a ZMQ ROUTER socket.

Per frontend it keeps an Outbox (tandem.worker.outbox): every delta produced while the event loop
runs one iteration is sent as ONE `Deltas` message on the next iteration, so the wire carries at
most one message per engine step per frontend, never one per token; and at most `delta_window`
messages are in flight to a frontend: while it owes credit, a request's new tokens merge into its
waiting delta. A frontend that owes credit and stays silent past `frontend_silent_s` loses its
requests: each ends with an error delta, sent at once with what its outbox held.

Per request a `_Served` turns engine outputs into deltas. An engine with the fast path
(`open_stream`) calls it from its own step; otherwise one task per request drives
`engine.generate`. An `Abort`, the frontend going away, or shutdown cancels the request (the
handle, or the task, whose cancellation closes the engine's iterator), which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq

from tandem.engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    StreamHandle,
)
from tandem.runtime import wire, transport
from tandem.config import DRAIN_TIMEOUT_S, WorkerConfig
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
from tandem.worker.outbox import Outbox

log = logging.getLogger("tandem.worker")


class WorkerServer:
    def __init__(self, cfg: WorkerConfig, engine: Engine, info: WorkerInfo) -> None:
        self.cfg = cfg
        self.engine = engine
        self.info = info
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks = TaskGroup()
        self._requests: dict[str, _Served] = {}
        self._outboxes: dict[bytes, Outbox] = {}
        self._flush_scheduled = False
        self._draining = False

    @property
    def address(self) -> str:
        return f"tcp://{self.cfg.host}:{self.cfg.port}"

    async def run(self, stop: asyncio.Event) -> None:
        self._sock = transport.router(self.address)
        log.info("worker %s (%s, %s) listening on %s", self.info.name, self.info.role,
                 self.info.engine, self.address)
        loop = asyncio.get_running_loop()
        recv = loop.create_task(self._recv_loop(), name="worker-recv")
        reaper = loop.create_task(self._reap_silent_frontends(), name="worker-reaper")
        try:
            await stop.wait()
            await self.drain(DRAIN_TIMEOUT_S)
        finally:
            recv.cancel()
            reaper.cancel()
            await asyncio.gather(recv, reaper, return_exceptions=True)
            for rid in list(self._requests):  # (drain did this unless it was cut short)
                self._cancel(rid)
            await self._tasks.close()
            self._flush(force=True)  # the last words: past the window, the frontends can take it
            self._sock.close(linger=1000)  # ms for those last words to leave

    async def drain(self, timeout: float) -> None:
        """Take no new work; give in-flight requests `timeout` seconds, then abort the rest."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while (self._requests or any(self._outboxes.values())) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._requests):
            self._cancel(rid)  # (run() awaits the tasks of engines without the fast path)

    # --- receiving --------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        assert self._sock is not None
        async for ident, msg in transport.router_messages(self._sock, wire.TO_WORKER, log):
            box = self._outboxes.get(ident)
            if box is not None:
                box.last_heard = time.monotonic()
            if isinstance(msg, Credit):
                if box is not None:
                    box.credit(msg.n)
                    if box.can_send:
                        self._send_box(ident, box)
            elif isinstance(msg, Generates):
                for g in msg.items:
                    self._on_generate(ident, g)
            elif isinstance(msg, Abort):
                for rid in msg.rids:
                    self._cancel(rid)
            elif isinstance(msg, LoadQuery):
                self._send(ident, LoadReport(msg.seq, self.engine.load()))
            elif isinstance(msg, Hello):
                self._on_hello(ident, msg)

    def _on_hello(self, ident: bytes, msg: Hello) -> None:
        box = self._outboxes.get(ident)
        if box is not None:
            box.reset()  # a new connection: credit owed on the old one will not come
        if msg.version != wire.PROTOCOL_VERSION:
            err = f"protocol version {msg.version} != worker's {wire.PROTOCOL_VERSION}"
            self._send(ident, HelloReply(wire.PROTOCOL_VERSION, False, None, err))
            return
        self._send(ident, HelloReply(wire.PROTOCOL_VERSION, True, self.info))

    def _on_generate(self, ident: bytes, msg: Generate) -> None:
        if self._draining:
            self._emit(ident, Delta(msg.rid, 0, [], "error", error="worker is draining",
                                        error_kind=ErrorKind.DRAINING))
            return
        if msg.rid in self._requests:
            self._emit(ident, Delta(msg.rid, 0, [], "error", error="duplicate request id",
                                        error_kind=ErrorKind.DUPLICATE))
            return
        req = EngineRequest(msg.rid, msg.prompt_ids, msg.sampling, msg.bootstrap)
        served = _Served(self, ident, req.rid, DeltaMaker(req.rid, self.engine.output_mode))
        try:
            handle = self.engine.open_stream(req, served)
        except EngineError as e:
            served.fail(e)
            return
        if handle is None:  # no fast path: a task drives the engine's iterator
            handle = self._tasks.spawn(self._serve(served, req), name=msg.rid)
        served.handle = handle
        self._requests[msg.rid] = served

    def _cancel(self, rid: str) -> None:
        served = self._requests.pop(rid, None)
        if served is not None and served.handle is not None:
            served.handle.cancel()  # frees the pages (a task: once its iterator is closed)

    # --- one request ------------------------------------------------------------------------------
    async def _serve(self, served: _Served, req: EngineRequest) -> None:
        try:
            gen = self.engine.generate(req)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    served.deliver(out)
        except asyncio.CancelledError:
            pass  # aborted: the frontend already knows; aclosing freed the pages
        except EngineError as e:
            served.fail(e)
        except Exception as e:  # an engine bug must fail one request, not the worker
            log.exception("%s: unexpected engine failure", req.rid)
            served.fail(EngineError(f"engine failed: {e}"))
        finally:
            if self._requests.get(req.rid) is served:
                del self._requests[req.rid]

    async def _reap_silent_frontends(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.cfg.frontend_silent_s / 4))
            now = time.monotonic()
            for ident, box in list(self._outboxes.items()):
                if box.in_flight and now - box.last_heard > self.cfg.frontend_silent_s:
                    why = (f"the frontend was silent for over {self.cfg.frontend_silent_s:g}s "
                           "while the worker held its tokens")
                    log.warning("frontend %r: %s; aborting its requests", ident, why)
                    self._abort_frontend(ident, why)

    # --- sending: one Deltas message per loop iteration per frontend, within its window ----------
    def _emit(self, ident: bytes, delta: Delta) -> None:
        box = self._outboxes.get(ident)
        if box is None:
            box = self._outboxes[ident] = Outbox(self.cfg.delta_window, self.cfg.delta_batch)
        box.add(delta)
        if not self._flush_scheduled and (box.in_flight < box.window or delta.offset == 0):
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self, force: bool = False) -> None:
        self._flush_scheduled = False
        for ident, box in list(self._outboxes.items()):
            if force and len(box):
                self._send(ident, Deltas(box.take(everything=True), self.engine.load()))
            elif box.can_send:
                self._send_box(ident, box)
            elif box.has_first:  # the window is full: first tokens go on their own
                self._send(ident, Deltas(box.take_first(), self.engine.load()))

    def _send_box(self, ident: bytes, box: Outbox) -> None:
        self._send(ident, Deltas(box.take(), self.engine.load()))

    def _send(self, ident: bytes, msg: wire._Tagged) -> None:
        assert self._sock is not None
        try:
            transport.send_nowait(self._sock, msg, ident)
        except zmq.ZMQError as e:
            # The frontend is gone (EHOSTUNREACH) or not reading (EAGAIN past the HWM): its
            # requests cannot be delivered, so stop them and free their pages.
            log.warning("frontend %r unreachable (%s): aborting its requests", ident, e)
            self._abort_frontend(ident)

    def _abort_frontend(self, ident: bytes, why: str = "") -> None:
        """Stop every request of a frontend. With `why` it may still be there (silent, not gone):
        each request ends with an error delta, and what its outbox holds goes out now, past the
        window (ZMQ keeps it for a frontend that resumes; a gone one makes the send fail)."""
        for rid, served in list(self._requests.items()):
            if served.ident == ident:
                self._cancel(rid)
                if why:
                    self._emit(ident, Delta(rid, served.maker.sent, [], "error", error=why,
                                            error_kind=ErrorKind.FRONTEND_SILENT))
        box = self._outboxes.pop(ident, None)
        if why and box is not None and len(box):
            self._send(ident, Deltas(box.take(everything=True), self.engine.load()))


class _Served:
    """One request being served: the engine's output sink (tandem.engines.base.OutputSink), which
    turns outputs into deltas for the frontend that sent the request."""

    __slots__ = ("server", "ident", "rid", "maker", "handle")

    def __init__(self, server: WorkerServer, ident: bytes, rid: str, maker: DeltaMaker) -> None:
        self.server = server
        self.ident = ident
        self.rid = rid
        self.maker = maker
        self.handle: StreamHandle | None = None

    def deliver(self, out: EngineOutput) -> None:
        """One output; raises EngineError when it is out of step with what was sent."""
        delta = self.maker.make(out)
        if delta is not None:
            self.server._emit(self.ident, delta)
        if out.finish_reason is not None:
            self._done()

    def put(self, out: EngineOutput) -> None:
        """The fast path's delivery, from inside the engine's step: never raises into it."""
        try:
            self.deliver(out)
        except EngineError as e:
            if self.handle is not None:
                self.handle.cancel()
            self.fail(e)

    def fail(self, err: EngineError) -> None:
        if isinstance(err, EngineRequestError):
            kind = ErrorKind.BAD_REQUEST
        else:
            kind = ErrorKind.ENGINE
            log.error("%s: engine error: %s", self.rid, err)
        self._done()
        self.server._emit(self.ident, Delta(self.rid, self.maker.sent, [], "error", error=str(err),
                                            error_kind=kind))

    def _done(self) -> None:
        requests = self.server._requests
        if requests.get(self.rid) is self:
            del requests[self.rid]
