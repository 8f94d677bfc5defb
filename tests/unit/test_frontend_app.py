"""The HTTP app in front of a FakePool: bytes on the wire for streamed and aggregated chat and
completions, error statuses and bodies, stream_interval, include_usage, mid-stream errors, and a
client that goes away (the request leaves its stream context: the pool records an abort)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tandem.frontend.app import FrontendApp
from tandem.frontend.preprocess import Preprocessor
from tandem.runtime import errors
from tandem.config import FrontendConfig
from tandem.runtime.wire import Delta, ErrorKind, SamplingParams
from tests.fakes import (FakePool, Hang, ServerCallsStub, asgi_post, deltas, one_token_script,
                         write_model_dir)
from tests.metrics_text import value

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKENIZE = "/tokenize"
USER = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("frontend") / "tiny")


@pytest.fixture(scope="module")
def pre(model_dir: Path) -> Preprocessor:
    return Preprocessor(model_dir, "tiny")


def ids_of(pre: Preprocessor, text: str) -> list[int]:
    return pre.tokenizer.encode(text, add_special_tokens=False).ids


def make_app(pre: Preprocessor, pool: FakePool, **config: Any) -> FrontendApp:
    return FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny",
                                      **config), pool, pre)


def client(app: FrontendApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def events(body: str) -> list[Any]:
    """The SSE events of a body, JSON-decoded; "[DONE]" stays a string."""
    assert body.endswith("\n\n")
    out = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat_texts(evs: list[Any]) -> list[str]:
    return [e["choices"][0]["delta"]["content"] for e in evs
            if isinstance(e, dict) and e.get("choices") and "content" in e["choices"][0]["delta"]
            and e["choices"][0]["delta"].get("role") is None]


async def test_chat_non_streamed(pre: Preprocessor) -> None:
    reply = ids_of(pre, "Hello world 🙂")
    pool = FakePool(reply_ids=reply)
    async with client(make_app(pre, pool)) as c:
        r = await c.post(CHAT, json={"model": "tiny", "messages": USER, "seed": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant",
                                "content": "Hello world 🙂"}, "logprobs": None,
                                "finish_reason": "length"}]
    prompt = pre.encode_chat(USER)
    assert pool.opened[0][0] == prompt
    assert pool.opened[0][1].max_tokens == 256 - len(prompt)  # chat default: rest of context
    assert pool.opened[0][1].seed == 3
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(reply),
                             "total_tokens": len(prompt) + len(reply),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert pool.aborted == []


async def test_chat_streamed_bytes(pre: Preprocessor) -> None:
    reply = ids_of(pre, "naïve 🙂 café")
    pool = FakePool(reply_ids=reply)
    async with client(make_app(pre, pool)) as c:
        r = await c.post(CHAT, json={"model": "tiny", "messages": USER, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r.text)
    assert evs[-1] == "[DONE]"
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == evs[0]["id"]
               for e in evs[:-1])
    texts = chat_texts(evs)
    assert "".join(texts) == "naïve 🙂 café" and not any("\ufffd" in t for t in texts)
    assert evs[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in evs[:-2])
    assert "usage" not in evs[-2]


async def test_openai_sdk_parses_both_modes(pre: Preprocessor) -> None:
    pool = FakePool(reply_ids=ids_of(pre, "Hi there"))
    async with client(make_app(pre, pool)) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
        done = await sdk.chat.completions.create(model="tiny", messages=USER, max_tokens=5)  # type: ignore[arg-type]
        assert done.choices[0].message.content == "Hi there"
        stream = await sdk.chat.completions.create(model="tiny", messages=USER, stream=True,  # type: ignore[arg-type]
                                                   stream_options={"include_usage": True})
        parts = [ch async for ch in stream]
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == "Hi there"
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == len(pool.reply_ids)
        comp = await sdk.completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert comp.choices[0].text == "Hi there" and comp.usage is not None
        models = await sdk.models.list()
        assert [m.id for m in models.data] == ["tiny"]


async def test_completions_streamed_and_not(pre: Preprocessor) -> None:
    pool = FakePool(reply_ids=ids_of(pre, " world"))
    async with client(make_app(pre, pool, default_max_tokens=7)) as c:
        r = await c.post(COMPLETIONS, json={"model": "tiny", "prompt": "Hello"})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == " world"
        assert pool.opened[0][0] == pre.tokenizer.encode("Hello").ids
        assert pool.opened[0][1].max_tokens == 7
        r = await c.post(COMPLETIONS, json={"prompt": [5, 6, 7], "stream": True,
                                            "stream_options": {"include_usage": True}})
        evs = events(r.text)
    assert pool.opened[1][0] == [5, 6, 7]
    assert "".join(e["choices"][0]["text"] for e in evs[:-2]) == " world"
    assert evs[-2]["choices"] == [] and evs[-2]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": len(pool.reply_ids),
        "total_tokens": 3 + len(pool.reply_ids), "prompt_tokens_details": {"cached_tokens": 0}}
    assert evs[-1] == "[DONE]"


@pytest.mark.parametrize("path, body, status, param", [
    (CHAT, b'{"messages": [', 400, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', 400,
     "max_tokens"),
    (CHAT, b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400,
     "max_tokens"),
    (CHAT, b'{"messages": []}', 400, "messages"),
    (CHAT, b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages[0].role"),
    (CHAT, b'{"messages": [{"role": "tool", "content": "x"}]}', 400, "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}', 400,
     "max_tokens"),
    (COMPLETIONS, b'{"prompt": [' + b",".join([b"1"] * 256) + b"]}", 400, "prompt"),
    (COMPLETIONS, b'{"prompt": [999999]}', 400, "prompt"),
    (COMPLETIONS, b'{"prompt": "x", "n": 65}', 400, "n"),
    (COMPLETIONS, b'{"prompt": "x", "n": 0}', 400, "n"),
    (COMPLETIONS, b'{"prompt": ["a", "b"], "n": 200}', 400, "n"),
    (COMPLETIONS, b'{"prompt": "x", "stream": true, "stream_interval": 0}', 400,
     "stream_interval"),
    (COMPLETIONS, b'{"prompt": "x", "stream": true, "stream_interval": -3}', 400,
     "stream_interval"),
    (COMPLETIONS, b'{"prompt": "x", "stream": true, "stream_interval": 2.5}', 400,
     "stream_interval"),
    # Nothing accepted and ignored: a typo (it ran to the end of the context), a made-up field,
    # vLLM's fields tandem does not apply; every one named at once.
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_token": 3}', 400,
     "max_token"),
    (COMPLETIONS, b'{"prompt": "x", "prompt_cache_key": "s", "made_up": 1}', 400,
     "prompt_cache_key,made_up"),
    (COMPLETIONS, b'{"prompt": "x", "stream": true, "stream_options": {"include_usag": true}}',
     400, "stream_options.include_usag"),
    (TOKENIZE, b'{"prompt": "x", "return_token_strs": true}', 400, "return_token_strs"),
])
async def test_bad_requests_get_status_and_openai_body(pre: Preprocessor, path: str, body: bytes,
                                                       status: int, param: str | None) -> None:
    pool = FakePool()
    async with client(make_app(pre, pool)) as c:
        r = await c.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert pool.opened == []


async def test_unavailable_is_503_with_retry_after(pre: Preprocessor) -> None:
    pool = FakePool()
    pool.unavailable = errors.Unavailable("no worker is available", retry_after=2.5)
    async with client(make_app(pre, pool)) as c:
        r = await c.post(CHAT, json={"messages": USER, "stream": True})
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "service_unavailable"
        pool.max_context = None  # no worker said hello yet
        r = await c.post(CHAT, json={"messages": USER})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"


@pytest.mark.parametrize("stream", [True, False])
async def test_error_before_first_token_keeps_its_status(pre: Preprocessor, stream: bool) -> None:
    pool = FakePool(script=lambda rid, ids, sp: [errors.BadRequest("prompt too long for engine")])
    async with client(make_app(pre, pool)) as c:
        r = await c.post(CHAT, json={"messages": USER, "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long for engine"


async def test_mid_stream_error_flushes_then_error_then_done(pre: Preprocessor) -> None:
    toks = ids_of(pre, "abc")
    pool = FakePool(script=one_token_script(toks, [errors.WorkerLost("worker fake-0 is gone")]))
    async with client(make_app(pre, pool, stream_interval=100)) as c:
        r = await c.post(CHAT, json={"messages": USER, "stream": True})
        assert r.status_code == 200
        evs = events(r.text)
        assert "".join(chat_texts(evs)) == "abc"  # the buffered text went out before the error
        assert evs[-2] == {"error": {"message": "worker fake-0 is gone", "type": "worker_lost",
                                     "param": None, "code": "worker_lost"}}
        assert evs[-1] == "[DONE]"
        r = await c.post(CHAT, json={"messages": USER})  # aggregated: the error's own status
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_lost"


@pytest.mark.parametrize("server_default, per_request, want", [
    (1, None, [1] * 10),
    (4, None, [1, 4, 4, 1]),
    (1, 3, [1, 3, 3, 3]),
    (100, None, [1, 9]),
])
async def test_stream_interval(pre: Preprocessor, server_default: int, per_request: int | None,
                               want: list[int]) -> None:
    toks = ids_of(pre, "abcdefghij")
    assert len(toks) == 10
    pool = FakePool(reply_ids=toks)
    body: dict[str, Any] = {"messages": USER, "stream": True}
    if per_request is not None:
        body["stream_interval"] = per_request
    async with client(make_app(pre, pool, stream_interval=server_default)) as c:
        r = await c.post(CHAT, json=body)
    assert [len(t) for t in chat_texts(events(r.text))] == want


@pytest.mark.parametrize("interval", [1, 3])
async def test_deltas_already_here_go_out_in_one_chunk(pre: Preprocessor, interval: int) -> None:
    """A frontend that lags finds several deltas of a stream waiting: it writes them as one chunk
    (whatever the interval), then goes on chunk by chunk; no text is lost or reordered."""
    toks = ids_of(pre, "abcdefghij")

    def script(rid: str, ids: list[int], sp: SamplingParams) -> list[Any]:
        first = [Delta(rid, i, [t]) for i, t in enumerate(toks[:6])]
        rest = [Delta(rid, 6 + i, [t], "length" if i == 3 else None) for i, t in
                enumerate(toks[6:])]
        return [*first, 0.0, *rest]  # six deltas at once, a step later the last four

    pool = FakePool(script=script, burst=True)
    async with client(make_app(pre, pool, stream_interval=interval)) as c:
        r = await c.post(CHAT, json={"messages": USER, "stream": True,
                                     "stream_options": {"include_usage": True}})
        metrics = (await c.get("/metrics")).text
    evs = events(r.text)
    assert chat_texts(evs) == ["abcdef", "ghij"]
    assert evs[-2]["usage"]["completion_tokens"] == 10 and evs[-1] == "[DONE]"
    # The merging shows: 10 tokens went out in 2 chunks.
    assert value(metrics, "tandem_generation_tokens_total") == 10
    assert value(metrics, "tandem_stream_chunks_total") == 2


async def test_stop_string_ends_the_request_early(pre: Preprocessor) -> None:
    toks = ids_of(pre, "Hello world! stop here, more text")
    pool = FakePool(script=one_token_script(toks, [Hang()]))
    async with client(make_app(pre, pool)) as c:
        r = await c.post(CHAT, json={"messages": USER, "stream": True, "stop": ["stop"],
                                     "stream_options": {"include_usage": True}})
    evs = events(r.text)
    assert "".join(chat_texts(evs)) == "Hello world! "
    assert evs[-3]["choices"][0]["finish_reason"] == "stop"
    received = len(ids_of(pre, "Hello world! stop"))
    assert evs[-2]["usage"]["completion_tokens"] >= received
    assert evs[-2]["usage"]["completion_tokens"] < len(toks)
    assert pool.aborted == [pool.streams[0].rid]


async def test_small_endpoints(pre: Preprocessor) -> None:
    pool = FakePool(reply_ids=ids_of(pre, "ok"))
    app = make_app(pre, pool)
    async with client(app) as c:
        assert (await c.get("/health")).json() == {"status": "ready"}
        pool.is_ready = False
        r = await c.get("/health")
        assert r.status_code == 503
        live = await c.get("/live")  # liveness does not depend on the workers
        assert live.status_code == 200 and live.json() == {"status": "live"}
        pool.is_ready = True
        models = (await c.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
        assert (await c.get("/workers")).json()["workers"][0]["name"] == "fake-0"
        await c.post(CHAT, json={"messages": USER, "stream": True})
        text = (await c.get("/metrics")).text
        assert value(text, "tandem_http_requests_total", endpoint="/v1/chat/completions",
                     status="200") == 1
        assert value(text, "tandem_generation_tokens_total") == len(pool.reply_ids)
        assert value(text, "tandem_request_success_total", finished_reason="length") == 1
        assert value(text, "tandem_time_to_first_token_seconds_count") == 1
        assert "tandem_worker_up" in text
        assert (await c.get("/nope")).status_code == 404
        r = await c.get(CHAT)
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


# --- the client goes away ---------------------------------------------------------------------


async def _drive(app: FrontendApp, body: dict[str, Any], send_fails_at: int | None = None,
                 disconnect_after_bodies: int | None = None,
                 disconnect_after_s: float | None = None) -> list[dict[str, Any]]:
    """Run one request through the ASGI app by hand; the client disconnects after N body
    messages or after some seconds (`http.disconnect`), or the N-th write fails."""
    sent: list[dict[str, Any]] = []
    bodies = asyncio.Event()
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        if disconnect_after_s is not None:
            await asyncio.sleep(disconnect_after_s)
        else:
            await bodies.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.body":
            n = sum(1 for m in sent if m["type"] == "http.response.body") + 1
            if n == send_fails_at:
                raise OSError("connection reset")
            if n == disconnect_after_bodies:
                bodies.set()
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": []}
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


@pytest.mark.parametrize("how", ["http.disconnect", "failed write"])
async def test_client_gone_mid_stream_aborts(pre: Preprocessor, how: str) -> None:
    toks = ids_of(pre, "abcdef")
    pool = FakePool(script=one_token_script(toks[:2], [0.01] * 50 + [Hang()]))
    app = make_app(pre, pool)
    if how == "http.disconnect":
        await _drive(app, {"messages": USER, "stream": True}, disconnect_after_bodies=2)
    else:
        pool.script = one_token_script(toks, [Hang()])
        await _drive(app, {"messages": USER, "stream": True}, send_fails_at=3)
    assert pool.aborted == [pool.streams[0].rid]
    assert pool.streams[0].exited
    assert value(app.metrics.registry.render(), "tandem_request_errors_total",
                 type="client_disconnected") == 1


async def test_client_gone_while_waiting_for_an_aggregated_reply(pre: Preprocessor) -> None:
    pool = FakePool(script=lambda rid, ids, sp: [Hang()])
    sent = await _drive(make_app(pre, pool), {"messages": USER}, disconnect_after_s=0.05)
    assert sent == []
    assert pool.aborted == [pool.streams[0].rid]


@pytest.mark.parametrize("kind, status, type_", [
    (ErrorKind.BAD_REQUEST, 400, "invalid_request_error"),
    (ErrorKind.DUPLICATE, 500, "internal_error"),
    (ErrorKind.DRAINING, 503, "service_unavailable"),
    (ErrorKind.FRONTEND_SILENT, 503, "service_unavailable"),
    (ErrorKind.KV_TRANSFER, 502, "kv_transfer_error"),
    (ErrorKind.ENGINE, 500, "engine_error"),
])
async def test_a_workers_error_kind_maps_to_its_status(pre: Preprocessor, kind: ErrorKind,
                                                       status: int, type_: str) -> None:
    """Before any token the kind is the HTTP status; mid-stream it is the error event's type."""
    def script(rid: str, ids: list[int], sp: SamplingParams) -> list[Any]:
        return [Delta(rid, 0, [], "error", error="it failed", error_kind=kind)]

    pool = FakePool(script=script)
    async with client(make_app(pre, pool)) as c:
        r = await c.post(CHAT, json={"messages": USER, "stream": True})
        assert r.status_code == status and r.json()["error"]["type"] == type_
        assert r.json()["error"]["message"] == "it failed"
        assert ("retry-after" in r.headers) == (status == 503)
        pool.script = one_token_script(ids_of(pre, "ab"), [
            Delta("x", 2, [], "error", error="it failed", error_kind=kind)])
        evs = events((await c.post(CHAT, json={"messages": USER, "stream": True})).text)
    assert "".join(chat_texts(evs)) == "ab"
    assert evs[-2]["error"]["type"] == type_ and evs[-1] == "[DONE]"


async def _asgi_stream(app: FrontendApp, body: dict[str, Any],
                       nowait: Any) -> tuple[list[bytes], list[bytes]]:
    """One POST through the app's ASGI interface with `nowait` as the server's body_nowait
    extension: (chunks written through `send`, chunks written through `nowait`)."""
    sent: list[bytes] = []
    await asgi_post(app, COMPLETIONS, json.dumps(body).encode(), sent, ServerCallsStub(nowait))
    return sent, nowait.chunks


class _Nowait:
    def __init__(self, accept: bool) -> None:
        self.accept, self.chunks = accept, []

    def __call__(self, data: bytes) -> bool:
        if self.accept:
            self.chunks.append(data)
        return self.accept


@pytest.mark.parametrize("accept", [True, False])
async def test_the_first_chunk_starts_the_response_where_its_delta_arrives(
        pre: Preprocessor, accept: bool) -> None:
    """With the server's start_nowait as well, a first delta that arrives while the response's
    task waits is pushed too: the response starts through start_nowait with that chunk (never
    through `send`), and every later chunk but the last goes out through body_nowait. A server
    that cannot start now (False) leaves the start and that chunk to the task. The client's bytes
    are the same stream."""
    toks = ids_of(pre, "abcdefghij")
    pool = FakePool(script=lambda rid, ids, sp: [0.005, *deltas(rid, toks)])  # (after it waits)
    nowait, asked, starts, sent, first = _Nowait(True), [], [], [], []

    def start_nowait(status: int, headers: Any, body: bytes) -> bool:
        asked.append(status)
        if accept:
            first.append(body)
        return accept

    await asgi_post(make_app(pre, pool), COMPLETIONS,
                    json.dumps({"prompt": "x", "max_tokens": 10, "stream": True}).encode(), sent,
                    ServerCallsStub(nowait, start_nowait), starts)
    assert asked == [200]
    if accept:
        assert starts == [] and len(first) == 1 and len(nowait.chunks) == 8 and len(sent) == 1
        stream = first[0] + b"".join(nowait.chunks) + sent[0]
    else:  # (the task writes the first chunk with what arrived before it ran)
        assert starts == [200] and 7 <= len(nowait.chunks) <= 8 and len(sent) == 2
        stream = sent[0] + b"".join(nowait.chunks) + sent[1]
    evs = events(stream.decode())
    assert evs[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == "abcdefghij"


@pytest.mark.parametrize("accept", [True, False])
async def test_tokens_between_first_and_last_are_pushed_through_body_nowait(
        pre: Preprocessor, accept: bool) -> None:
    """With the server's body_nowait, every chunk between the first and the last goes out
    through it, in order, without the response's task; a server that cannot take them now
    (returns False) gets them all through `send` instead. Either way the client's bytes are the
    same stream."""
    toks = ids_of(pre, "abcdefghij")
    nowait = _Nowait(accept)
    sent, pushed = await _asgi_stream(make_app(pre, FakePool(reply_ids=toks)),
                                      {"prompt": "x", "max_tokens": 10, "stream": True},
                                      nowait)
    if accept:
        assert len(pushed) == 8 and len(sent) == 2  # the first, and the last with [DONE]
        stream = sent[0] + b"".join(pushed) + sent[1]  # the order the client got them in
    else:  # all through `send`, by the task (what waits meanwhile may share a write)
        assert pushed == [] and 2 <= len(sent) <= 10
        stream = b"".join(sent)
    evs = events(stream.decode())
    assert evs[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == "abcdefghij"
