"""tandem.worker.health: the worker's probe port, spoken to over loopback with raw sockets."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.worker.health import HealthServer
from tests.waits import until


async def exchange(port: int, raw: bytes, *, read_timeout: float = 3.0) -> tuple[int, dict, bytes]:
    """Send raw bytes, read until the server closes; -> (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), read_timeout)  # until EOF: server closes
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def get(path: str, method: str = "GET") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"User-Agent: kube-probe/1.32\r\n\r\n").encode()


@pytest.fixture
async def server():
    state = {"ready": False, "reason": "engine loading"}

    def ready() -> tuple[bool, str]:
        return bool(state["ready"]), str(state["reason"])

    srv = HealthServer(ready, "127.0.0.1", 0, read_timeout_s=0.3, max_header_bytes=1024)
    await srv.start()
    assert srv.port > 0
    yield srv, state
    await srv.close()


async def test_live_and_health_follow_readiness(server) -> None:
    srv, state = server
    status, headers, body = await exchange(srv.port, get("/live"))
    assert status == 200 and json.loads(body) == {"status": "live"}
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(body)

    status, headers, body = await exchange(srv.port, get("/health"))
    assert status == 503
    assert json.loads(body) == {"status": "not ready", "reason": "engine loading"}
    assert headers["content-type"] == "application/json"

    state["ready"] = True
    status, _, body = await exchange(srv.port, get("/health?verbose=1"))
    assert status == 200 and json.loads(body) == {"status": "ready"}

    state.update(ready=False, reason="draining")  # SIGTERM: not ready at once
    status, _, body = await exchange(srv.port, get("/health"))
    assert status == 503 and json.loads(body)["reason"] == "draining"
    assert (await exchange(srv.port, get("/live")))[0] == 200  # still live while draining


async def test_head_has_no_body(server) -> None:
    srv, state = server
    state["ready"] = True
    status, headers, body = await exchange(srv.port, get("/health", "HEAD"))
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0


@pytest.mark.parametrize("raw, want", [
    (get("/metrics"), 404),
    (get("/"), 404),
    (get("/live", "POST"), 405),
    (get("/health", "DELETE"), 405),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET live HTTP/1.1\r\n\r\n", 400),
    (b"GET /live SPDY/3\r\n\r\n", 400),
])
async def test_errors(server, raw: bytes, want: int) -> None:
    srv, _ = server
    status, headers, _ = await exchange(srv.port, raw)
    assert status == want
    if want == 405:
        assert headers["allow"] == "GET, HEAD"


async def test_header_cap(server) -> None:
    srv, _ = server
    huge = b"GET /live HTTP/1.1\r\nX-Pad: " + b"a" * 4096 + b"\r\n\r\n"
    status, _, body = await exchange(srv.port, huge)
    assert status == 431 and b"too large" in body
    # a request under the cap is still served afterwards
    assert (await exchange(srv.port, get("/live")))[0] == 200


async def test_read_deadline(server) -> None:
    srv, _ = server
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    status, _, _ = await exchange(srv.port, b"GET /live HTTP/1.1\r\nHost: x\r\n",  # never ends
                                  read_timeout=10.0)
    assert status == 408
    # Its 0.3 s deadline ended it, not the 5 s default: the upper bound only has to stay under
    # that, with seconds to spare for a loaded machine.
    assert 0.25 <= loop.time() - t0 < 4.0


async def test_ready_raising_is_not_ready() -> None:
    def broken() -> bool:
        raise RuntimeError("oops")

    async with HealthServer(broken) as srv:
        status, _, body = await exchange(srv.port, get("/health"))
        assert status == 503 and "RuntimeError" in json.loads(body)["reason"]
        assert (await exchange(srv.port, get("/live")))[0] == 200


async def test_plain_bool_ready() -> None:
    flag = [True]
    async with HealthServer(lambda: flag[0]) as srv:
        assert (await exchange(srv.port, get("/health")))[0] == 200
        flag[0] = False
        status, _, body = await exchange(srv.port, get("/health"))
        assert status == 503 and json.loads(body)["reason"] == "not ready"


async def test_close_ends_open_connections_and_frees_the_port() -> None:
    srv = HealthServer(lambda: True, read_timeout_s=30.0)
    await srv.start()
    port = srv.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /live HTTP/1.1\r\n")  # half a request: the handler waits
    await writer.drain()
    await until(lambda: srv.num_connections == 1, every=0.005)  # the handler took it
    await asyncio.wait_for(srv.close(), 2.0)  # does not wait out the 30 s read deadline
    assert srv.num_connections == 0 and not srv.serving
    assert await asyncio.wait_for(reader.read(), 2.0) == b""  # our connection was closed
    writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    await srv.close()  # idempotent
    again = HealthServer(lambda: True, port=port)  # the port can be bound again
    await again.start()
    assert again.port == port
    await again.close()


async def test_start_twice_refused() -> None:
    async with HealthServer(lambda: True) as srv:
        with pytest.raises(RuntimeError):
            await srv.start()


async def test_many_concurrent_probes() -> None:
    async with HealthServer(lambda: (True, "")) as srv:
        results = await asyncio.gather(*(exchange(srv.port, get("/health")) for _ in range(50)))
        assert [r[0] for r in results] == [200] * 50
        await until(lambda: srv.num_connections == 0, every=0.005)  # each handler ends once it has answered
