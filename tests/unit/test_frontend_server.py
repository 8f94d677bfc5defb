"""The frontend on a real listening socket, for each HTTP backend (uvicorn, granian embedded): the
OpenAI SDK streams through it, a client that disconnects aborts its request, a client that does not
read holds the stream back, and stopping drains then cancels."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tandem.frontend.app import FrontendApp
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.server import HttpServer, make_server
from tandem.config import FrontendConfig
from tests.fakes import FakePool, Hang, deltas, one_token_script, write_model_dir

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor(write_model_dir(tmp_path_factory.mktemp("server") / "tiny"), "tiny")


def ids_of(pre: Preprocessor, text: str) -> list[int]:
    return pre.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture(params=["uvicorn", "granian"])
async def live(pre: Preprocessor, request: pytest.FixtureRequest
               ) -> AsyncIterator[tuple[HttpServer, FakePool]]:
    pool = FakePool()
    app = FrontendApp(FrontendConfig(served_model_name="tiny"), pool, pre)
    server = make_server(app, "127.0.0.1", 0, request.param, drain_timeout_s=0.5)
    await server.start()
    try:
        yield server, pool
    finally:
        await server.stop()


async def test_real_server_client_disconnect_aborts(pre: Preprocessor,
                                                    live: tuple[HttpServer, FakePool]) -> None:
    server, pool = live
    pool.script = one_token_script(ids_of(pre, "ab"), [Hang()])
    url = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=url) as c:
        async with c.stream("POST", CHAT, json={"messages": USER, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if '"content":"a' in line:
                    break
    await asyncio.wait_for(pool.exited.wait(), timeout=5)
    assert pool.aborted == [pool.streams[0].rid]


async def test_real_server_client_leaving_before_an_aggregated_reply_aborts(
        pre: Preprocessor, live: tuple[HttpServer, FakePool]) -> None:
    server, pool = live
    pool.script = one_token_script(ids_of(pre, "ab"), [Hang()])  # no reply ever starts
    url = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=url) as c:
        with pytest.raises(httpx.ReadTimeout):  # (the client closes the connection)
            await c.post(CHAT, json={"messages": USER}, timeout=httpx.Timeout(5, read=0.5))
    await asyncio.wait_for(pool.exited.wait(), timeout=5)
    assert pool.aborted == [pool.streams[0].rid]


async def test_real_server_streams_to_the_sdk(pre: Preprocessor,
                                              live: tuple[HttpServer, FakePool]) -> None:
    server, pool = live
    pool.reply_ids = ids_of(pre, "Hello 🙂 world")
    sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                             max_retries=0)
    try:
        stream = await sdk.chat.completions.create(model="tiny", messages=USER, stream=True)  # type: ignore[arg-type]
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream])
    finally:
        await sdk.close()
    assert text == "Hello 🙂 world"
    async with httpx.AsyncClient() as c:
        health = await c.get(f"http://127.0.0.1:{server.port}/health")
    assert health.status_code == 200


async def test_a_first_token_after_the_task_waits_starts_a_correct_response(
        pre: Preprocessor, live: tuple[HttpServer, FakePool],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first delta arrives while the response's task waits: on uvicorn the response starts
    where it arrives, head and first chunk in one write (tandem's START_NOWAIT runs uvicorn's own
    start), on granian through the task. Either way the head, the stream, and the next request
    on the same connection are right."""
    from tandem.frontend.uvicorn_protocol import Extensions

    started: list[bool] = []
    real = Extensions.start_nowait

    def counted(self: Extensions, status: int, headers: object, body: bytes) -> bool:
        started.append(real(self, status, headers, body))
        return started[-1]

    monkeypatch.setattr(Extensions, "start_nowait", counted)
    server, pool = live
    toks = ids_of(pre, "Hello 🙂 world")
    pool.script = lambda rid, ids, sp: [0.02, *deltas(rid, toks)]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as c:
        for _ in range(2):  # (one keep-alive connection)
            async with c.stream("POST", CHAT, json={"messages": USER, "stream": True}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                body = (await r.aread()).decode()
            evs = [ln[6:] for ln in body.split("\n") if ln.startswith("data: ")]
            assert evs[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                           for e in evs[:-1] if json.loads(e)["choices"])
            assert text == "Hello 🙂 world"
    assert len(pool.streams) == 2 and pool.aborted == []
    assert started == ([True, True] if type(server).__name__ == "UvicornServer" else [])


async def test_stop_drains_then_cancels_what_is_left(pre: Preprocessor,
                                                     live: tuple[HttpServer, FakePool]) -> None:
    server, pool = live
    pool.script = one_token_script(ids_of(pre, "ab"), [Hang()])
    url = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=url) as c:
        async with c.stream("POST", CHAT, json={"messages": USER, "stream": True}) as r:
            assert r.status_code == 200
            stopping = asyncio.create_task(server.stop())
            await asyncio.sleep(0.1)
            assert server.app.draining
            with pytest.raises(httpx.HTTPError):
                async for _ in r.aiter_lines():
                    pass
    await asyncio.wait_for(stopping, timeout=10)
    assert pool.aborted == [pool.streams[0].rid]


async def test_a_client_that_does_not_read_holds_back_the_stream(
        pre: Preprocessor, live: tuple[HttpServer, FakePool]) -> None:
    server, pool = live
    total = 100_000
    pool.script = one_token_script(ids_of(pre, "a") * total, finish="length")
    body = json.dumps({"messages": USER, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                 b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    left = -1
    while loop.time() < deadline:  # wait until the app stops consuming deltas: writes block
        await asyncio.sleep(0.3)
        now_left = pool.streams[0].remaining if pool.streams else -1
        if now_left == left and left > 0:
            break
        left = now_left
    assert 0 < left < total, "the app kept consuming deltas for a client that reads nothing"
    writer.close()
    await asyncio.wait_for(pool.exited.wait(), timeout=10)
    assert pool.aborted == [pool.streams[0].rid]
