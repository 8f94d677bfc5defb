"""A non-streamed response with logprobs is bounded and built as it goes: what it may carry
(choices x max_tokens x (1 + top logprobs)) past --max-response-logprobs is a 400 naming the limit
before anything reaches a worker (a stream is not capped), and its logprobs are rendered to JSON
as their deltas arrive, not all at the end, into the same bytes as the objects built whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tandem.config import FrontendConfig
from tandem.frontend import openai_api as api
from tandem.frontend import schemas
from tandem.frontend.app import FrontendApp
from tandem.frontend.choice import ChoiceSpec, GenerationJob, RichChoiceState
from tandem.frontend.preprocess import Preprocessor
from tandem.runtime.wire import Delta, SamplingParams, TokenLogprobs, Usage
from tests.fakes import FakePool, write_model_dir

TOKENS = [40, 41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("logprobs") / "tiny")


@pytest.fixture(scope="module")
def pre(model_dir: Path) -> Preprocessor:
    return Preprocessor(model_dir, "tiny")


def lp(t: int) -> TokenLogprobs:
    return TokenLogprobs(t, -0.25 - t / 100, [(t, -0.25), (t + 1, -1.5)])


def script(rid: str, prompt: list[int], sp: SamplingParams) -> list[Delta]:
    """The tokens three at a time, with logprobs and two alternatives each."""
    out = []
    for i in range(0, len(TOKENS), 3):
        chunk = TOKENS[i:i + 3]
        last = i + 3 >= len(TOKENS)
        out.append(Delta(rid, i, chunk, "length" if last else None,
                         Usage(1, len(TOKENS)) if last else None, logprobs=[lp(t) for t in chunk]))
    return out


async def post(pre: Preprocessor, cap: int,
               body: dict[str, Any]) -> tuple[FakePool, httpx.Response]:
    pool = FakePool(script=script)
    app = FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny",
                                     max_response_logprobs=cap), pool, pre)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
            "top_logprobs": 2, **body})
    return pool, r


async def test_a_non_streamed_response_past_the_logprobs_cap_gets_400_naming_it(
        pre: Preprocessor) -> None:
    # 2 choices x 10 tokens x (1 + 2) = 60: at the cap, served.
    pool, r = await post(pre, 60, {"n": 2, "max_tokens": 10})
    assert r.status_code == 200 and len(pool.opened) == 2
    # One token more per choice: 66, refused before anything reaches a worker.
    for field in ("max_tokens", "max_completion_tokens"):
        pool, r = await post(pre, 60, {"n": 2, field: 11})
        assert r.status_code == 400 and pool.opened == []
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == field
        assert "at most 60 token logprobs" in err["message"] and "66" in err["message"]
    # A stream is written as it is made: not capped.
    pool, r = await post(pre, 60, {"n": 2, "max_tokens": 11, "stream": True})
    assert r.status_code == 200 and len(pool.opened) == 2 and r.text.endswith("[DONE]\n\n")


async def test_the_body_carries_the_logprobs_built_whole(pre: Preprocessor) -> None:
    _, r = await post(pre, 10_000, {"n": 2, "max_tokens": 10})
    want = msgspec.json.decode(msgspec.json.encode(
        api.chat_logprobs([lp(t) for t in TOKENS], pre.detokenizers.token)))
    assert [c["logprobs"] for c in r.json()["choices"]] == [want, want]


def test_logprobs_json_is_the_object_encoded_whole(pre: Preprocessor) -> None:
    token, lps = pre.detokenizers.token, [lp(t) for t in TOKENS]
    chat = api.LogprobsJson(schemas.ChatLogprobs([]))
    assert bytes(api.LogprobsJson(schemas.ChatLogprobs([])).raw()) == \
        msgspec.json.encode(schemas.ChatLogprobs([]))  # no tokens
    for part in (lps[:1], lps[1:4], [], lps[4:]):
        chat.add(api.chat_logprobs(part, token))
    assert bytes(chat.raw()) == msgspec.json.encode(api.chat_logprobs(lps, token))
    text = api.LogprobsJson(schemas.CompletionLogprobs([], [], [], []))
    offset = 5
    for part in (lps[:2], lps[2:]):
        out = api.completion_logprobs(part, token, offset)
        offset = out.text_offset[-1] + len(out.tokens[-1])
        text.add(out)
    assert bytes(text.raw()) == msgspec.json.encode(api.completion_logprobs(lps, token, 5))


def test_an_aggregated_choice_renders_its_logprobs_as_each_delta_arrives(
        pre: Preprocessor) -> None:
    sp = SamplingParams(max_tokens=len(TOKENS), logprobs=2)
    spec = ChoiceSpec(0, [5], sp, pre.detokenizers.new((), [5], True, False))
    job = GenerationJob("chat", "tiny", False, False, 1, 0.0, [spec], logprobs=2,
                        token=pre.detokenizers.token)
    st = RichChoiceState(job, spec, 0, "rid", 0)
    for d in script("rid", [5], sp):
        st.feed(d)
        assert st.lps == []  # rendered now: nothing is left to build at the end
    raw = st.body_logprobs()
    assert raw is not None
    assert bytes(raw) == msgspec.json.encode(
        api.chat_logprobs([lp(t) for t in TOKENS], pre.detokenizers.token))
