"""SGLang's real CPU engine behind tandem, live: one `tandem worker --engine sglang --device cpu`
(float32, SmolLM2-135M-Instruct) and a frontend, started once for the whole module (SGLang takes
tens of seconds to start on a CPU). Greedy answers equal transformers' token for token, with the
same logprobs, and streamed and not agree with each other and across runs; logprobs; n > 1; stop
strings; seeds; a stream cancelled or a client gone mid-request, with the engine healthy
afterwards; and after every test the worker idle, in tandem's accounting and in SGLang's own (its
TokenizerManager holds no request; its scheduler checks its own pools each time it goes idle).
tests/sglang/test_sglang_live_cluster.py has the rest: output modes, PD, KV events, migration and
drain.

Needs SGLang's CPU kernel library, which no package index carries (README, "SGLang on a CPU"):
without it the module skips, saying what is missing and how to get it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.cluster import Cluster
from tests.sglang.live import (
    START_TIMEOUT_S, WORKER_ARGS, body, missing, pick_stop, post, stream, text_of, usage_of,
)
from tests.sse import Stream
from tests.transformers_ref import Transformers, token_bytes

if missing():
    pytest.skip(missing(), allow_module_level=True)

pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 120)


@pytest.fixture(scope="module")
def cluster(smollm2: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(smollm2, str(tmp_path_factory.mktemp("sglang-live")))
    c.add_worker("sglang", WORKER_ARGS)
    t0 = time.monotonic()
    try:
        c.start_frontend(["--worker-start-timeout", f"{START_TIMEOUT_S:g}"], wait=False)
        c.wait_ready(timeout=START_TIMEOUT_S)
    except BaseException:
        print(c.workers[0].log())
        c.stop()
        raise
    print(f"SGLang's CPU worker ready in {time.monotonic() - t0:.1f} s")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def model(cluster: Cluster) -> str:
    return str(cluster.get_json("/v1/models")["data"][0]["id"])


@pytest.fixture(autouse=True)
def idle_after(cluster: Cluster) -> Iterator[None]:
    yield
    cluster.assert_idle()  # SGLang's own requests count as waiting (tandem.engines.sglang, load)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_greedy_streamed_equals_non_streamed(cluster: Cluster, model: str, endpoint: str) -> None:
    status, answer = post(cluster.url, f"/v1/{endpoint}", body(model, endpoint, ignore_eos=True))
    assert status == 200, answer
    text = text_of(answer)
    assert text and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 24 and answer["usage"]["prompt_tokens"] > 0
    streamed = stream(cluster.url, endpoint, body(model, endpoint, ignore_eos=True))
    assert streamed.done and streamed.error is None
    assert (streamed.text, streamed.finish_reason) == (text, "length")
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage_of(streamed)[k] for k in counts] == [answer["usage"][k] for k in counts]
    again = post(cluster.url, f"/v1/{endpoint}", body(model, endpoint, ignore_eos=True))[1]
    assert text_of(again) == text  # float32 greedy: the same every time


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_stop_strings(cluster: Cluster, model: str, endpoint: str) -> None:
    """The frontend stops at a stop string and ends SGLang's request early: the text before it,
    finish "stop", streamed and not."""
    full = text_of(post(cluster.url, f"/v1/{endpoint}", body(model, endpoint,
                                                               ignore_eos=True))[1])
    at, stop = pick_stop(full)
    status, answer = post(cluster.url, f"/v1/{endpoint}",
                          body(model, endpoint, ignore_eos=True, stop=[stop]))
    assert status == 200, answer
    assert (text_of(answer), answer["choices"][0]["finish_reason"]) == (full[:at], "stop")
    streamed = stream(cluster.url, endpoint, body(model, endpoint, ignore_eos=True, stop=[stop]))
    assert (streamed.text, streamed.finish_reason) == (full[:at], "stop")


def test_seeded_sampling_is_refused_naming_seed(cluster: Cluster, model: str) -> None:
    """SGLang honours a seed only with --enable-deterministic-inference, which SGLang 0.5.23 does
    not allow on a CPU (its attention backends for it are GPU ones): a seed is a 400 naming it,
    never a seed silently ignored. Sampling without one works."""
    status, answer = post(cluster.url, "/v1/completions",
                          body(model, "completions", temperature=1.0, seed=7))
    assert status == 400 and answer["error"]["param"] == "seed", answer
    status, answer = post(cluster.url, "/v1/completions",
                          body(model, "completions", temperature=1.0, top_p=0.9,
                               ignore_eos=True))
    assert status == 200 and answer["usage"]["completion_tokens"] == 24, answer


def test_a_cancelled_stream_leaves_the_engine_idle_and_healthy(cluster: Cluster,
                                                               model: str) -> None:
    before = text_of(post(cluster.url, "/v1/completions", body(model, "completions"))[1])
    s = Stream(cluster.url, "/v1/completions",
               body(model, "completions", max_tokens=1500, ignore_eos=True, stream=True))
    for _ in range(3):
        assert s.next_event() is not None  # running in SGLang now
    s.close()  # the client goes away mid-stream
    cluster.assert_idle(timeout=20)
    after = text_of(post(cluster.url, "/v1/completions", body(model, "completions"))[1])
    assert after == before


def test_a_client_gone_before_a_non_streamed_answer_frees_it(cluster: Cluster,
                                                            model: str) -> None:
    with pytest.raises(TimeoutError):
        post(cluster.url, "/v1/chat/completions",
             body(model, "chat/completions", max_tokens=1500, ignore_eos=True), timeout=1.0)
    cluster.assert_idle(timeout=20)
    status, answer = post(cluster.url, "/v1/chat/completions", body(model, "chat/completions"))
    assert status == 200 and text_of(answer), answer


CHATS = ["What is the capital of France?", "Give me three tips for a good night's sleep.",
         "Write a haiku about autumn.", "Explain photosynthesis in one sentence."]
MAX_TOKENS = 48
LOGPROB_TOL = 2e-3  # as tests/real's: float32 on both sides


@pytest.fixture(scope="module")
def hf(smollm2: str) -> Transformers:
    return Transformers(smollm2)


def test_greedy_chat_answers_are_transformers_token_for_token(
        cluster: Cluster, model: str, hf: Transformers, smollm2: str) -> None:
    """Each token's raw bytes (chat logprobs) equal those of transformers' greedy ids, end-of-turn
    included, and each logprob is transformers' log_softmax."""
    vocab = token_bytes(smollm2)
    for text in CHATS:
        messages = [{"role": "user", "content": text}]
        want = hf.greedy(hf.chat_ids(messages), MAX_TOKENS)
        status, answer = post(cluster.url, "/v1/chat/completions", {
            "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": True, "top_logprobs": 0})
        assert status == 200, answer
        content = answer["choices"][0]["logprobs"]["content"]
        assert [bytes(t["bytes"]) for t in content] == [vocab[i] for i in want.ids], text
        assert answer["choices"][0]["finish_reason"] == (
            "stop" if len(want.ids) < MAX_TOKENS else "length")
        worst = max(abs(t["logprob"] - lp) for t, lp in zip(content, want.logprobs))
        assert worst <= LOGPROB_TOL, (text, worst)


def test_logprobs_streamed_equal_non_streamed_with_top_tokens(cluster: Cluster,
                                                              model: str) -> None:
    payload = body(model, "chat/completions", ignore_eos=True, logprobs=True, top_logprobs=3)
    status, answer = post(cluster.url, "/v1/chat/completions", payload)
    assert status == 200, answer
    whole = answer["choices"][0]["logprobs"]["content"]
    assert len(whole) == answer["usage"]["completion_tokens"] == 24
    for t in whole:  # greedy: the sampled token is the likeliest, and the top list is sorted
        tops = [x["logprob"] for x in t["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert t["top_logprobs"][0]["token"] == t["token"] and tops[0] == t["logprob"]
    streamed = stream(cluster.url, "chat/completions", payload)
    parts = [lp for e in streamed.events for c in e.get("choices", ())
             for lp in ((c.get("logprobs") or {}).get("content") or ())]
    assert [(p["token"], p["logprob"]) for p in parts] == [(t["token"], t["logprob"])
                                                           for t in whole]


def test_n_choices(cluster: Cluster, model: str) -> None:
    """n > 1: the frontend fans choices out as SGLang requests. Greedy choices are the same
    answer; sampled ones each run to max_tokens and usage counts them all."""
    status, answer = post(cluster.url, "/v1/completions",
                          body(model, "completions", n=2, ignore_eos=True))
    assert status == 200, answer
    texts = [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
    assert len(texts) == 2 and texts[0] == texts[1] != ""
    status, answer = post(cluster.url, "/v1/chat/completions",
                          body(model, "chat/completions", n=3, temperature=1.0, ignore_eos=True))
    assert status == 200, answer
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 3 * 24
