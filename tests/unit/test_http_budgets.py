"""What all clients together may make one server hold, on a real listening socket (uvicorn): the
budget of request-body bytes being received over every connection (a body that would pass it gets
503 with Retry-After; its bytes, and those of a body that completes, fails or is abandoned, all
come back), and the cap on one client address's connections (past it 503 and close, at once,
while another client is still served)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from tandem.config import FrontendConfig
from tandem.frontend.app import FrontendApp
from tandem.frontend.limits import HttpLimits
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.server import HttpServer, UvicornServer, make_server
from tests.fakes import FakePool, write_model_dir
from tests.waits import until

BUDGET = 1000  # bytes of bodies in flight, over all connections
# Deadlines far past any test's length: a held connection is only closed by what is tested.
LIMITS = HttpLimits(max_connections=20, header_timeout_s=60.0, idle_timeout_s=60.0,
                    max_connections_per_client=5)


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor(write_model_dir(tmp_path_factory.mktemp("budgets") / "tiny"), "tiny")


async def serve(pre: Preprocessor, body_timeout_s: float = 60.0) -> HttpServer:
    config = FrontendConfig(served_model_name="tiny", max_body_bytes_in_flight=BUDGET,
                            http_body_timeout_s=body_timeout_s)
    s = make_server(FrontendApp(config, FakePool(), pre), "127.0.0.1", 0, "uvicorn",
                    drain_timeout_s=0.2, limits=LIMITS)
    await s.start()
    return s


@pytest.fixture
async def server(pre: Preprocessor) -> AsyncIterator[HttpServer]:
    s = await serve(pre)
    try:
        yield s
    finally:
        await s.stop()


def completion(size: int) -> bytes:
    """A valid completions request body of exactly `size` bytes (padded in its `user` field)."""
    bare = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 1, "user": ""}).encode()
    return json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 1,
                       "user": "a" * (size - len(bare))}).encode()


def post_head(length: int | None) -> bytes:
    framing = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + framing + b"\r\n\r\n")


async def response(r: asyncio.StreamReader) -> tuple[int, dict[str, str], dict]:
    """Status, headers and JSON body of the next response on the connection."""
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await asyncio.wait_for(r.readexactly(int(headers["content-length"])), 5)
    return int(lines[0].split(" ")[1]), headers, json.loads(body)


async def connect(s: HttpServer, host: str = "127.0.0.1"
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", s.port, local_addr=(host, 0))


async def test_a_body_past_the_budget_gets_503_and_every_byte_comes_back(
        server: HttpServer) -> None:
    bodies = server.app.bodies
    a_body = completion(800)
    ra, wa = await connect(server)  # A: 600 of its 800 bytes, held
    wa.write(post_head(800) + a_body[:600])
    await until(lambda: bodies.in_flight == 600, every=0.005)
    # B declares more than is free: refused before it sends its body.
    rb, wb = await connect(server)
    wb.write(post_head(600))
    status, headers, err = await response(rb)
    assert status == 503 and headers["retry-after"] == "1"
    assert err["error"]["type"] == "service_unavailable" and str(BUDGET) in err["error"]["message"]
    assert bodies.in_flight == 600
    # C declares nothing (chunked): its first 300 bytes fit, the next 300 do not.
    rc, wc = await connect(server)
    wc.write(post_head(None) + b"12c\r\n" + b"a" * 300 + b"\r\n")
    await until(lambda: bodies.in_flight == 900, every=0.005)
    wc.write(b"12c\r\n" + b"a" * 300 + b"\r\n")
    status, headers, err = await response(rc)
    assert status == 503 and headers["retry-after"] == "1"
    assert bodies.in_flight == 600  # C's 300 came back with its refusal
    # A's body completes: it is served, and the budget is whole again.
    wa.write(a_body[600:])
    status, _, ok = await response(ra)
    assert status == 200 and ok["object"] == "text_completion"
    assert bodies.in_flight == 0
    # With room again, B's body is taken (on a new connection: the refused request's body, never
    # sent, is what the old one expects next).
    rb, wd = await connect(server)
    wd.write(post_head(600) + completion(600))
    status, _, _ = await response(rb)
    assert status == 200 and bodies.in_flight == 0
    for w in (wa, wb, wc, wd):
        w.close()


@pytest.mark.parametrize("how", ["leaves", "too_slow"])
async def test_a_body_that_never_completes_gives_its_bytes_back(pre: Preprocessor,
                                                                how: str) -> None:
    s = await serve(pre, body_timeout_s=0.5 if how == "too_slow" else 60.0)
    try:
        bodies = s.app.bodies
        r, w = await connect(s)
        w.write(post_head(800) + completion(800)[:600])
        await until(lambda: bodies.in_flight == 600, every=0.005)
        if how == "leaves":
            w.close()
            await until(lambda: bodies.in_flight == 0, every=0.005)
        else:
            status, _, err = await response(r)  # the body deadline passes: 408
            assert status == 408 and err["error"]["type"] == "invalid_request_error"
            assert bodies.in_flight == 0
            w.close()
    finally:
        await s.stop()


async def test_a_body_larger_than_the_whole_budget_gets_413_at_once(server: HttpServer) -> None:
    r, w = await connect(server)
    w.write(post_head(BUDGET + 1))  # no body sent: refused on its declared length
    status, _, err = await response(r)
    assert status == 413 and err["error"]["type"] == "invalid_request_error"
    assert server.app.max_body_bytes == BUDGET and server.app.bodies.in_flight == 0
    w.close()


async def test_one_clients_connections_past_its_cap_get_503_and_others_are_served(
        server: HttpServer) -> None:
    assert isinstance(server, UvicornServer)
    clients = server.protocol.clients  # type: ignore[attr-defined]
    cap = LIMITS.per_client
    held = [await connect(server) for _ in range(cap)]  # idle: kept (deadlines far away)
    extra = [await connect(server) for _ in range(3)]
    for r, _ in extra:  # answered and closed at once
        raw = await asyncio.wait_for(r.read(), 5)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head
        assert json.loads(body)["error"]["type"] == "service_unavailable"
    assert clients == {"127.0.0.1": cap}
    # Another client address is served meanwhile.
    r, w = await connect(server, "127.0.0.2")
    w.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _, models = await response(r)
    assert status == 200 and models["data"][0]["id"] == "tiny"
    w.close()
    # The first client's connections, once closed, are its own again.
    for _, hw in held + extra:
        hw.close()
    await until(lambda: "127.0.0.1" not in clients, every=0.005)
    r, w = await connect(server)
    w.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _, _ = await response(r)
    assert status == 200 and clients["127.0.0.1"] == 1
    w.close()


def test_the_per_client_cap_defaults_to_half_the_connections() -> None:
    assert HttpLimits.of(FrontendConfig(max_connections=10_000)).per_client == 5_000
    assert HttpLimits.of(FrontendConfig(max_connections=1)).per_client == 1
    assert HttpLimits.of(FrontendConfig(max_connections_per_client=7)).per_client == 7
