"""Work that would stall the frontend's event loop runs off it, sized by the work itself: a large
prompt is tokenized in a thread by the tokenizer's call that releases the GIL (its single `encode`
holds it for all its work: a thread running it stalls the loop as long, 4-5 s for 3.9M characters
here), a chat template over many messages (even empty ones) renders in a thread, and small
requests stay on the loop with the cheaper calls. The stalls themselves are measured by
perf/streaming/bench_large_response.py (perf/results/loop_stall.md)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.config import FrontendConfig
from tandem.frontend.app import FrontendApp
from tandem.frontend.prepare import MESSAGE_COST, THREAD_CHARS
from tandem.frontend.preprocess import Preprocessor
from tests.fakes import FakePool, write_model_dir


class SpyTokenizer:
    """The real tokenizer, recording each call's name and whether it ran on the loop's thread."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[tuple[str, bool]] = []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.real, name)
        if name not in ("encode", "encode_batch", "decode", "decode_batch"):
            return fn

        def call(*a: Any, **k: Any) -> Any:
            self.calls.append((name, threading.current_thread() is threading.main_thread()))
            return fn(*a, **k)
        return call


@pytest.fixture
def pre(tmp_path: Path) -> Preprocessor:
    p = Preprocessor(write_model_dir(tmp_path / "tiny"), "tiny")
    p.tokenizer = SpyTokenizer(p.tokenizer)  # type: ignore[assignment]
    return p


def client(pre: Preprocessor) -> httpx.AsyncClient:
    app = FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny"),
                      FakePool(reply_ids=[5]), pre)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.parametrize("path, body", [
    ("/tokenize", lambda text: {"prompt": text}),
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 1}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}],
                                           "max_tokens": 1}),
])
async def test_a_large_prompt_is_tokenized_off_the_loop_by_a_call_that_releases_the_gil(
        pre: Preprocessor, path: str, body: Any) -> None:
    async with client(pre) as c:
        small = await c.post(path, json={"model": "tiny", **body("hello there")})
        assert small.status_code == 200, small.text
        assert pre.tokenizer.calls == [("encode", True)]  # small: on the loop, the cheap call
        pre.tokenizer.calls.clear()
        big = await c.post(path, json={"model": "tiny", **body("hello there " * THREAD_CHARS)})
        # (a generation request that long is then refused for the tiny model's context)
        assert big.status_code == 200 or "maximum context length" in big.text, big.text
    assert pre.tokenizer.calls == [("encode_batch", False)]


async def test_a_large_detokenize_is_off_the_loop_too(pre: Preprocessor) -> None:
    async with client(pre) as c:
        r = await c.post("/detokenize", json={"model": "tiny", "tokens": [5] * (THREAD_CHARS + 1)})
    assert r.status_code == 200
    assert pre.tokenizer.calls == [("decode_batch", False)]


async def test_a_template_over_many_messages_renders_off_the_loop_whatever_their_length(
        pre: Preprocessor, monkeypatch: pytest.MonkeyPatch) -> None:
    """4,096 empty messages are little text but much template work: sized by messages too."""
    rendered: list[bool] = []
    real = pre.render_chat

    def spy(*a: Any, **k: Any) -> str:
        rendered.append(threading.current_thread() is threading.main_thread())
        return real(*a, **k)

    monkeypatch.setattr(pre, "render_chat", spy)
    n = THREAD_CHARS // MESSAGE_COST + 1
    messages = [{"role": "user", "content": ""}] * n
    async with client(pre) as c:
        few = await c.post("/tokenize", json={"model": "tiny", "messages": messages[:2]})
        many = await c.post("/tokenize", json={"model": "tiny", "messages": messages})
    assert few.status_code == many.status_code == 200, (few.text, many.text)
    assert rendered == [True, False]


async def test_large_jobs_off_the_loop_run_a_few_at_a_time(
        pre: Preprocessor, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each large tokenization can hold hundreds of MB (a 3.9M-character prompt: about 0.8 GB
    here), so at most OFF_LOOP_JOBS run at once; the others wait their turn."""
    import asyncio
    import time

    from tandem.frontend import prepare as prepare_module

    monkeypatch.setattr(prepare_module, "OFF_LOOP_JOBS", 1)
    running, most = [0], [0]
    lock = threading.Lock()
    real = pre.tokenizer.real

    class Slow:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def encode_batch(self, *a: Any, **k: Any) -> Any:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.1)  # (long enough for the others to start, were they let)
            with lock:
                running[0] -= 1
            return real.encode_batch(*a, **k)

    pre.tokenizer = Slow()  # type: ignore[assignment]
    text = "hello there " * THREAD_CHARS
    async with client(pre) as c:
        replies = await asyncio.gather(*(c.post("/tokenize", json={"model": "tiny",
                                                                 "prompt": text})
                                         for _ in range(4)))
    assert [r.status_code for r in replies] == [200] * 4
    assert most[0] == 1
