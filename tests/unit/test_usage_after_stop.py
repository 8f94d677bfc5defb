"""Usage counts what the client was given: a stop string's last token, and none after it, however
the deltas merged on the way (one token per delta, or all in one: the same count, and as many
logprobs as tokens counted)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tandem.config import FrontendConfig
from tandem.frontend.app import FrontendApp
from tandem.frontend.preprocess import Preprocessor
from tandem.runtime.wire import Delta, SamplingParams, TokenLogprobs, Usage
from tests.fakes import FakePool, write_model_dir

TEXT = "The cat sat on the mat and then the dog ran far away"
STOP = " the dog"


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor(write_model_dir(tmp_path_factory.mktemp("stop") / "tiny"), "tiny")


def script(ids: list[int], per: int) -> Any:
    def make(rid: str, prompt: list[int], sp: SamplingParams) -> list[Delta]:
        out = []
        for i in range(0, len(ids), per):
            chunk = ids[i:i + per]
            last = i + per >= len(ids)
            out.append(Delta(rid, i, chunk, "length" if last else None,
                             Usage(1, len(ids)) if last else None,
                             logprobs=[TokenLogprobs(t, -1.0) for t in chunk]))
        return out
    return make


async def post(pre: Preprocessor, ids: list[int], per: int, body: dict[str, Any]) -> dict:
    app = FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny"),
                      FakePool(script=script(ids, per)), pre)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 64,
                                                  "stop": [STOP], **body})
    assert r.status_code == 200
    if not body.get("stream"):
        return r.json()
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    return {"usage": chunks[-1]["usage"],
            "text": "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]),
            "logprobs": sum((ch["choices"][0]["logprobs"]["tokens"] for ch in chunks
                             if ch["choices"] and ch["choices"][0].get("logprobs")), [])}


@pytest.mark.parametrize("stream", [False, True])
async def test_tokens_after_a_stop_string_are_not_counted_however_they_merged(
        pre: Preprocessor, stream: bool) -> None:
    ids = pre.tokenizer.encode(TEXT, add_special_tokens=False).ids
    # The token that completes the stop string: the fewest leading tokens whose text holds it.
    given = next(n for n in range(1, len(ids) + 1)
                 if STOP in pre.tokenizer.decode(ids[:n]))
    assert given < len(ids)  # (tokens do come after it)
    body: dict[str, Any] = {"logprobs": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    for per in (1, 3, len(ids)):
        out = await post(pre, ids, per, body)
        assert out["usage"]["completion_tokens"] == given, per
        if stream:
            assert out["text"] == TEXT[:TEXT.index(STOP)]
            assert len(out["logprobs"]) == given
        else:
            choice = out["choices"][0]
            assert choice["finish_reason"] == "stop" and choice["text"] == TEXT[:TEXT.index(STOP)]
            assert len(choice["logprobs"]["tokens"]) == given
