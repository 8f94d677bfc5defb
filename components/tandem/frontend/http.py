"""The HTTP side of one exchange, without any framework: the ASGI types, reading a request body,
the `ResponseWriter`, the disconnect watcher, and the one table that turns an error a worker
reported (`wire.ErrorKind`) into an HTTP status and OpenAI error type.

Errors raised inside the frontend are `TandemError`s that carry their status already; a worker's
error arrives as a kind on its last delta and only becomes an HTTP error here (`error_of`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Protocol

import msgspec

from tandem.frontend.limits import BodyBudget
from tandem.runtime import errors
from tandem.runtime.lifecycle import running_loop
from tandem.runtime.wire import Delta, ErrorKind

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = b"application/json"
_encode = msgspec.json.Encoder().encode


class ClientGone(Exception):
    """The HTTP client disconnected (a write failed, or the server said `http.disconnect`)."""


class PayloadTooLarge(errors.TandemError):
    status = 413
    type = "invalid_request_error"


class RequestTimeout(errors.TandemError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class MethodNotAllowed(errors.TandemError):
    status = 405
    type = "invalid_request_error"


# What the client sees for each way a worker can fail a request: (status, type, code).
# DUPLICATE is a request id already in flight on the worker: the frontend makes the ids, so it
# is the server's fault, not the client's (500).
_KINDS: dict[ErrorKind, tuple[int, str, str | None]] = {
    ErrorKind.BAD_REQUEST: (400, "invalid_request_error", None),
    ErrorKind.DUPLICATE: (500, "internal_error", "duplicate_request_id"),
    ErrorKind.DRAINING: (503, "service_unavailable", "service_unavailable"),
    ErrorKind.BUSY: (503, "service_unavailable", "service_unavailable"),
    ErrorKind.FRONTEND_SILENT: (503, "service_unavailable", "service_unavailable"),
    ErrorKind.KV_TRANSFER: (502, "kv_transfer_error", "kv_transfer_failed"),
    ErrorKind.ENGINE: (500, "engine_error", None),
}


def error_of(d: Delta) -> errors.TandemError:
    """The HTTP error for a delta that ended its request with finish_reason "error"."""
    status, type_, code = _KINDS.get(d.error_kind or ErrorKind.ENGINE, _KINDS[ErrorKind.ENGINE])
    err = errors.TandemError(d.error or "The engine failed this request.", param=d.error_param,
                             retry_after=1.0 if status == 503 else None)
    err.status, err.type, err.code = status, type_, code
    return err


class BodiesBusy(errors.Unavailable):
    """The server's budget of body bytes being received has no room for this body now (503)."""

    def __init__(self, budget: BodyBudget) -> None:
        super().__init__(f"The server is receiving {budget.limit} bytes of request bodies at "
                         f"most, and has no room for this one now; retry shortly.",
                         retry_after=1)


async def read_body(receive: Receive, max_bytes: int, deadline: float,
                    budget: BodyBudget | None = None, declared: int | None = None) -> bytes:
    """The request body: PayloadTooLarge (413) past `max_bytes`, RequestTimeout (408) when it has
    not all arrived within `deadline` seconds (0: none), ClientGone if the client left. With a
    `budget`, its bytes are taken from it as they arrive and all given back when this returns or
    raises; BodiesBusy (503) when the budget has no room for them. A `declared` length (the
    request's content-length) is checked against both before anything is read, so a body that
    cannot be taken is refused before the client sends it."""
    if deadline <= 0:
        return await _read_body(receive, max_bytes, budget, declared)
    # What `asyncio.timeout` does, at half its cost (it runs once per request): a timer that
    # cancels this task, and that cancellation turned into the 408.
    loop = running_loop()
    task = asyncio.current_task(loop)
    assert task is not None
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    timer = loop.call_later(deadline, expire)
    try:
        return await _read_body(receive, max_bytes, budget, declared)
    except asyncio.CancelledError:
        if fired and task.uncancel() == 0:  # our timer's, and no one else's besides
            raise RequestTimeout(
                f"The request body did not arrive within {deadline:g}s.") from None
        raise
    finally:
        timer.cancel()


def _too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body is larger than {max_bytes} bytes.")


async def _read_body(receive: Receive, max_bytes: int, budget: BodyBudget | None,
                     declared: int | None) -> bytes:
    if declared is not None:
        if declared > max_bytes:
            raise _too_large(max_bytes)
        if budget is not None and declared > budget.free:
            raise BodiesBusy(budget)
    chunks: list[bytes] = []
    size = taken = 0
    try:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            data = msg.get("body", b"")
            size += len(data)
            if size > max_bytes:
                raise _too_large(max_bytes)
            if budget is not None and data:
                if not budget.take(len(data)):
                    raise BodiesBusy(budget)
                taken += len(data)
            chunks.append(data)
            if not msg.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        if taken and budget is not None:
            budget.give(taken)


def content_length(scope: Scope) -> int | None:
    """The request's content-length header as a number (None: none, or not a number)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


# Headers that name a conversation, in the order they are preferred (vLLM's router and benchmarks,
# llm-d, Dynamo, SGLang's gateway, aiperf).
SESSION_HEADERS = (b"x-session-id", b"x-dynamo-session-id", b"x-smg-routing-key",
                   b"x-correlation-id")
MAX_SESSION_CHARS = 256


def session_of(scope: Scope, user: str | None) -> str:
    """The request's conversation key for the router: the first session header present, else the
    body's `user` ("" for none); longer keys are cut (a key is only a preference)."""
    found: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in SESSION_HEADERS and value:
            found.setdefault(name, value)
    for name in SESSION_HEADERS:
        if name in found:
            return "h:" + found[name][:MAX_SESSION_CHARS].decode("latin-1")
    return "u:" + user[:MAX_SESSION_CHARS] if user else ""


class ServerCalls(Protocol):
    """What a server may offer a request beside ASGI, to write now instead of awaiting (tandem's
    uvicorn protocol does: tandem.frontend.uvicorn_protocol.Extensions). Each returns False,
    having done nothing, when it cannot do its job now."""

    def body_nowait(self, data: bytes) -> bool: ...

    def start_nowait(self, status: int, headers: Sequence[tuple[bytes, bytes]],
                     body: bytes) -> bool: ...

    def on_gone(self, callback: Callable[[], None] | None) -> bool: ...


class ResponseWriter:
    """The response side of one HTTP exchange. A failed write marks the client gone and raises
    `ClientGone`; `status` is what was sent (0 until the response starts).

    With a server's `ServerCalls` (`calls`): `body_nowait(data)` writes a body chunk of a started
    response without awaiting. It returns False, having written nothing, when the server cannot
    take the chunk now (a slow client: writing is paused; the client is gone): the caller then
    awaits `body`, which waits as the server says. The caller checks `gone` first. `start_now` is
    the same for the response's start, and `on_gone` is what watch_disconnect registers with.
    Without them (None), every write is an ASGI `send`."""

    __slots__ = ("_send", "body_nowait", "on_gone", "_start_nowait", "status", "finished", "gone")

    def __init__(self, send: Send, calls: ServerCalls | None = None):
        self._send = send
        if calls is None:
            self.body_nowait: Callable[[bytes], bool] | None = None
            self.on_gone: Callable[[Callable[[], None] | None], bool] | None = None
            self._start_nowait: Callable[[int, Sequence[tuple[bytes, bytes]], bytes], bool] \
                | None = None
        else:
            self.body_nowait, self.on_gone = calls.body_nowait, calls.on_gone
            self._start_nowait = calls.start_nowait
        self.status = 0
        self.finished = False
        self.gone = False

    @property
    def started(self) -> bool:
        return self.status != 0

    @property
    def can_start_now(self) -> bool:
        """The server offers `start_now` (it may still refuse at the time)."""
        return self._start_nowait is not None

    def start_now(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bool:
        """Start a streamed response with its first body chunk, without awaiting, when the server
        offers it and can take them now (one write); False (nothing written): the caller awaits
        `start` and `body`, which wait or fail as they must."""
        fn = self._start_nowait
        if fn is None or self.gone or self.status:
            return False
        try:
            if not fn(status, headers, body):
                return False
        except Exception:  # (`start` meets it again, and says the client is gone)
            return False
        self.status = status
        return True

    async def _emit(self, message: Message) -> None:
        if self.gone:
            raise ClientGone()
        try:
            await self._send(message)
        except Exception as e:  # the server's way to say the peer is gone varies by server
            self.gone = True
            raise ClientGone() from e

    async def start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.status = status
        await self._emit({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = True) -> None:
        if not more:
            self.finished = True
        await self._emit({"type": "http.response.body", "body": data, "more_body": more})

    async def reply(self, status: int, body: bytes, content_type: bytes,
                    headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        await self.start(status, [(b"content-type", content_type),
                                  (b"content-length", str(len(body)).encode()), *headers])
        await self.body(body, more=False)

    async def error(self, err: errors.TandemError) -> None:
        """The error's status and OpenAI body; `Retry-After` when the error says when to retry."""
        headers: list[tuple[bytes, bytes]] = []
        if err.retry_after is not None or isinstance(err, errors.Unavailable):
            seconds = max(1, math.ceil(err.retry_after or 1))
            headers.append((b"retry-after", str(seconds).encode()))
        await self.reply(err.status, _encode(err.body()), JSON, headers)


class watch_disconnect:
    """`async with watch_disconnect(receive, writer):` — when the client leaves before the
    response is finished, the block is cancelled (and `writer.gone` set); the cancellation ends at
    the block, as `asyncio.timeout`'s does, so the caller carries on after it.

    A server that offers a disconnect callback (`writer.on_gone`: tandem's uvicorn protocol,
    tandem.frontend.uvicorn_protocol) tells us from its `connection_lost`, and nothing else runs.
    Otherwise a watcher task awaits `receive()` for `http.disconnect` (as ASGI says), and is
    cancelled and awaited on the way out."""

    __slots__ = ("_receive", "_writer", "_task", "_watcher", "_fired", "_registered")

    def __init__(self, receive: Receive, writer: ResponseWriter) -> None:
        self._receive = receive
        self._writer = writer
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._fired = False
        self._registered = False

    async def __aenter__(self) -> watch_disconnect:
        self._task = asyncio.current_task(running_loop())
        on_gone = self._writer.on_gone
        if on_gone is None:
            self._watcher = asyncio.ensure_future(self._wait())
        elif on_gone(self._gone):
            self._registered = True
        else:  # gone already: the block is cancelled at its first await
            self._gone()
        return self

    async def _wait(self) -> None:
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                break
        self._gone()

    def _gone(self) -> None:
        if not self._writer.finished and self._task is not None:
            self._writer.gone = True
            self._fired = True
            self._task.cancel()

    @property
    def fired(self) -> bool:
        """The client went away and the block was cancelled for it."""
        return self._fired

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        w, task = self._watcher, self._task
        # The watcher's cancellation is kept by it with a traceback through `_wait`, whose frame
        # holds this object, and the server holds our callback: both dropped here, so the request
        # is freed at once, not by the collector.
        self._watcher = self._task = None
        if self._registered and self._writer.on_gone is not None:
            self._registered = False
            self._writer.on_gone(None)
        if w is not None and not w.done():
            w.cancel()
            try:
                await asyncio.wait((w,))
            except asyncio.CancelledError:
                if not self._fired:  # someone else's cancellation: theirs to handle
                    raise
        if self._fired and task is not None and task.uncancel() == 0:
            return exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        return False


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
