"""Bad input gets the right status and an OpenAI error body, and the workers keep serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    from tests.cluster import Cluster

    c = Cluster(tiny_model, str(tmp_path_factory.mktemp("bad")))
    c.add_worker("reference")
    c.start_frontend()
    yield c
    c.stop()


def post(url: str, body: bytes | dict, path: str = "/v1/chat/completions") -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def model(cluster) -> str:
    return cluster.get_json("/v1/models")["data"][0]["id"]


def assert_openai_error(body: dict, status: int) -> None:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "param" in err and "code" in err


def chat(cluster, **kw) -> dict:
    body = {"model": model(cluster), "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}
    body.update(kw)
    return body


@pytest.mark.parametrize("case,status", [
    ("malformed_json", 400),
    ("unknown_model", 404),
    ("wrong_type_max_tokens", 400),
    ("wrong_type_messages", 400),
    ("max_tokens_zero", 400),
    ("max_tokens_negative", 400),
    ("empty_messages", 400),
    ("unknown_role", 400),
    ("prompt_too_long", 400),
    ("temperature_wrong_type", 400),
])
def test_bad_request(cluster, case, status):
    m = model(cluster)
    bodies: dict[str, bytes | dict] = {
        "malformed_json": b'{"model": "x", "messages": [',
        "unknown_model": chat(cluster, model="no-such-model"),
        "wrong_type_max_tokens": chat(cluster, max_tokens="ten"),
        "wrong_type_messages": chat(cluster, messages="hello"),
        "max_tokens_zero": chat(cluster, max_tokens=0),
        "max_tokens_negative": chat(cluster, max_tokens=-3),
        "empty_messages": chat(cluster, messages=[]),
        "unknown_role": chat(cluster, messages=[{"role": "wizard", "content": "hi"}]),
        "prompt_too_long": chat(cluster, messages=[{"role": "user", "content": "word " * 5000}]),
        "temperature_wrong_type": chat(cluster, temperature="hot"),
    }
    code, _, body = post(cluster.url, bodies[case])
    assert code == status, body
    assert_openai_error(body, status)
    # The workers keep serving.
    code, _, ok = post(cluster.url, chat(cluster))
    assert code == 200, ok
    assert ok["choices"][0]["message"]["role"] == "assistant"
    assert m
    cluster.assert_idle()


def test_completions_bad_prompt_type(cluster):
    code, _, body = post(cluster.url, {"model": model(cluster), "prompt": {"a": 1}},
                         "/v1/completions")
    assert code == 400
    assert_openai_error(body, 400)


def test_unreachable_worker_gives_503_not_a_hang(tiny_model, tmp_path):
    from tests.cluster import Cluster, free_port

    c = Cluster(tiny_model, str(tmp_path))
    # A worker address nothing listens on.
    from tests.cluster import Proc  # noqa: F401

    class Ghost:
        address = f"tcp://127.0.0.1:{free_port()}"

        def stop(self) -> None:
            pass

    c.workers.append(Ghost())  # type: ignore[arg-type]
    c.start_frontend(wait=False)
    try:
        import time

        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(c.url + "/v1/models", timeout=2)
                break
            except urllib.error.HTTPError:
                break
            except (urllib.error.URLError, OSError):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        t0 = time.monotonic()
        code, headers, body = post(c.url, {"model": "tiny", "messages": [
            {"role": "user", "content": "hi"}]})
        assert time.monotonic() - t0 < 10
        assert code == 503, body
        assert_openai_error(body, 503)
        assert "Retry-After" in headers or "retry-after" in headers
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(c.url + "/health", timeout=5)
        assert e.value.code == 503
    finally:
        c.stop()
