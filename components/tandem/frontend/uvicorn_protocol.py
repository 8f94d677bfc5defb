"""tandem's uvicorn protocol: uvicorn's httptools protocol with the HTTP limits, offering the app
one scope extension per request (`Extensions`) that writes now instead of awaiting.

The limits (tandem.frontend.limits.HttpLimits) it enforces: a connection cap and a cap per client
address (503 and close, at once: counted in `connection_made`), a deadline for each request head
(408 and close) and a cap on its size (431 and close), for every request on a connection,
pipelined ones too: the size is the head's as the parser reads it, and the bytes read while a
head is unfinished. A request the parser refuses gets an OpenAI error body
(uvicorn's own answer is plain text).

The extension, `scope["extensions"][EXTENSIONS]`, has three calls, each what uvicorn's own ASGI
`send`/`receive` would do, without an ASGI message, a coroutine or a task (tandem.frontend.http
ResponseWriter and watch_disconnect use them when the scope offers them, and ASGI otherwise):
- `body_nowait(data)`: a chunk of a started streamed response, written now;
- `start_nowait(status, headers, body)`: a streamed response's head and first chunk, as one write;
- `on_gone(callback)`: the callback is called from `connection_lost` if the client leaves first.
Each returns False, having done nothing, whenever it cannot do its job now; the app then awaits
ASGI as usual. The extension is dropped when its response completes or its client leaves.

It reads uvicorn's private state; the versions it is tested with are pinned in pyproject.toml
(uvicorn 0.54), and tests/unit/test_uvicorn_protocol.py checks each call against a fake
connection and tests/unit/test_frontend_server.py on a real one. What it reads:
- of `uvicorn.protocols.http.httptools_impl.RequestResponseCycle`: `flow.write_paused`,
  `disconnected`, `response_started`, `response_complete`, `chunked_encoding`, `scope["method"]`,
  `transport` (read, and replaced by a recorder for the length of one `start_nowait`), and its
  `send` coroutine, stepped by hand once;
- of `HttpToolsProtocol` (subclassed): `cycle`, `connections`, `client`, `transport`, `loop`,
  and its `connection_made`, `data_received`, `on_message_begin`, `on_url`, `on_header`,
  `on_headers_complete`, `on_response_complete` and `connection_lost`, each extended and called
  through, and `send_400_response`, replaced (uvicorn calls it when its parser raises, which a
  head past the cap makes it do).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from tandem.frontend.limits import BAD, BIG, BUSY, CROWDED, SLOW, HttpLimits

EXTENSIONS = "tandem.server"  # the scope extension: an `Extensions`


class _Head:
    """Stands in for the transport while uvicorn writes a response head: keeps what it writes."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class Extensions:
    """The calls tandem's protocol offers one request's app (see the module docstring), over
    that request's uvicorn cycle. `gone()` is the protocol's: the client left."""

    __slots__ = ("cycle", "callback")

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle
        self.callback: Callable[[], None] | None = None

    def body_nowait(self, data: bytes) -> bool:
        """A body chunk of a started, chunked (streamed) response, written straight to the
        connection: what uvicorn's `send` does for such a chunk. False (nothing written) whenever
        `send` would do anything else: writing is paused (a slow client), the client is gone, the
        response is not a started chunked one, the chunk is empty."""
        cycle = self.cycle
        if (cycle is None or cycle.flow.write_paused or cycle.disconnected
                or not cycle.response_started or cycle.response_complete
                or not cycle.chunked_encoding or not data):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    def start_nowait(self, status: int, headers: Sequence[tuple[bytes, bytes]],
                     body: bytes) -> bool:
        """A streamed response's start and its first body chunk, written as ONE write (one system
        call and one read for the client, not two): the head is what uvicorn's own `send` of
        `http.response.start` makes, run to its end at once (it awaits only while writing is
        paused, which is refused here) with the transport's place taken for that moment, so that
        the head joins the chunk. For a chunked response only: `headers` name no length and the
        request is not a HEAD (uvicorn then always chunks). False (nothing written) when writing
        is paused, the client is gone, the response started, or it would not be chunked."""
        cycle = self.cycle
        if (cycle is None or cycle.flow.write_paused or cycle.disconnected
                or cycle.response_started or not body or cycle.scope["method"] == "HEAD"
                or status in (204, 304)
                or any(k.lower() in (b"content-length", b"transfer-encoding")
                       for k, _ in headers)):
            return False
        transport, head = cycle.transport, _Head()
        cycle.transport = head
        try:
            step = cycle.send({"type": "http.response.start", "status": status,
                               "headers": headers})
            try:
                step.send(None)
            except StopIteration:
                pass
            else:
                step.close()  # (it awaited before writing anything: nothing was written)
                return False
        finally:
            cycle.transport = transport
        transport.write(b"%b%x\r\n%b\r\n" % (head.data, len(body), body))
        return True

    def on_gone(self, callback: Callable[[], None] | None) -> bool:
        """Have `callback()` called once, from the connection's `connection_lost`, if the client
        leaves before this response completes (None: forget it). False when the client is gone
        already (nothing is registered)."""
        if callback is not None and (self.cycle is None or self.cycle.disconnected):
            return False
        self.callback = callback
        return True

    def gone(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()

    def drop(self) -> None:
        """The response is over: forget the cycle (it holds this object through its scope: no
        reference cycle outlives the request) and the callback."""
        if self.cycle is not None:
            ext = self.cycle.scope.get("extensions")
            if ext:
                ext.pop(EXTENSIONS, None)
        self.cycle = self.callback = None


def guarded_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the limits (pass it as `uvicorn.Config(http=)`), offering
    the app an `Extensions` in each request's scope extensions. `Guarded.clients` counts the
    open connections of each client address (of this server: one class per call)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    per_client = limits.per_client

    class Guarded(HttpToolsProtocol):
        clients: ClassVar[dict[str, int]] = {}  # client address -> its open connections
        _client: str | None = None  # this connection's address, while it is counted
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = False  # a request head has begun and not ended
        _head_bytes = 0  # bytes read while a head was unfinished
        _head_size = 0  # the head's URL and headers so far, as parsed
        _too_big = False
        _ext: Extensions | None = None  # the current request's

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refuse(BUSY)
                return
            addr = self.client[0] if self.client else ""
            held = self.clients.get(addr, 0)
            if held >= per_client:
                self._refuse(CROWDED)
                return
            self.clients[addr], self._client = held + 1, addr
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Still no end of head after these bytes (of this request, or of the next one that a
            # client sent behind it on the same connection): too many bytes on the way to it, or
            # the deadline starts now. A head that arrives whole, the usual case, never arms one.
            if self._in_head and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > limits.max_header_bytes:
                    self._refuse(BIG)
                elif self._head_timer is None:
                    self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes, self._head_size = True, 0, 0

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            """The head's size as parsed, whatever the reads it came in: past the cap the parse
            stops (uvicorn's parse error, answered by send_400_response below with the 431)."""
            self._head_size += n
            if self._head_size > limits.max_header_bytes:
                self._too_big = True
                raise ValueError("request head too large")

        def send_400_response(self, msg: str) -> None:
            """What uvicorn sends for a request its parser refused: an OpenAI error body (a 431
            for a head past the cap), not plain text."""
            self._refuse(BIG if self._too_big else BAD)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            cycle: Any = self.cycle  # (its task is created, not run: the app sees this)
            if cycle is not None:
                self._ext = ext = Extensions(cycle)
                cycle.scope.setdefault("extensions", {})[EXTENSIONS] = ext

        def on_response_complete(self) -> None:
            ext, self._ext = self._ext, None
            if ext is not None:
                ext.drop()
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            addr, self._client = self._client, None
            if addr is not None:
                left = self.clients[addr] - 1
                if left:
                    self.clients[addr] = left
                else:
                    del self.clients[addr]
            cycle: Any = self.cycle
            ext, self._ext = self._ext, None
            super().connection_lost(exc)
            if ext is not None:
                if cycle is not None and cycle.disconnected:  # (the response was not complete)
                    ext.gone()
                ext.drop()

        def _arm(self) -> None:
            self._in_head = True
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._refuse, SLOW)

        def _disarm(self) -> None:
            self._in_head = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _refuse(self, reply: bytes) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(reply)
                self.transport.close()

    return Guarded
