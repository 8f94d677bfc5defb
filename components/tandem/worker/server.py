"""WorkerServer: one engine served to any number of frontends over a ZMQ ROUTER socket
(ARCHITECTURE.md, "Worker").

It is written against a `RouterChannel` (tandem.runtime.channel: a ZMQ ROUTER bound at the
worker's address, decoding wire.TO_WORKER, or a MemoryRouter in tests) and owns the dispatch of
what frontends send (through the one receive loop, `channel.serve`) and the request registry. Every request goes to `engine.submit(req, self)`: the server is
the engine's one output sink, and `on_step(outputs)` is the worker's one loop over engine outputs:
each output becomes a delta (tandem.worker.deltas.DeltaMaker, one per request) for the frontend
that sent the request (tandem.worker.frontends: outboxes, credit, flushing). A failed request's
last delta carries the wire ErrorKind of its EngineError (`err.kind`).

An `Abort`, a frontend that goes away or stays silent while owing credit, or the end of the drain
cancels a request through its handle, which frees its pages. Draining (on stop): no new work is
taken; in-flight requests get the drain deadline to finish, then end with an error; what the
outboxes hold is sent past the window before the socket closes. From the moment draining starts,
every `Load` the worker reports says `draining`, so routers stop placing work here.

Nothing a peer sends can end the receive loop or reach the engine unchecked: undecodable frames
are dropped by the transport; a `Generate` that fails tandem.worker.validate gets an error delta
(BAD_REQUEST) and never reaches the engine; so does, on a decode worker, a `Generate` whose
bootstrap is not a prefill worker its frontend announced (`Prefills`): the decode side connects,
sends its transfer metadata and opens its pages only to those; a `Credit` that is not positive is
ignored (one above what is in flight is clamped); an `Abort` only ends requests the same
connection (ZMQ identity) sent; a handler that still fails on some input drops that one message.
Each is counted in `transport.protocol_errors` ("worker", what), and so is each peer whose security
handshake failed (no keys, or another cluster's: it never gets to send a message). The receive
loop, the reaper and that count are supervised: if one dies anyway, the process goes down
(tandem.runtime.lifecycle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from tandem.config import WorkerConfig
from tandem.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Handle
from tandem.runtime import timeline, transport, wire
from tandem.runtime.channel import ChannelFull, RouterChannel, ZmqRouterChannel, serve
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.wire import (
    OutputMode,
    Abort,
    Credit,
    Delta,
    Deltas,
    ErrorKind,
    Generate,
    Generates,
    Hello,
    HelloReply,
    Load,
    LoadQuery,
    LoadReport,
    Prefills,
    WorkerInfo,
)
from tandem.worker.deltas import DeltaMaker
from tandem.worker.frontends import Frontends
from tandem.worker.validate import MAX_RID_CHARS, Limits, check_generate, check_prefills

log = logging.getLogger("tandem.worker")


class _Request(DeltaMaker):
    """A request in flight: its frontend, its engine handle, and its DeltaMaker (one object)."""

    __slots__ = ("ident", "handle")

    def __init__(self, rid: str, mode: OutputMode, ident: bytes, handle: Handle) -> None:
        super().__init__(rid, mode)
        self.ident, self.handle = ident, handle


FrontendsChannel = RouterChannel[wire.Message, wire.ToWorker]


class WorkerServer:
    def __init__(self, cfg: WorkerConfig, engine: Engine, info: WorkerInfo,
                 channel: FrontendsChannel | None = None) -> None:
        """`channel`: where frontends reach it; by default `run` binds a ZMQ ROUTER at
        `address`."""
        self.cfg = cfg
        self.engine = engine
        self.info = info
        self.frontends = Frontends(cfg.delta_window, cfg.delta_batch, self._send, self.load)
        spec = getattr(engine, "spec", None)
        self.limits = Limits(getattr(spec, "vocab_size", 0) or 0,
                             getattr(spec, "max_context", 0) or 0)
        self._channel = channel
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
        return self._channel is not None and not self._draining

    @property
    def draining(self) -> bool:
        return self._draining

    def load(self) -> Load:
        """The engine's load, marked `draining` once the worker takes no new work."""
        load = self.engine.load()
        return msgspec.structs.replace(load, draining=True) if self._draining else load

    async def run(self, stop: asyncio.Event) -> None:
        if self._channel is None:
            self._channel = ZmqRouterChannel(self.address, wire.TO_WORKER, log)
        channel = self._channel
        log.info("worker %s (%s, %s) listening on %s", self.info.name, self.info.role,
                 self.info.engine, self.address)
        tasks = TaskGroup(supervised=True)  # without these the worker is useless: a death is fatal
        tasks.spawn(serve(channel, self.dispatch, "worker", log), name="worker-recv")
        tasks.spawn(self._reap_silent_frontends(), name="worker-reaper")
        tasks.spawn(channel.count_refused_handshakes("worker", log), name="worker-handshakes")
        try:
            await stop.wait()
            await self.drain(self.cfg.drain_timeout_s)
        finally:
            await tasks.close()
            for rid in list(self._requests):  # (drain did this unless it was cut short)
                self._end(rid, ErrorKind.DRAINING, "the worker shut down")
            self.frontends.flush(force=True)  # the last words, past the window
            channel.close(linger_s=1.0)  # for those last words to leave

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
        requests, emit = self._requests, self.frontends.emit_all
        if timeline.ON:
            self._mark_first(outputs)
        ident = b""
        deltas: list[Delta] = []  # for `ident`, in order (one frontend, usually)
        for out in outputs:
            r = requests.get(out.rid)
            if r is None:
                continue
            if r.ident != ident:
                if deltas:
                    emit(ident, deltas)
                    deltas = []
                ident = r.ident
            err = out.error
            if err is None:
                try:
                    delta = r.make(out)
                except EngineError as e:  # out of step with what was sent: stop it, loudly
                    r.handle.cancel()
                    err = e
            if err is not None:
                if deltas:  # (in order: _fail emits on its own)
                    emit(ident, deltas)
                    deltas = []
                self._fail(out.rid, r, err)
                continue
            if delta is not None:
                deltas.append(delta)
            if out.finish_reason is not None:
                del requests[out.rid]
        if deltas:
            emit(ident, deltas)
        if self._draining:
            self._progress.set()

    def _mark_first(self, outputs: list[EngineOutput]) -> None:
        """The requests whose first tokens these outputs carry (tandem.runtime.timeline)."""
        for out in outputs:
            r = self._requests.get(out.rid)
            if r is not None and not r.sent and out.completion_tokens:
                timeline.mark("out", out.rid)

    def _fail(self, rid: str, r: _Request, err: EngineError) -> None:
        if err.kind is ErrorKind.ENGINE:
            log.error("%s: engine error: %s", rid, err)
        self._requests.pop(rid, None)
        self.frontends.emit(r.ident, Delta(rid, r.sent, [], "error", error=str(err),
                                           error_kind=err.kind, error_param=err.param))

    def _end(self, rid: str, kind: ErrorKind, why: str) -> None:
        """Cancel a request and tell its frontend why."""
        r = self._requests.pop(rid, None)
        if r is not None:
            r.handle.cancel()
            self.frontends.emit(r.ident, Delta(rid, r.sent, [], "error", error=why,
                                               error_kind=kind))

    # --- receiving --------------------------------------------------------------------------------
    def dispatch(self, item: tuple[bytes, wire.ToWorker]) -> None:
        """One message from a frontend (identity, message): the receive loop's handler."""
        ident, msg = item
        self.frontends.heard(ident)
        if isinstance(msg, Credit):
            self._on_credit(ident, msg.n)
        elif isinstance(msg, Generates):
            for g in msg.items:
                self._on_generate(ident, g)
        elif isinstance(msg, Abort):
            for rid in msg.rids:
                r = self._requests.get(rid)
                if r is None:
                    continue  # ended already (the race is normal)
                if r.ident != ident:  # not this connection's request: refuse, count
                    transport.refused("worker", "abort of another frontend's request", log)
                    continue
                del self._requests[rid]
                r.handle.cancel()  # frees the pages; the frontend already knows
        elif isinstance(msg, LoadQuery):
            self._send(ident, LoadReport(msg.seq, self.load()))
        elif isinstance(msg, Hello):
            self._on_hello(ident, msg)
        elif isinstance(msg, Prefills):
            why = check_prefills(msg.addresses)
            if why is not None:
                return transport.refused("worker", "bad prefills", log, why)
            self.frontends.announce(ident, frozenset(msg.addresses))

    def _on_credit(self, ident: bytes, n: int) -> None:
        if n <= 0:  # would grow what is in flight and close the window for good
            return transport.refused("worker", "credit not positive", log, n)
        self.frontends.credit(ident, n)  # more than is in flight is clamped there (floor 0)
        if self._draining:
            self._progress.set()

    def _on_hello(self, ident: bytes, msg: Hello) -> None:
        self.frontends.hello(ident)
        if msg.version != wire.PROTOCOL_VERSION:
            err = f"protocol version {msg.version} != worker's {wire.PROTOCOL_VERSION}"
            self._send(ident, HelloReply(wire.PROTOCOL_VERSION, False, None, err))
            return
        self._send(ident, HelloReply(wire.PROTOCOL_VERSION, True, self.info))

    def _on_generate(self, ident: bytes, msg: Generate) -> None:
        def refuse(kind: ErrorKind, why: str, param: str | None = None) -> None:
            rid = msg.rid[:MAX_RID_CHARS]  # (an over-long id was refused: echo only its start)
            self.frontends.emit(ident, Delta(rid, 0, [], "error", error=why, error_kind=kind,
                                             error_param=param))

        if self._draining:
            return refuse(ErrorKind.DRAINING, "worker is draining")
        why = check_generate(msg, self.limits)
        if why is not None:
            transport.refused("worker", "bad request", log, why)
            return refuse(ErrorKind.BAD_REQUEST, why)
        if timeline.ON:  # (its id checked: of a bounded length)
            timeline.mark("recv", msg.rid)
        if msg.rid in self._requests:
            return refuse(ErrorKind.DUPLICATE, "duplicate request id")
        b = msg.bootstrap
        if (b is not None and self.info.role == "decode"
                and not self.frontends.announced(ident, f"{b.host}:{b.port}")):
            transport.refused("worker", "bootstrap not announced", log, f"{b.host}:{b.port}")
            return refuse(ErrorKind.BAD_REQUEST, f"prefill bootstrap {b.host}:{b.port} is not "
                          "one this frontend announced (Prefills)")
        req = EngineRequest(msg.rid, msg.prompt_ids, msg.sampling, msg.bootstrap, msg.resume_offset,
                            msg.tenant, msg.priority, msg.cache_salt)
        try:
            handle = self.engine.submit(req, self)
        except EngineError as e:
            return refuse(e.kind, str(e), e.param)
        except Exception as e:  # an engine bug on odd input must not take the batch's others
            transport.refused("worker", "engine submit failed", log, repr(e))
            return refuse(ErrorKind.ENGINE, f"the engine failed to take the request: {e}")
        self._requests[msg.rid] = _Request(msg.rid, self.engine.output_mode, ident, handle)

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
    def _send(self, ident: bytes, msg: wire.Message) -> None:
        assert self._channel is not None
        try:
            self._channel.send_nowait(ident, msg)
        except ChannelFull as e:
            # The frontend is gone (EHOSTUNREACH) or not reading (EAGAIN past the HWM): its
            # requests cannot be delivered, so stop them and free their pages.
            transport.refused("worker", "frontend unreachable; its requests cancelled", log,
                              f"{ident!r}: {e}")
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
