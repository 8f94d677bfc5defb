"""tandem's uvicorn extension calls, each against uvicorn's own request cycle over a fake
connection (a transport that records its writes, a flow control that can pause): what they write
is what uvicorn's ASGI `send` writes, and whenever `send` would do anything else they refuse,
having written nothing. A uvicorn whose private state moved fails here, not only in production."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from tandem.frontend import sse
from tandem.frontend.uvicorn_protocol import EXTENSIONS, Extensions


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


class FakeFlow:
    write_paused = False

    async def drain(self) -> None:
        await asyncio.Event().wait()  # paused for good: a send that awaits never gets past here


def cycle(method: str = "POST") -> Any:
    scope: dict[str, Any] = {"type": "http", "method": method, "path": "/v1/completions",
                             "http_version": "1.1", "headers": [], "extensions": {}}
    c = RequestResponseCycle(scope, FakeTransport(), FakeFlow(), logging.getLogger("t"),  # type: ignore[arg-type]
                             logging.getLogger("t"), False, [], asyncio.Event(), False, True,
                             lambda: None)
    ext = Extensions(c)
    scope["extensions"][EXTENSIONS] = ext
    return c, ext


START = {"type": "http.response.start", "status": 200, "headers": sse.HEADERS}


async def test_body_nowait_writes_the_chunk_send_would_write() -> None:
    c, ext = cycle()
    assert not ext.body_nowait(b"data: x\n\n")  # not started yet: send's job
    await c.send(START)
    ours = ext.body_nowait(b"data: x\n\n")
    c2, _ = cycle()
    await c2.send(START)
    await c2.send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
    assert ours and c.transport.writes == c2.transport.writes


@pytest.mark.parametrize("why", ["paused", "gone", "empty", "complete", "not chunked"])
async def test_body_nowait_refuses_what_send_would_handle_otherwise(why: str) -> None:
    c, ext = cycle()
    if why == "not chunked":
        await c.send({"type": "http.response.start", "status": 200,
                      "headers": [(b"content-length", b"10")]})
    else:
        await c.send(START)
    before = list(c.transport.writes)
    c.flow.write_paused = why == "paused"
    c.disconnected = why == "gone"
    c.response_complete = why == "complete"
    assert not ext.body_nowait(b"" if why == "empty" else b"data: x\n\n")
    assert c.transport.writes == before


async def test_start_nowait_writes_head_and_chunk_as_one_write() -> None:
    c, ext = cycle()
    assert ext.start_nowait(200, sse.HEADERS, b"data: first\n\n")
    assert c.response_started and c.chunked_encoding
    c2, _ = cycle()
    await c2.send(START)
    await c2.send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
    assert len(c.transport.writes) == 1 and c.transport.writes[0] == b"".join(c2.transport.writes)
    assert ext.body_nowait(b"data: next\n\n")  # and the stream goes on as uvicorn's would


@pytest.mark.parametrize("why", ["paused", "gone", "started", "HEAD", "204", "length", "empty"])
async def test_start_nowait_refuses_what_it_cannot_write_whole(why: str) -> None:
    c, ext = cycle("HEAD" if why == "HEAD" else "POST")
    if why == "started":
        await c.send(START)
    before = list(c.transport.writes)
    c.flow.write_paused = why == "paused"
    c.disconnected = why == "gone"
    headers = [*sse.HEADERS, (b"content-length", b"3")] if why == "length" else sse.HEADERS
    status = 204 if why == "204" else 200
    assert not ext.start_nowait(status, headers, b"" if why == "empty" else b"abc")
    assert c.transport.writes == before
    assert c.response_started == (why == "started")


async def test_start_nowait_leaves_no_trace_if_uvicorns_start_would_wait() -> None:
    """The write-paused check is ours; were uvicorn's start to await anyway, the coroutine is
    closed and nothing is written or marked started."""
    c, ext = cycle()

    async def send_that_waits(message: Any) -> None:
        await asyncio.sleep(0)
        raise AssertionError("never resumed")

    c.send = send_that_waits
    assert not ext.start_nowait(200, sse.HEADERS, b"abc")
    assert c.transport.writes == [] and not c.response_started
    assert isinstance(c.transport, FakeTransport)  # its place given back


async def test_on_gone_calls_back_once_and_drop_forgets_the_cycle() -> None:
    c, ext = cycle()
    called: list[int] = []
    assert ext.on_gone(lambda: called.append(1))
    ext.gone()
    ext.gone()
    assert called == [1]
    assert ext.on_gone(lambda: called.append(2)) and ext.on_gone(None)
    ext.gone()
    assert called == [1]
    ext.drop()
    assert EXTENSIONS not in c.scope["extensions"] and ext.cycle is None
    assert not ext.body_nowait(b"x") and not ext.start_nowait(200, sse.HEADERS, b"x")
    assert not ext.on_gone(lambda: None)  # (a dropped request cannot register)


async def test_on_gone_refuses_a_client_already_gone() -> None:
    c, ext = cycle()
    c.disconnected = True
    assert not ext.on_gone(lambda: None)
    assert ext.on_gone(None)  # forgetting is always fine
