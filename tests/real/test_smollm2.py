"""SmolLM2-135M-Instruct served by tandem's reference engine, against transformers on the same
checkpoint: greedy answers token for token (chat with the template applied, and plain completions;
aggregated and 1P1D; on a prefix-cache hit; after the serving worker is killed mid-stream and the
stream moves), logprobs within LOGPROB_TOL of transformers' log_softmax, streamed text equal to the
whole answer's, `json_schema` output that validates, and /tokenize and /detokenize on the real
vocabulary.

Token exactness is read from the chat API's logprobs: each token's raw `bytes`, which name one
vocabulary entry each (byte-level BPE has no two entries with the same bytes), compared with the
bytes of the ids transformers generated.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster import Cluster, reference_workers
from tests.transformers_ref import Expected, Transformers, token_bytes
from tests.waits import wait_for
from tests.sse import Stream

MAX_TOKENS = 24
LOGPROB_TOL = 2e-3  # |tandem - transformers| per token; float32 with other kernels and batching
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "List three primary colors.",
    "Translate 'good morning' into French and Spanish.",
]
TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
]


def _cluster(model: str, log_dir: Path, shape: str) -> Iterator[Cluster]:
    c = reference_workers(Cluster(model, str(log_dir)), shape)
    try:
        c.start_frontend()
        c.wait_ready(120)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def agg(smollm2: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _cluster(smollm2, tmp_path_factory.mktemp("agg"), "agg")


@pytest.fixture(scope="module")
def pd(smollm2: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _cluster(smollm2, tmp_path_factory.mktemp("pd"), "1p1d")


def _model(c: Cluster) -> str:
    return str(c.get_json("/v1/models")["data"][0]["id"])


def _post(c: Cluster, path: str, body: dict, timeout: float = 120.0) -> dict:
    r = httpx.post(c.url + path, json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.fixture(scope="module")
def vocab_bytes(smollm2: str) -> list[bytes]:
    return token_bytes(smollm2)


def _answer(c: Cluster, messages: list[dict] | None, prompt: list[int] | None,
            max_tokens: int = MAX_TOKENS) -> dict:
    """A greedy answer with logprobs: a chat (`messages`), or a completion of token ids."""
    body: dict = {"model": _model(c), "max_tokens": max_tokens, "temperature": 0}
    if messages is not None:
        return _post(c, "/v1/chat/completions",
                     {**body, "messages": messages, "logprobs": True, "top_logprobs": 0})
    return _post(c, "/v1/completions", {**body, "prompt": prompt, "logprobs": 0})


def _check_chat(resp: dict, want: Expected, vocab: list[bytes]) -> None:
    choice = resp["choices"][0]
    content = choice["logprobs"]["content"]
    got = [bytes(t["bytes"]) for t in content]
    expected = [vocab[i] for i in want.ids]  # (an answer that stops lists its end-of-turn id)
    assert got == expected, (b"".join(got), b"".join(expected))
    stopped = len(want.ids) < MAX_TOKENS
    assert choice["finish_reason"] == ("stop" if stopped else "length")
    lps = [t["logprob"] for t in content]
    worst = max(abs(a - b) for a, b in zip(lps, want.logprobs))
    assert worst <= LOGPROB_TOL, (worst, lps, want.logprobs)


def _check_text(resp: dict, want: Expected, hf: Transformers) -> None:
    """Completions' logprobs name tokens by text, not bytes: the text, the token count and each
    token's logprob pin the ids down (another split of the same text has other logprobs)."""
    choice = resp["choices"][0]
    lps = choice["logprobs"]["token_logprobs"]
    assert choice["finish_reason"] == "length" and len(want.ids) == MAX_TOKENS  # (no EOS here)
    assert len(lps) == resp["usage"]["completion_tokens"] == MAX_TOKENS
    assert choice["text"] == hf.tok.decode(want.ids, skip_special_tokens=True)
    worst = max(abs(a - b) for a, b in zip(lps, want.logprobs))
    assert worst <= LOGPROB_TOL, worst


def _expected_chat(hf: Transformers, text: str, max_tokens: int = MAX_TOKENS) -> Expected:
    return hf.greedy(hf.chat_ids([{"role": "user", "content": text}]), max_tokens)


def _run_all(c: Cluster, hf: Transformers, vocab: list[bytes]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    msgs = [[{"role": "user", "content": t}] for t in CHATS]
    texts = [hf.text_ids(t) for t in TEXTS]
    with ThreadPoolExecutor(len(msgs) + len(texts)) as ex:  # one batch in the engine
        chats = [ex.submit(_answer, c, m, None) for m in msgs]
        plains = [ex.submit(_answer, c, None, ids) for ids in texts]
        chat_resps = [f.result(300) for f in chats]
        text_resps = [f.result(300) for f in plains]
    for t, resp in zip(CHATS, chat_resps):
        _check_chat(resp, _expected_chat(hf, t), vocab)
    for ids, resp in zip(texts, text_resps):
        _check_text(resp, hf.greedy(ids, MAX_TOKENS), hf)


@pytest.mark.parametrize("shape", ["agg", "pd"])
def test_greedy_answers_are_transformers_token_for_token(
        shape: str, request: pytest.FixtureRequest, hf: Transformers,
        vocab_bytes: list[bytes]) -> None:
    c: Cluster = request.getfixturevalue(shape)
    _run_all(c, hf, vocab_bytes)
    c.assert_idle()


def test_the_answer_is_english(agg: Cluster) -> None:
    resp = _post(agg, "/v1/chat/completions", {
        "model": _model(agg), "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert resp["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert resp["choices"][0]["finish_reason"] == "stop"


def test_template_and_tokenizer_agree_with_transformers(agg: Cluster, hf: Transformers) -> None:
    for text in CHATS:
        msgs = [{"role": "user", "content": text}]
        got = _post(agg, "/tokenize", {"model": _model(agg), "messages": msgs})["tokens"]
        assert got == hf.chat_ids(msgs)
    for text in TEXTS:
        got = _post(agg, "/tokenize", {"model": _model(agg), "prompt": text})["tokens"]
        assert got == hf.text_ids(text)


def test_prefix_cache_hit_answers_the_same(agg: Cluster, hf: Transformers,
                                          vocab_bytes: list[bytes]) -> None:
    system = ("You are a helpful assistant who answers briefly and accurately. " * 3).strip()
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": "Name a planet of the solar system."}]
    want = hf.greedy(hf.chat_ids(msgs), MAX_TOKENS)
    first = _answer(agg, msgs, None)
    second = _answer(agg, msgs, None)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    for resp in (first, second):
        _check_chat(resp, want, vocab_bytes)


def test_streamed_deltas_join_to_the_whole_answer(agg: Cluster) -> None:
    """Multi-byte answers (accents, CJK, emoji), streamed every 3 tokens, with and without
    special tokens, and with a stop string: the deltas join to the non-streamed text."""
    model = _model(agg)
    prompts = ["How do you say 'thank you' in Japanese?", "Give me a smiley face emoji.",
               "Write the word 'café' three times.", "Write 'hello' in Chinese characters."]
    for content in prompts:
        for skip in (True, False):
            body = {"model": model, "temperature": 0, "max_tokens": 40, "skip_special_tokens": skip,
                    "messages": [{"role": "user", "content": content}]}
            whole = _post(agg, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
            s = Stream(agg.url, "/v1/chat/completions",
                       {**body, "stream": True, "stream_interval": 3}, timeout=120).read_all()
            assert s.done and s.error is None
            assert s.text == whole
            assert any(ord(ch) > 127 for ch in whole), whole  # (the case this test is about)
            if not skip:
                continue
            stop = whole[len(whole) // 3: len(whole) // 3 + 4]  # (wherever tokens split it)
            cut = whole[: whole.index(stop)]
            s = Stream(agg.url, "/v1/chat/completions",
                       {**body, "stream": True, "stream_interval": 2, "stop": [stop]},
                       timeout=120).read_all()
            assert s.text == cut and s.finish_reason == "stop"


def test_json_schema_output_validates(agg: Cluster) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"},
        "population_millions": {"type": "number"}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
    resp = _post(agg, "/v1/chat/completions", {
        "model": _model(agg), "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "user", "content": "Give the city, country and population in "
                      "millions of Paris as JSON."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "city", "schema": schema}}})
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_tokenize_detokenize_round_trip(agg: Cluster) -> None:
    model = _model(agg)
    for text in ["Déjà vu, naïve café.", "日本語のテキストと中文", "emoji 🌊🏖️👍🏽 done",
                 "<|im_start|>user\nhi<|im_end|>"]:
        tokens = _post(agg, "/tokenize", {"model": model, "prompt": text})["tokens"]
        back = _post(agg, "/detokenize", {"model": model, "tokens": tokens})["prompt"]
        assert back == text


def test_stream_moves_off_a_killed_worker_and_stays_exact(
        smollm2: str, tmp_path: Path, hf: Transformers) -> None:
    """Two aggregated workers; the one serving a long greedy answer is SIGKILLed once its first
    tokens have reached the client. The stream moves to the other worker, which prefills prompt
    and tokens so far and goes on: the whole answer is transformers', token for token."""
    max_tokens = 64
    msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    want = hf.greedy(hf.chat_ids(msgs), max_tokens)
    assert len(want.ids) == max_tokens  # (a long answer: the kill lands mid-stream)
    c = Cluster(smollm2, str(tmp_path))
    for _ in range(2):
        c.add_worker("reference", ["--role", "agg"])
    try:
        c.start_frontend()
        c.wait_ready(120)  # (ready with one worker up: the stream needs the other to move to)
        wait_for(lambda: sum(w["state"] == "up" for w in c.worker_states()) == 2,
                 "both workers up", timeout=120)
        s = Stream(c.url, "/v1/chat/completions", {
            "model": _model(c), "temperature": 0, "max_tokens": max_tokens, "messages": msgs,
            "stream": True, "stream_options": {"include_usage": True}}, timeout=120)
        seen = 0
        killed = None
        while (ev := s.next_event()) is not None:
            seen += sum(1 for ch in ev.get("choices", []) if (ch.get("delta") or {}).get("content"))
            if seen == 3 and killed is None:  # (the stream is under way: kill who serves it)
                busy = [w for w in c.worker_states() if w["in_flight"] > 0]
                assert len(busy) == 1, busy
                killed = next(w for w in c.workers if w.address == busy[0]["address"])
                killed.popen.send_signal(signal.SIGKILL)
        s.close()
        r = s.result
        assert killed is not None and r.done and r.error is None, r.events[-3:]
        assert r.text == hf.tok.decode(want.ids, skip_special_tokens=True)
        usage = [e["usage"] for e in r.events if e.get("usage")][-1]
        assert usage["completion_tokens"] == max_tokens
        metrics = httpx.get(c.url + "/metrics", timeout=10).text
        moved = [ln for ln in metrics.splitlines()
                 if ln.startswith("tandem_request_migrations_total ")]
        assert moved and float(moved[0].split()[1]) >= 1
    finally:
        c.stop()
