"""Structured output and tool calls through HTTP and the official `openai` SDK, on an aggregated
and a 1P1D reference cluster (the prefill's first token is constrained too): `parse()` with
pydantic models gives a parsed object, a tool call comes back as `tool_calls` (streamed as
`delta.tool_calls`), and what cannot be honoured is a 400 naming the field, the mock engine's
refusal included. Every cluster is idle after each test (no page or request left)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from tests.integration.test_openai_fields import post

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

# An untrained model writes free text forever: strings and numbers are bounded in the schemas.


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    pets: list[Literal["cat", "dog", "fish"]] = Field(max_length=3)


class GetWeather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["c", "f"]


class Book(BaseModel):
    title: str = Field(max_length=8)
    year: int = Field(ge=1900, le=2030)


MESSAGES = [{"role": "user", "content": "Tell me about someone."}]
SAMPLED: dict[str, Any] = {"temperature": 1.0, "max_tokens": 300}


@pytest.fixture(scope="module", params=["agg", "1p1d"])
def cluster(request: pytest.FixtureRequest, tiny_model: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.cluster import Cluster, reference_workers

    if request.param == "1p1d":
        pytest.importorskip("nixl")
    c = reference_workers(Cluster(tiny_model, str(tmp_path_factory.mktemp(request.param))),
                          request.param)
    try:
        c.start_frontend()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster: Any) -> Iterator[Any]:
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=120,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: Any) -> str:
    return str(client.models.list().data[0].id)


@pytest.fixture(autouse=True)
def idle_after(cluster: Any) -> Iterator[None]:
    yield
    cluster.assert_idle()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_parse_with_a_pydantic_model(client: Any, model: str, seed: int) -> None:
    r = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Person,
                                      seed=seed, **SAMPLED)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, Person) and Person.model_validate_json(msg.content)


def test_streamed_json_schema_validates(client: Any, model: str) -> None:
    with client.chat.completions.stream(model=model, messages=MESSAGES, response_format=Book,
                                        seed=5, **SAMPLED) as stream:
        chunks = [e for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(chunks) > 1  # it did stream
    assert isinstance(final.choices[0].message.parsed, Book)


def test_n_choices_each_follow_the_schema(client: Any, model: str) -> None:
    r = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Book, n=3,
                                      seed=9, **SAMPLED)
    assert len(r.choices) == 3
    assert all(isinstance(c.message.parsed, Book) for c in r.choices)


def test_json_object_is_a_json_object(client: Any, model: str, cluster: Any) -> None:
    # A free object's strings never close on an untrained model: bias it toward closing.
    status, out = post(cluster.url, {"prompt": '"}', "add_special_tokens": False}, "/tokenize")
    assert status == 200, out
    toks = out["tokens"]
    r = client.chat.completions.create(model=model, messages=MESSAGES,
                                       response_format={"type": "json_object"},
                                       logit_bias={str(t): 6 for t in toks}, seed=1, **SAMPLED)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_extension(client: Any, model: str) -> None:
    r = client.completions.create(model=model, prompt="Answer:", max_tokens=20, seed=2,
                                  temperature=1.0, extra_body={"regex": "(yes|no) [0-9]{3}"})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch("(yes|no) [0-9]{3}", r.choices[0].text)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "GetWeather"}}])
def test_tool_call_is_parsed_by_the_sdk(client: Any, model: str, choice: Any) -> None:
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Book)]
    r = client.chat.completions.parse(model=model, messages=MESSAGES, tools=tools,
                                      tool_choice=choice, seed=4, **SAMPLED)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert isinstance(call.function.parsed_arguments, (GetWeather, Book))
    if isinstance(choice, dict):
        assert call.function.name == "GetWeather"


def test_streamed_tool_call(client: Any, model: str) -> None:
    tools = [openai.pydantic_function_tool(GetWeather)]
    calls: dict[int, dict[str, str]] = {}
    parts = 0
    finish = None
    for ch in client.chat.completions.create(model=model, messages=MESSAGES, tools=tools,
                                             tool_choice="required", stream=True, seed=6,
                                             **SAMPLED):
        for c in ch.choices:
            assert not c.delta.content
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
                parts += bool(tc.function.arguments)
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "GetWeather" and parts > 1  # the arguments came as made
    GetWeather.model_validate_json(calls[0]["arguments"])


def test_sdk_stream_helper_assembles_the_tool_call(client: Any, model: str) -> None:
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Book)]
    with client.chat.completions.stream(model=model, messages=MESSAGES, tools=tools,
                                        tool_choice="required", seed=8, **SAMPLED) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert isinstance(call.function.parsed_arguments, (GetWeather, Book))


def test_a_streamed_tool_call_cut_short_keeps_what_it_made(client: Any, model: str) -> None:
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=40, stream=True, seed=1, temperature=1.0,
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required"))
    deltas = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert deltas[0].function.name == "GetWeather" and deltas[0].id.startswith("call_")
    args = "".join(d.function.arguments or "" for d in deltas)
    assert args.startswith("{") and '{"name": "GetWeather", "arguments": ' not in args


def test_a_tool_call_cut_short_is_content(client: Any, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3,
                                       tools=[openai.pydantic_function_tool(GetWeather)],
                                       tool_choice="required", seed=1, temperature=1.0)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None
    assert c.message.content and '{"name": "GetWeather"'.startswith(c.message.content)


WEATHER = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "x" * 70000}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": "a", "response_format": {"type": "json_object"}}, "regex"),
    ({"tools": [WEATHER]}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
      "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "w", "parameters": {
        "type": "bogus"}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_what_cannot_be_honoured_is_400_naming_it(cluster: Any, model: str, fields: Any,
                                                  param: str, stream: bool) -> None:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "stream": stream, **fields}
    status, err = post(cluster.url, body, "/v1/chat/completions")
    assert status == 400, err
    assert err["error"]["param"] == param, err


def test_the_mock_engine_refuses_by_name(make_cluster: Any) -> None:
    c = make_cluster("mock")
    for fields, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"regex": "a+"}, "regex"),
                          ({"tools": [WEATHER], "tool_choice": "required"}, "tools")):
        status, err = post(c.url, {"messages": MESSAGES, "max_tokens": 4, **fields},
                           "/v1/chat/completions")
        assert status == 400 and err["error"]["param"] == param, err
        assert "mock engine" in err["error"]["message"], err
    c.assert_idle()
