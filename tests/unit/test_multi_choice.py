"""Several choices in one response (n > 1, a list of prompts) through the HTTP app in front of a
FakePool: indexes, per-choice finish reasons, summed usage, seeds, one failing choice failing the
response, and a client that goes away (every choice's stream left, unfinished ones aborted)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tandem.frontend import sse
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.choice import ChoiceState
from tandem.runtime import errors
from tandem.runtime.wire import Delta, ErrorKind, SamplingParams
from tests.fakes import FakePool, Hang, Item, deltas, write_model_dir
from tests.metrics_text import value
from tests.unit.test_frontend_app import COMPLETIONS, CHAT, client, events, make_app

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta"]


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor(write_model_dir(tmp_path_factory.mktemp("multi") / "tiny"), "tiny")


def by_choice(pre: Preprocessor, fail_on: int | None = None, per: int = 1,
              tail: list[Item] | None = None):
    """A script whose k-th opened stream says WORDS[k] (one token a delta); stream `fail_on`
    sends a token then fails with WorkerLost; `tail` (if given) replaces every finish."""
    count = [0]

    def script(rid: str, ids: list[int], sp: SamplingParams) -> list[Item]:
        k = count[0]
        count[0] += 1
        toks = pre.tokenizer.encode(" " + WORDS[k % len(WORDS)], add_special_tokens=False).ids
        if k == fail_on:
            return [Delta(rid, 0, toks[:1]), 0.01, errors.WorkerLost("worker tcp://x is gone")]
        if tail is not None:
            return [Delta(rid, i, [t]) for i, t in enumerate(toks)] + list(tail)
        return deltas(rid, toks, per=per, finish="stop" if k % 2 else "length")
    return script


def choices_of(evs: list[Any]) -> dict[int, dict[str, Any]]:
    """index -> {"text", "finish"} reassembled from streamed chunks (completions or chat)."""
    out: dict[int, dict[str, Any]] = {}
    for e in evs:
        if not isinstance(e, dict):
            continue
        for c in e.get("choices", []):
            got = out.setdefault(c["index"], {"text": "", "finish": None})
            assert got["finish"] is None, "a chunk after the choice finished"
            got["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            got["finish"] = c["finish_reason"]
    return out


@pytest.mark.parametrize("prompt, n", [("Hi", 3), (["Hi", "Yo"], 2), ([[5, 6], [7], [8]], 1)])
async def test_streamed_choices_interleave_by_index(pre: Preprocessor, prompt: object,
                                                    n: int) -> None:
    pool = FakePool(script=by_choice(pre))
    async with client(make_app(pre, pool)) as c:
        r = await c.post(COMPLETIONS, json={"prompt": prompt, "n": n, "stream": True,
                                            "max_tokens": 8, "stream_options":
                                            {"include_usage": True}})
    evs = events(r.text)
    k = len(pool.opened)
    assert k == (len(prompt) if isinstance(prompt, list) else 1) * n
    got = choices_of(evs)
    assert sorted(got) == list(range(k))
    for i in range(k):  # pool.open is called in index order
        assert got[i]["text"] == " " + WORDS[i]
        assert got[i]["finish"] == ("stop" if i % 2 else "length")
    usage = evs[-2]["usage"]
    toks = sum(len(pre.tokenizer.encode(" " + WORDS[i], add_special_tokens=False).ids)
               for i in range(k))
    assert usage["completion_tokens"] == toks
    prompts = prompt if isinstance(prompt, list) else [prompt]
    assert usage["prompt_tokens"] == sum(len(pool.opened[p * n][0]) for p in range(len(prompts)))
    assert evs[-1] == "[DONE]"
    assert pool.aborted == []


async def test_aggregated_chat_choices_and_seeds(pre: Preprocessor) -> None:
    pool = FakePool(script=by_choice(pre, per=2))
    async with client(make_app(pre, pool)) as c:
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "n": 4,
                                     "seed": 100})
    body = r.json()
    assert r.status_code == 200
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    assert [ch["message"]["content"] for ch in body["choices"]] == [" " + w for w in WORDS[:4]]
    assert [sp.seed for _, sp in pool.opened] == [100, 101, 102, 103]
    assert body["usage"]["completion_tokens"] == sum(
        len(pre.tokenizer.encode(" " + w, add_special_tokens=False).ids) for w in WORDS[:4])


async def test_chat_streamed_choices_each_get_a_role(pre: Preprocessor) -> None:
    pool = FakePool(script=by_choice(pre))
    async with client(make_app(pre, pool)) as c:
        r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                     "stream": True})
    evs = events(r.text)
    roles = [c["index"] for e in evs[:-1] for c in e["choices"] if c["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    assert {i: v["text"] for i, v in choices_of(evs).items()} == {0: " alpha", 1: " beta"}


@pytest.mark.parametrize("stream", [True, False])
async def test_one_failing_choice_fails_the_response(pre: Preprocessor, stream: bool) -> None:
    pool = FakePool(script=by_choice(pre, fail_on=2, tail=[0.01] * 20 + [Hang()]))
    app = make_app(pre, pool)
    async with client(app) as c:
        r = await c.post(COMPLETIONS, json={"prompt": "Hi", "n": 4, "stream": stream})
    if stream:
        assert r.status_code == 200
        evs = events(r.text)
        assert evs[-1] == "[DONE]" and "error" in evs[-2]
        assert "gone" in evs[-2]["error"]["message"]
        assert all(v["finish"] is None for v in choices_of(evs).values())
    else:
        assert r.status_code >= 500 and "gone" in r.json()["error"]["message"]
    assert all(s.exited for s in pool.streams)
    others = [s.rid for i, s in enumerate(pool.streams) if i != 2]
    assert sorted(pool.aborted) == sorted(others)


async def test_failure_before_any_token_keeps_its_status(pre: Preprocessor) -> None:
    def script(rid: str, ids: list[int], sp: SamplingParams) -> list[Item]:
        if rid == "fake2":
            return [errors.Unavailable("draining", retry_after=1)]
        return [Hang()]
    pool = FakePool(script=script)
    async with client(make_app(pre, pool)) as c:
        r = await c.post(COMPLETIONS, json={"prompt": ["a", "b"], "stream": True})
    assert r.status_code == 503
    assert pool.aborted == ["fake1"]


async def test_stream_interval_per_choice(pre: Preprocessor) -> None:
    toks = pre.tokenizer.encode(" a b c d e f g", add_special_tokens=False).ids
    pool = FakePool(script=lambda rid, ids, sp: deltas(rid, toks))
    async with client(make_app(pre, pool)) as c:
        r = await c.post(COMPLETIONS, json={"prompt": "x", "n": 2, "stream": True,
                                            "stream_interval": 3})
    evs = events(r.text)
    for i in (0, 1):
        chunks = [c for e in evs[:-1] for c in e["choices"] if c["index"] == i]
        # the first token at once, then every 3 tokens, the finish always flushed
        assert len(chunks) == 1 + (len(toks) - 1 + 2) // 3
        assert "".join(c["text"] for c in chunks) == " a b c d e f g"


async def test_deltas_already_waiting_merge_per_choice(pre: Preprocessor) -> None:
    """A lagging frontend finds each choice's deltas waiting: one chunk per choice carries them."""
    toks = pre.tokenizer.encode(" a b c d e f g", add_special_tokens=False).ids
    pool = FakePool(script=lambda rid, ids, sp: deltas(rid, toks), burst=True)
    async with client(make_app(pre, pool)) as c:
        r = await c.post(COMPLETIONS, json={"prompt": "x", "n": 2, "stream": True})
    evs = events(r.text)
    for i in (0, 1):
        chunks = [c for e in evs[:-1] for c in e["choices"] if c["index"] == i]
        assert [(c["text"], c["finish_reason"]) for c in chunks] == [(" a b c d e f g", "length")]


async def test_client_gone_cancels_and_aborts_every_choice(pre: Preprocessor) -> None:
    pool = FakePool(script=by_choice(pre, tail=[0.01] * 50 + [Hang()]))
    app = make_app(pre, pool)
    sent: list[dict[str, Any]] = []
    got_body = asyncio.Event()
    request = [{"type": "http.request", "more_body": False,
                "body": json.dumps({"prompt": ["a", "b", "c"], "n": 2, "stream": True}).encode()}]

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        await got_body.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)
        if msg["type"] == "http.response.body":
            got_body.set()

    scope = {"type": "http", "method": "POST", "path": COMPLETIONS, "headers": []}
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    assert len(pool.streams) == 6
    assert all(s.exited for s in pool.streams)
    assert sorted(pool.aborted) == sorted(s.rid for s in pool.streams)
    assert app.num_in_flight == 0
    assert value(app.metrics.registry.render(), "tandem_request_errors_total",
                 type="client_disconnected") == 1


# --- one choice's state, without any I/O ---------------------------------------------------------
def chunks_of(data: bytes) -> list[tuple[str, str | None]]:
    if not data:
        return []
    return [(c["text"], c["finish_reason"]) for e in events(data.decode()) if isinstance(e, dict)
            for c in e["choices"]]


def test_choice_state_first_text_at_once_then_every_interval_then_the_finish(
        pre: Preprocessor) -> None:
    toks = pre.tokenizer.encode(" a b c d e", add_special_tokens=False).ids
    enc = sse.ChunkEncoder("completion", "cmpl-x", 1, "tiny")
    st = ChoiceState(pre.detokenizers.new(), enc, 2)
    out = [chunks_of(st.feed(Delta("r", i, [t], "length" if i == len(toks) - 1 else None)))
           for i, t in enumerate(toks)]
    want = [1] + [int(i % 2 == 0) for i in range(1, len(toks) - 1)] + [1]
    assert [len(o) for o in out] == want
    assert "".join(t for o in out for t, _ in o) == " a b c d e"
    assert out[-1][-1][1] == "length" and st.finish == "length"
    assert st.num_tokens == len(toks) and st.num_chunks == sum(map(len, out))


def test_choice_state_stop_string_error_and_flush(pre: Preprocessor) -> None:
    toks = pre.tokenizer.encode("Hi there STOP more", add_special_tokens=False).ids
    st = ChoiceState(pre.detokenizers.new(["STOP"]), None, 1)  # aggregated: nothing to write
    for i, t in enumerate(toks):
        assert st.feed(Delta("r", i, [t])) == b""
        if st.finish is not None:
            break
    assert (st.text, st.finish) == ("Hi there ", "stop")
    enc = sse.ChunkEncoder("completion", "cmpl-x", 1, "tiny")
    st = ChoiceState(pre.detokenizers.new(), enc, 100)
    first = pre.tokenizer.decode(toks[:1])
    assert chunks_of(st.feed(Delta("r", 0, toks[:1]))) == [(first, None)]  # the first at once
    assert st.feed(Delta("r", 1, toks[1:3])) == b""  # held by the interval
    with pytest.raises(errors.TandemError) as e:
        st.feed(Delta("r", 3, [], "error", error="boom", error_kind=ErrorKind.KV_TRANSFER))
    assert e.value.status == 502 and st.finish is None
    assert chunks_of(st.flush()) == [(pre.tokenizer.decode(toks[1:3]), None)]  # then the error
