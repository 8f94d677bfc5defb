"""The official openai SDK against a real frontend and real workers (reference and mock engines)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def ref_cluster(tiny_model, tmp_path_factory):
    from tests.cluster import Cluster

    c = Cluster(tiny_model, str(tmp_path_factory.mktemp("ref")))
    c.add_worker("reference")
    c.start_frontend()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(ref_cluster):
    with openai.OpenAI(base_url=ref_cluster.url + "/v1", api_key="none", timeout=60,
                       max_retries=0) as c:
        yield c


@pytest.fixture(autouse=True)
def pages_free_after(ref_cluster):
    yield
    ref_cluster.assert_idle()


def model_name(client) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_models_lists_the_served_model(client, tiny_model):
    import os

    assert model_name(client) == os.path.basename(tiny_model)


def test_chat_non_streamed_usage_matches(client):
    r = client.chat.completions.create(
        model=model_name(client), messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=12, temperature=0,
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streamed_equals_non_streamed_and_is_deterministic(client):
    kw = dict(model=model_name(client), messages=[{"role": "user", "content": "Say something"}],
              max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    again = client.chat.completions.create(**kw).choices[0].message.content
    assert full == again
    parts, finish, usage = [], None, None
    for chunk in client.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert "".join(parts) == full
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens <= 16


def test_completions_streamed_and_not(client):
    kw = dict(model=model_name(client), prompt="Once upon a time", max_tokens=10, temperature=0)
    r = client.completions.create(**kw)
    text = r.choices[0].text
    assert r.usage.completion_tokens == 10 or r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == text


def test_usage_counts_equal_tokens_returned(client, tiny_model):
    from tokenizers import Tokenizer
    import os

    tok = Tokenizer.from_file(os.path.join(tiny_model, "tokenizer.json"))
    r = client.completions.create(model=model_name(client), prompt="The sea", max_tokens=20,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 20
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode("The sea", add_special_tokens=False).ids) or \
        r.usage.prompt_tokens == len(tok.encode("The sea").ids)


def test_seeded_sampling_reproducible(client):
    kw = dict(model=model_name(client), prompt="Hello", max_tokens=12, temperature=0.9,
              top_p=0.9, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
