"""HTTP connection limits for the uvicorn backend: no client holds a descriptor or a buffer forever.

uvicorn closes a connection that stays idle after a response (`timeout_keep_alive`), but not one
that never completes its request head: a client that connects and sends nothing, or trickles its
headers, would keep its descriptor for good, and 20,000 of them exhaust the process's. The
protocol here (uvicorn's httptools protocol, extended) adds:

- a connection cap (`max_connections`): a connection past it gets a 503 with an OpenAI error body
  and is closed at once, so descriptors stay bounded whatever clients do;
- a header deadline (`header_timeout_s`) from the connection's start, or from the first byte of
  each later request on it, to the end of the request head: past it, 408 and close;
- a cap on the request head's size (`max_header_bytes`): past it, 431 and close.

The body has its own deadline and size cap, checked where it is read (tandem.frontend.http
`read_body`: 408 and 413). `raise_fd_limit` lifts the soft descriptor limit toward the hard one so
the cap, not the kernel, is what refuses connections.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec

log = logging.getLogger("tandem.frontend")
FD_RESERVE = 1024  # descriptors kept for worker sockets, logs and the rest


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_connections: int = 10_000
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0  # keep-alive: idle between requests
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024


def _reply(status: int, reason: str, message: str, type_: str) -> bytes:
    body = msgspec.json.encode({"error": {"message": message, "type": type_, "param": None,
                                          "code": None}})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


BUSY = _reply(503, "Service Unavailable", "Too many open connections.", "service_unavailable")
SLOW = _reply(408, "Request Timeout", "The request head did not arrive in time.",
              "invalid_request_error")
BIG = _reply(431, "Request Header Fields Too Large", "The request head is too large.",
             "invalid_request_error")


def raise_fd_limit(wanted: int) -> int:
    """Lift the soft RLIMIT_NOFILE toward `wanted` + FD_RESERVE (at most the hard limit); return
    how many connections the limit leaves room for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    room = wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - FD_RESERVE))
    if room < wanted:
        log.warning("open-file limit %d leaves room for %d HTTP connections, not %d", soft, room,
                    wanted)
    return room


BODY_NOWAIT = "tandem.body_nowait"  # the scope extension: `fn(data) -> bool`, see _body_nowait


def _body_nowait(cycle: Any, data: bytes) -> bool:
    """A body chunk of a started, chunked (streamed) response, written straight to the connection
    when it can take it now: what uvicorn's `send` does for such a chunk, without the ASGI message
    and the coroutine. False (nothing written) whenever `send` would do anything else: writing is
    paused (a slow client), the client is gone, the response is not a started chunked one; the
    caller then uses `send`."""
    if (cycle.flow.write_paused or cycle.disconnected or not cycle.response_started
            or cycle.response_complete or not cycle.chunked_encoding or not data):
        return False
    cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
    return True


START_NOWAIT = "tandem.start_nowait"  # the extension: `fn(status, headers, body) -> bool`


class _Head:
    """Stands in for the transport while uvicorn writes a response head: keeps what it writes."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def _start_nowait(cycle: Any, status: int, headers: Any, body: bytes) -> bool:
    """A streamed response's start and its first body chunk, written now as ONE write (one system
    call and one read for the client, not two): the head is what uvicorn's own `send` of
    `http.response.start` makes, run to its end at once (it awaits only while writing is paused,
    which is refused here) with the transport's place taken for that moment, so that the head
    joins the chunk. For a chunked response only: `headers` name no length and the request is
    not a HEAD (uvicorn then always chunks). False (nothing written) when writing is paused, the
    client is gone, the response started, or it would not be chunked; the caller then uses
    `send`."""
    if (cycle.flow.write_paused or cycle.disconnected or cycle.response_started or not body
            or cycle.scope["method"] == "HEAD" or status in (204, 304)
            or any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers)):
        return False
    transport, head = cycle.transport, _Head()
    cycle.transport = head
    try:
        step = cycle.send({"type": "http.response.start", "status": status, "headers": headers})
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


ON_GONE = "tandem.on_gone"  # the scope extension: `fn(callback | None) -> bool`, see _on_gone


def _on_gone(cycle: Any, callback: Callable[[], None] | None) -> bool:
    """Have `callback()` called once, from the connection's `connection_lost`, if the client
    leaves before this response completes (None: forget it). False when the client is gone
    already (nothing is registered). What an app would otherwise learn by a task that awaits
    `receive()` for `http.disconnect`, with no task."""
    if callback is not None and cycle.disconnected:
        return False
    cycle.tandem_on_gone = callback
    return True


def _forget(cycle: Any) -> None:
    """The cycle's extensions hold the cycle (through their partials): dropped when it is over,
    so the cycle is freed by reference counting."""
    ext = cycle.scope.get("extensions")
    if ext:
        ext.pop(BODY_NOWAIT, None)
        ext.pop(START_NOWAIT, None)
        ext.pop(ON_GONE, None)
    cycle.tandem_on_gone = None


def guarded_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the limits above (pass it as `uvicorn.Config(http=)`),
    offering the app `BODY_NOWAIT`, `START_NOWAIT` and `ON_GONE` in each request's scope
    extensions."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Guarded(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = False  # a request head has begun and not ended
        _head_bytes = 0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refuse(BUSY)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if not self._in_head and not self.transport.is_closing() and (
                    self.cycle is None or self.cycle.response_complete):
                self._in_head, self._head_bytes = True, 0  # a next request on a kept-alive one
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            # Still no end of head after these bytes (a body after a complete head is not
            # counted: the head's end ended it): too large, or the deadline starts now. A head
            # that arrives whole, the usual case, never arms a timer.
            if self._in_head:
                if self._head_bytes > limits.max_header_bytes:
                    self._refuse(BIG)
                elif self._head_timer is None:
                    self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            cycle: Any = self.cycle  # (its task is created, not run: the app sees this)
            if cycle is not None:
                ext: dict[str, Any] = cycle.scope.setdefault("extensions", {})
                ext[BODY_NOWAIT] = partial(_body_nowait, cycle)
                ext[START_NOWAIT] = partial(_start_nowait, cycle)
                ext[ON_GONE] = partial(_on_gone, cycle)

        def on_response_complete(self) -> None:
            cycle: Any = self.cycle
            if cycle is not None:
                _forget(cycle)
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            cycle: Any = self.cycle
            super().connection_lost(exc)
            if cycle is not None and cycle.disconnected:  # (the response was not complete)
                gone = getattr(cycle, "tandem_on_gone", None)
                _forget(cycle)
                if gone is not None:
                    gone()

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
