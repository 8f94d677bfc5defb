"""HTTP limits on a real listening socket (uvicorn): idle and trickling connections are closed with
408 past the head deadline, a head too large gets 431, connections past the cap get 503 and are
closed at once (descriptors stay bounded), a kept-alive connection idle past its timeout is
closed, and a body that does not arrive in time gets 408 with an OpenAI error body."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from tandem.config import FrontendConfig
from tandem.frontend.app import FrontendApp
from tandem.frontend.limits import HttpLimits
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.server import HttpServer, make_server
from tests.fakes import FakePool, write_model_dir

# (One client may hold every connection here: the total cap is what is tested; the cap per
# client address, in test_http_budgets.py.)
LIMITS = HttpLimits(max_connections=20, header_timeout_s=0.3, idle_timeout_s=1.0,
                    max_header_bytes=4096, max_connections_per_client=20)
CONFIG = FrontendConfig(served_model_name="tiny", http_body_timeout_s=0.3)


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor(write_model_dir(tmp_path_factory.mktemp("limits") / "tiny"), "tiny")


@pytest.fixture
async def server(pre: Preprocessor) -> AsyncIterator[HttpServer]:
    app = FrontendApp(CONFIG, FakePool(), pre)
    s = make_server(app, "127.0.0.1", 0, "uvicorn", drain_timeout_s=0.2, limits=LIMITS)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def connect(s: HttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", s.port)


async def answer(r: asyncio.StreamReader, timeout: float = 3.0) -> tuple[int, dict]:
    """Status and JSON body of the one response on the connection, read to its close."""
    raw = await asyncio.wait_for(r.read(), timeout)
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else {}


async def test_a_silent_connection_gets_408_and_is_closed(server: HttpServer) -> None:
    r, w = await connect(server)
    status, body = await answer(r)
    assert status == 408 and body["error"]["type"] == "invalid_request_error"
    w.close()


async def test_a_trickled_head_gets_408(server: HttpServer) -> None:
    r, w = await connect(server)
    w.write(b"GET /health HTTP/1.1\r\n")
    for _ in range(2):
        await asyncio.sleep(0.1)
        w.write(b"x-a: b\r\n")  # bytes keep coming, the head never ends
    status, _ = await answer(r)
    assert status == 408
    w.close()


async def test_the_next_request_on_a_kept_alive_connection_has_its_head_deadline(
        server: HttpServer) -> None:
    """A head that arrives whole arms no timer; one that does not, on a connection that already
    served a request, gets its own deadline from its first bytes (408 and close)."""
    r, w = await connect(server)
    w.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2)
    assert head.startswith(b"HTTP/1.1 200")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await asyncio.wait_for(r.readexactly(length), 2)
    w.write(b"GET /health HTTP/1.1\r\n")  # the next request's head never ends
    w.write(b"x-a: b\r\n")
    status, _ = await answer(r)
    assert status == 408
    w.close()


async def test_a_huge_head_gets_431(server: HttpServer) -> None:
    r, w = await connect(server)
    w.write(b"GET /health HTTP/1.1\r\nx-big: " + b"a" * 8192 + b"\r\n")  # and it goes on
    status, _ = await answer(r)
    assert status == 431
    w.close()


async def test_connections_past_the_cap_get_503_and_close(server: HttpServer) -> None:
    held = [await connect(server) for _ in range(LIMITS.max_connections)]
    await asyncio.sleep(0.05)
    extra = [await connect(server) for _ in range(30)]
    for r, _ in extra:  # each one answered and closed at once: no descriptor held
        status, body = await answer(r, 1.0)
        assert status == 503 and body["error"]["type"] == "service_unavailable"
    for _, w in held + extra:
        w.close()
    await asyncio.sleep(0.5)  # the held ones are gone (closed by us, or at their head deadline)
    r, w = await connect(server)  # room again: a normal request is served
    w.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    status, body = await answer(r)
    assert status == 200 and body["data"][0]["id"] == "tiny"
    w.close()


async def test_an_idle_kept_alive_connection_is_closed(server: HttpServer) -> None:
    r, w = await connect(server)
    w.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2)
    assert head.startswith(b"HTTP/1.1 200")
    rest = await asyncio.wait_for(r.read(), 3)  # the body, then the close at the idle timeout
    assert json.loads(rest)["object"] == "list"
    assert r.at_eof()
    w.close()


async def test_a_slow_body_gets_408(server: HttpServer) -> None:
    r, w = await connect(server)
    w.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n{\"model\":")  # the rest never comes
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 3)
    assert head.startswith(b"HTTP/1.1 408")
    w.close()


async def test_a_head_past_the_cap_gets_431_however_it_arrives(server: HttpServer) -> None:
    """Whole in one write (the cap was checked per read: a head that completed within one read
    was never measured), or behind a request on the same kept-alive connection."""
    big = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192 + b"\r\n\r\n"
    r, w = await connect(server)
    w.write(big)
    status, body = await answer(r)
    assert status == 431 and body["error"]["type"] == "invalid_request_error"
    w.close()
    r, w = await connect(server)
    w.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n" + big)  # pipelined
    raw = await asyncio.wait_for(r.read(), 3)
    assert b"HTTP/1.1 431" in raw and r.at_eof()
    w.close()


async def test_a_request_the_parser_refuses_gets_an_openai_error_body(server: HttpServer) -> None:
    r, w = await connect(server)
    w.write(b"GET /v1/models HTTP/1.1\r\nhost x no colon\r\n\r\n")
    status, body = await answer(r)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    w.close()
