"""The prefix cache as a user meets it: a cluster of mock workers serving prompts that share a
long prefix reports `usage.prompt_tokens_details.cached_tokens` (OpenAI's field) in streamed and
plain responses, the worker's /metrics counts the queries and hits (vLLM's names), the frontend's
/workers shows them, and `--no-prefix-cache` turns it all off. Aggregated and 1P1D."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.cluster import Cluster, free_port
from tests.metrics_text import value

SYSTEM = "You are a careful assistant. " * 12  # a long shared system prompt


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read().decode()
    if not body.get("stream"):
        return json.loads(raw)["usage"]
    events = [json.loads(line[6:]) for line in raw.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return events[-1]["usage"]


def chat(model: str, question: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": 4, "stream": stream, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def metric(url: str, name: str) -> float | None:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return value(r.read().decode(), name)


@pytest.mark.parametrize("shape", ["agg", "1p1d"])
def test_cached_tokens_reported_and_counted(make_cluster: Any, tiny_model: str,
                                            tmp_path: Any, shape: str) -> None:
    health = free_port()
    c = Cluster(tiny_model, str(tmp_path))
    try:
        if shape == "agg":
            c.add_worker("mock", ["--health-port", str(health)])
        else:
            boot = free_port()
            c.add_worker("mock", ["--role", "prefill", "--bootstrap-port", str(boot),
                                  "--health-port", str(health)])
            c.add_worker("mock", ["--role", "decode"])
        c.start_frontend()
        model = c.get_json("/v1/models")["data"][0]["id"]
        first = post(c.url, chat(model, "What is one plus one?", False))
        second = post(c.url, chat(model, "And two plus two?", True))
        third = post(c.url, chat(model, "And three?", False))
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        for usage in (second, third):
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert 0 < cached < usage["prompt_tokens"] and cached % 16 == 0
        hits = metric(f"http://127.0.0.1:{health}", "tandem_prefix_cache_hits_total")
        queries = metric(f"http://127.0.0.1:{health}", "tandem_prefix_cache_queries_total")
        assert hits == second["prompt_tokens_details"]["cached_tokens"] + \
            third["prompt_tokens_details"]["cached_tokens"]
        assert queries == first["prompt_tokens"] + second["prompt_tokens"] + third["prompt_tokens"]
        c.assert_idle()
    finally:
        c.stop()


def test_no_prefix_cache_reports_zero(make_cluster: Any) -> None:
    c = make_cluster("mock", worker_args=["--no-prefix-cache"])
    model = c.get_json("/v1/models")["data"][0]["id"]
    for q in ("One?", "Two?"):
        usage = post(c.url, chat(model, q, True))
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    rows = c.worker_states()
    assert rows[0]["prefix_cache_hits"] == 0 and rows[0]["pages_cached"] == 0
    c.assert_idle()
