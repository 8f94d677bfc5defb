"""Every OpenAI request field, through the official SDK against a real reference cluster: applied
(greedy output changes as the field demands; logprobs are the engine's and plausible) or refused
with a 400 naming it. Plus /tokenize, /detokenize, models.retrieve, /metrics through
prometheus_client's parser, and the access and stats log lines (JSON format)."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.metrics_text import families

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    from tests.cluster import Cluster

    c = Cluster(tiny_model, str(tmp_path_factory.mktemp("fields")))
    c.add_worker("reference")
    c.start_frontend(["--log-level", "INFO", "--log-format", "json",
                      "--log-stats-interval", "0.5"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return str(client.models.list().data[0].id)


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    cluster.assert_idle()


def post(url: str, body: bytes | dict[str, Any], path: str) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def greedy(client, model: str, prompt: str = "The sea", n: int = 12, **kw: Any) -> Any:
    kw["extra_body"] = {"ignore_eos": True, **kw.get("extra_body", {})}
    return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                     **kw)


def test_logit_bias_makes_one_token_the_output(client, model, cluster):
    base = greedy(client, model).choices[0].text
    token = 100
    r = greedy(client, model, logit_bias={str(token): 100})
    _, want = post(cluster.url, {"tokens": [token] * 12}, "/detokenize")
    assert r.choices[0].text == want["prompt"] != base


def test_strong_penalties_stop_repetition(client, model):
    base = greedy(client, model, n=48, logprobs=0).choices[0].logprobs.tokens
    assert len(set(base)) < len(base), "the greedy baseline should repeat itself"
    pen = greedy(client, model, n=48, logprobs=0, frequency_penalty=2.0, presence_penalty=2.0,
                 extra_body={"ignore_eos": True, "repetition_penalty": 5.0}).choices[0]
    assert len(set(pen.logprobs.tokens)) > len(set(base))


def test_min_p_one_is_greedy(client, model):
    want = greedy(client, model).choices[0].text
    r = client.completions.create(model=model, prompt="The sea", max_tokens=12, temperature=1.0,
                                  seed=7, extra_body={"ignore_eos": True, "min_p": 1.0})
    assert r.choices[0].text == want


def test_chat_logprobs_are_plausible_and_streamed_equal(client, model):
    kw: dict[str, Any] = dict(model=model, messages=[{"role": "user", "content": "Hi"}],
                              max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the likeliest
        assert math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-5)
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    streamed = [t for ch in client.chat.completions.create(**kw, stream=True)
                for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_completions_logprobs_zero_gives_the_chosen_tokens(client, model):
    r = greedy(client, model, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == r.usage.completion_tokens == 12
    assert all(x <= 0 for x in lp.token_logprobs) and lp.top_logprobs == [{}] * 12
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    streamed = [x for ch in greedy(client, model, logprobs=0, stream=True) for c in ch.choices
                if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_echo_prepends_the_prompt(client, model):
    r = greedy(client, model, echo=True)
    assert r.choices[0].text == "The sea" + greedy(client, model).choices[0].text
    s = "".join(c.choices[0].text for c in greedy(client, model, echo=True, stream=True)
                if c.choices)
    assert s == r.choices[0].text


def test_include_stop_str_in_output(client, model):
    text = greedy(client, model, n=24).choices[0].text
    stop = text[8:11]
    cut = text[:text.find(stop)]
    assert greedy(client, model, n=24, stop=[stop]).choices[0].text == cut
    r = greedy(client, model, n=24, stop=[stop],
               extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert r.choices[0].text == cut + stop


def test_continuous_usage_stats_in_every_chunk(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert with_text and all(c.usage is not None for c in with_text)
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and chunks[-1].usage.completion_tokens == counts[-1]


def test_explicit_nulls_mean_not_given(cluster, model):
    status, body = post(cluster.url, {
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "n": None, "stream": None, "logprobs": None, "top_logprobs": None, "seed": None,
        "stop": None, "temperature": None, "presence_penalty": None, "logit_bias": None,
        "stream_options": None, "response_format": None, "tools": None, "user": None},
        "/v1/chat/completions")
    assert status == 200, body
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),  # ("auto", the default with tools, needs a parser: none is configured)
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"max_tokens": 2**63}, "max_tokens"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"top_k": -(2**63) - 1}, "top_k"),
    ("/v1/chat/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/chat/completions", {"stop_token_ids": [2**64]}, "stop_token_ids"),
    ("/v1/chat/completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"1": 200}}, "logit_bias"),
    ("/v1/chat/completions", {"frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/chat/completions", {"min_p": -0.1}, "min_p"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
])
def test_unsupported_or_out_of_range_is_400_naming_the_field(cluster, model, path, fields,
                                                             param):
    body: dict[str, Any] = {"model": model, "max_tokens": 4, **fields}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    status, err = post(cluster.url, body, path)
    assert status == 400, err
    assert err["error"]["param"].startswith(param), err  # stop_token_ids[0] names it too


def test_a_float_that_overflows_is_400_naming_it(cluster, model):
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], '
            '"temperature": 1e400}' % model).encode()
    status, err = post(cluster.url, body, "/v1/chat/completions")
    assert status == 400 and err["error"]["param"] == "temperature"


def test_seed_near_the_top_with_n_does_not_overflow(client, model):
    r = client.completions.create(model=model, prompt="Hi", max_tokens=3, n=3,
                                  seed=2**63 - 1, temperature=1.0)
    assert len(r.choices) == 3


@pytest.mark.parametrize("body", [
    b'{"messages": [{"role": "user", "content": "a\xffb"}]}',
    b'{"messages": [], "chat_template_kwargs": {"x": ' + b"[" * 100_000 + b"]" * 100_000
    + b"}}",
    b"[1, 2]",
    b'"text"',
])
def test_bad_json_bodies_are_400_with_an_openai_error(cluster, body):
    status, err = post(cluster.url, body, "/v1/chat/completions")
    assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}


def test_tokenize_round_trip(cluster, model):
    status, t = post(cluster.url, {"model": model, "prompt": "Hello world"}, "/tokenize")
    assert status == 200 and t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0
    status, d = post(cluster.url, {"model": model, "tokens": t["tokens"]}, "/detokenize")
    assert status == 200 and d["prompt"].endswith("Hello world")
    status, chat = post(cluster.url, {"messages": [{"role": "user", "content": "Hi"}]},
                        "/tokenize")
    assert status == 200 and chat["count"] > 1
    status, err = post(cluster.url, {"tokens": [10**9]}, "/detokenize")
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = post(cluster.url, {"model": "nope", "prompt": "x"}, "/tokenize")
    assert status == 404 and err["error"]["code"] == "model_not_found"


def test_models_retrieve(client, model):
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_metrics_parse_with_prometheus_client(cluster, client, model):
    greedy(client, model, n=4)
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
        types = families(r.read().decode())
    for name, kind in {
        "tandem_num_requests_running": "gauge", "tandem_num_requests_waiting": "gauge",
        "tandem_time_to_first_token_seconds": "histogram",
        "tandem_inter_token_latency_seconds": "histogram",
        "tandem_e2e_request_latency_seconds": "histogram",
        "tandem_request_prefill_time_seconds": "histogram",
        "tandem_request_decode_time_seconds": "histogram",
        "tandem_prompt_tokens": "counter", "tandem_generation_tokens": "counter",
        "tandem_kv_cache_usage_perc": "gauge", "tandem_kv_transfer_failures": "counter",
        "tandem_router_rejected_requests": "counter", "tandem_worker_pages_free": "gauge",
        "process_cpu_seconds": "counter", "process_resident_memory_bytes": "gauge",
    }.items():
        assert types.get(name) == kind, (name, types.get(name))


def test_access_and_stats_lines(cluster, client, model):
    import time

    r = greedy(client, model, n=3)
    assert cluster.frontend is not None
    deadline = time.monotonic() + 10  # the lines are written when the request ends and every
    while True:  # 0.5 s (stats): wait for them, however slowly the frontend gets to it
        lines = [json.loads(x) for x in cluster.frontend.log(200_000).splitlines()
                 if x.startswith("{")]
        access = [x for x in lines if x["logger"] == "tandem.access"
                  and x.get("path") == "/v1/completions" and x.get("rid") == r.id]
        if (access and any(x["logger"] == "tandem.stats" for x in lines)
                or time.monotonic() > deadline):
            break
        time.sleep(0.1)
    assert access and access[0]["status"] == 200 and access[0]["completion_tokens"] == 3
    assert access[0]["prompt_tokens"] == r.usage.prompt_tokens and access[0]["ttft_s"] > 0
    assert any(x["logger"] == "tandem.stats" for x in lines)
