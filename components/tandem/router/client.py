"""WorkerClient: the frontend's connection to one worker, and RequestStream, one request on it.

The client owns a DEALER socket, a receive task that routes each incoming delta to its request's
stream, and a heartbeat task: a Hello until the worker answers, then a LoadQuery every interval.
A worker silent past the heartbeat deadline is marked down and every request on it fails with
WorkerLost; it comes back up when it answers again.

Backpressure accounting (DESIGN §3), kept here because this is where requests start, deltas
arrive and requests end: `pending_prefill_tokens` are prompt tokens sent to a prefill or agg worker
whose first delta has not come back; `active_decode_tokens` are prompt plus generated tokens of the
requests decoding on an agg or decode worker. `on_capacity` is called whenever capacity may have
freed (a request ended, a prefill finished, a load report came, the worker came up).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import zmq
import zmq.utils.monitor

from tandem.runtime import errors, wire, transport
from tandem.runtime.config import HEARTBEAT_DEADLINE_S, HEARTBEAT_INTERVAL_S, LOAD_QUERY_TIMEOUT_S
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.mailbox import Mailbox
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
    Load,
    LoadQuery,
    LoadReport,
    WorkerInfo,
)

log = logging.getLogger("tandem.router")


def _nothing() -> None:
    pass


_KIND_ERRORS: dict[ErrorKind, type[errors.TandemError]] = {
    ErrorKind.BAD_REQUEST: errors.BadRequest,
    ErrorKind.DRAINING: errors.Unavailable,
    ErrorKind.FRONTEND_SILENT: errors.Unavailable,
}


class RequestStream:
    """One request on one worker: an async context manager and an async iterator of deltas.

    Deltas come out in order with their offsets checked (a gap or overlap raises
    StreamProtocolError). Leaving the context before the final delta aborts the request.
    """

    __slots__ = ("rid", "_client", "_msg", "_items", "received", "finished", "_opened", "_over",
                 "prefill_tokens", "decode_tokens")

    def __init__(self, client: WorkerClient, msg: Generate) -> None:
        self.rid = msg.rid
        self._client = client
        self._msg = msg
        self._items: Mailbox[Delta | errors.TandemError] = Mailbox()
        self.received = 0
        self.finished = False  # the worker sent the final delta: nothing to abort
        self._opened = False
        self._over = False  # iteration has ended (finished or failed)
        self.prefill_tokens = 0  # counted in the client's pending_prefill_tokens
        self.decode_tokens = 0  # counted in the client's active_decode_tokens

    def start(self) -> None:
        """Send the request to the worker (synchronous, so the router can place it in one step)."""
        self._client.start_request(self)
        self._opened = True

    def release(self) -> None:
        """Leave the worker: abort the request there unless it finished. Safe twice."""
        if self._opened:
            self._opened = False
            self._client.end_request(self, abort=not self.finished)

    async def __aenter__(self) -> RequestStream:
        if not self._opened:
            self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def __aiter__(self) -> RequestStream:
        return self

    def waiting(self) -> int:
        """Deltas (or a failure) already here: the next `__anext__` returns without waiting."""
        return len(self._items)

    def push(self, item: Delta | errors.TandemError) -> None:
        self._items.put(item)

    async def __anext__(self) -> Delta:
        if self._over:
            raise StopAsyncIteration
        item = await self._items.get()  # bounded by the worker heartbeat deadline
        if isinstance(item, errors.TandemError):
            self._over = True
            raise item
        if item.offset != self.received:
            self._over = True  # not finished: leaving the context aborts it on the worker
            self._client.protocol_errors += 1
            raise errors.StreamProtocolError(
                f"delta for {self.rid} at offset {item.offset}, expected {self.received}"
            )
        self.received += len(item.token_ids)
        if item.finish_reason is not None:
            self.finished = self._over = True
            if item.finish_reason == "error":
                cls = _KIND_ERRORS.get(item.error_kind, errors.EngineFailed)  # type: ignore[arg-type]
                raise cls(item.error or "the engine failed this request")
        return item


class WorkerClient:
    def __init__(self, address: str, frontend_id: bytes) -> None:
        self.address = address
        self.frontend_id = frontend_id
        self.info: WorkerInfo | None = None
        self.state = "connecting"  # connecting | up | down | incompatible
        self.error = ""
        self.load = Load()
        self.in_flight: dict[str, RequestStream] = {}
        self.pending_prefill_tokens = 0
        self.active_decode_tokens = 0
        self.on_capacity: Callable[[], None] = _nothing
        self.protocol_errors = 0
        self.last_seen = 0.0
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks = TaskGroup()
        self._seq = itertools.count(1)
        self._queries: dict[int, asyncio.Future[Load]] = {}
        self._up = asyncio.Event()
        self._credit = 0  # Deltas messages handed to their streams, not yet credited back
        self._placed: dict[str, Generate] = {}  # requests placed in this loop pass, not yet sent

    @property
    def usable(self) -> bool:
        return self.state == "up"

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    async def start(self) -> None:
        self._sock = transport.dealer(self.address, self.frontend_id)
        self._tasks.spawn(self._recv_loop(), name=f"recv {self.address}")
        self._tasks.spawn(self._heartbeat(), name=f"heartbeat {self.address}")
        self._tasks.spawn(self._watch_connection(), name=f"monitor {self.address}")

    async def wait_up(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        self._fail_all(errors.Unavailable("the frontend is shutting down"))
        await self._tasks.close()
        if self._sock is not None:
            self._sock.close(linger=0)

    # --- requests ---------------------------------------------------------------------------------
    def start_request(self, stream: RequestStream) -> None:
        """Place the request here. Its Generate leaves with the others placed on this worker in
        the same event loop pass, as one `Generates` message (one ZMQ send instead of many)."""
        if not self.usable:
            raise errors.Unavailable(f"worker {self.address} is {self.state}", retry_after=1.0)
        if not self._placed:
            asyncio.get_running_loop().call_soon(self._send_placed)
        self._placed[stream.rid] = stream._msg
        self.in_flight[stream.rid] = stream
        n = len(stream._msg.prompt_ids)
        role = self.info.role if self.info is not None else "agg"
        if role != "decode":
            stream.prefill_tokens = n
            self.pending_prefill_tokens += n
        if role != "prefill":
            stream.decode_tokens = n
            self.active_decode_tokens += n

    def end_request(self, stream: RequestStream, abort: bool) -> None:
        self.in_flight.pop(stream.rid, None)
        self._settle(stream)
        if self._placed.pop(stream.rid, None) is not None:
            abort = False  # it never left: nothing to abort
        if abort and self.state == "up":
            self._send_quietly(Abort([stream.rid]))
        self.on_capacity()

    def _send_placed(self) -> None:
        placed, self._placed = self._placed, {}
        if not placed:
            return
        try:
            self._send(Generates(list(placed.values())))
        except errors.Unavailable as e:  # past the high-water mark: the worker is not reading
            for rid in placed:
                s = self.in_flight.pop(rid, None)
                if s is not None:
                    self._settle(s)
                    s.push(e)
            self.on_capacity()

    def _settle(self, stream: RequestStream) -> None:
        self.pending_prefill_tokens -= stream.prefill_tokens
        self.active_decode_tokens -= stream.decode_tokens
        stream.prefill_tokens = stream.decode_tokens = 0

    async def query_load(self) -> Load:
        """Ask the worker for its load now (deadline LOAD_QUERY_TIMEOUT_S); last known on timeout."""
        if not self.usable:
            return self.load
        seq = next(self._seq)
        fut: asyncio.Future[Load] = asyncio.get_running_loop().create_future()
        self._queries[seq] = fut
        self._send(LoadQuery(seq))
        try:
            return await asyncio.wait_for(fut, LOAD_QUERY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return self.load
        finally:
            self._queries.pop(seq, None)

    # --- internals --------------------------------------------------------------------------------
    def _send(self, msg: wire._Tagged) -> None:
        assert self._sock is not None
        try:
            transport.send_nowait(self._sock, msg)
        except zmq.Again:
            raise errors.Unavailable(f"worker {self.address} is not keeping up", retry_after=1.0)

    def _fail_all(self, err: errors.TandemError) -> None:
        self._placed.clear()
        streams, self.in_flight = self.in_flight, {}
        for s in streams.values():
            self._settle(s)
            s.push(err)
        self.on_capacity()

    def _mark_down(self, why: str) -> None:
        if self.state == "up":
            log.warning("worker %s is down: %s", self.address, why)
        if self.state != "incompatible":
            self.state = "down"
        self._up.clear()
        self._fail_all(errors.WorkerLost(f"worker {self.address} stopped answering ({why})"))

    async def _heartbeat(self) -> None:
        hello = Hello(wire.PROTOCOL_VERSION, self.frontend_id.decode())
        while True:
            if self.state == "up":
                if self._unread():
                    # Its messages wait in our socket: we are behind, it is not silent.
                    self.last_seen = time.monotonic()
                if time.monotonic() - self.last_seen > HEARTBEAT_DEADLINE_S:
                    self._mark_down(f"silent for over {HEARTBEAT_DEADLINE_S:.0f}s")
                else:
                    self._send_quietly(LoadQuery(0))
            if self.state != "up" and self.state != "incompatible":
                self._send_quietly(hello)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _watch_connection(self) -> None:
        """A dropped TCP connection means the worker process is gone (or restarted, forgetting
        its requests): fail them now rather than after the heartbeat deadline."""
        assert self._sock is not None
        mon = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                parts = await mon.recv_multipart()
                event = zmq.utils.monitor.parse_monitor_message(parts)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._mark_down("connection closed")
        finally:
            self._sock.disable_monitor()
            mon.close(linger=0)

    def _send_quietly(self, msg: wire._Tagged) -> None:
        try:
            self._send(msg)
        except errors.Unavailable:
            pass

    def _unread(self) -> bool:
        return self._sock is not None and bool(self._sock.get(zmq.EVENTS) & zmq.POLLIN)

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        async for msg in transport.dealer_messages(self._sock, wire.TO_FRONTEND, log):
            self.last_seen = time.monotonic()
            if isinstance(msg, Deltas):
                self.on_deltas(msg)
                if not self._credit:
                    # After the streams woken by these deltas have run: credit means "consumed".
                    asyncio.get_running_loop().call_soon(self._give_credit)
                self._credit += 1
            elif isinstance(msg, LoadReport):
                self.on_load(msg)
            elif isinstance(msg, HelloReply):
                self._on_hello(msg)

    def _give_credit(self) -> None:
        n, self._credit = self._credit, 0
        if self._sock is not None and not self._sock.closed:  # (closed: the frontend stopped)
            self._send_quietly(Credit(n))

    def on_deltas(self, msg: Deltas) -> None:
        """Route each delta to its stream and account for it (the one loop over a step's deltas)."""
        if msg.load is not None:
            self.load = msg.load
        streams = self.in_flight
        for d in msg.items:
            s = streams.get(d.rid)
            if s is not None:
                s.push(d)
                if s.prefill_tokens:  # its first delta: the prefill is done
                    self.pending_prefill_tokens -= s.prefill_tokens
                    s.prefill_tokens = 0
                if s.decode_tokens:
                    s.decode_tokens += len(d.token_ids)
                    self.active_decode_tokens += len(d.token_ids)
        self.on_capacity()

    def on_load(self, msg: LoadReport) -> None:
        self.load = msg.load
        fut = self._queries.get(msg.seq)
        if fut is not None and not fut.done():
            fut.set_result(msg.load)
        self.on_capacity()

    def _on_hello(self, msg: HelloReply) -> None:
        if not msg.ok or msg.info is None:
            self.state, self.error = "incompatible", msg.error
            log.error("worker %s refused the handshake: %s", self.address, msg.error)
            return
        if self.state != "up":
            log.info("worker %s is up: %s %s", self.address, msg.info.role, msg.info.engine)
        self.info = msg.info
        self.state = "up"
        self._up.set()
        self.on_capacity()
