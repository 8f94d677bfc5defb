"""tandem.frontend.structured and the tool-call choice, without a server: what a request's
response_format, regex, tools and tool_choice become, each refusal naming its field, and a tool
call's output turned into `tool_calls` (whole, and streamed part by part, however the tokens cut
it)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from tandem.frontend import schemas, structured, validate
from tandem.frontend.choice import ToolCallState
from tandem.frontend.sse import ChunkEncoder
from tandem.runtime import errors
from tandem.runtime.wire import Delta

MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}


def chat(**fields: Any) -> schemas.ChatCompletionRequest:
    return msgspec.convert({"messages": MSGS, **fields}, schemas.ChatCompletionRequest)


def test_what_each_request_becomes() -> None:
    assert structured.constraint(chat()) is None
    assert structured.constraint(chat(response_format={"type": "text"})) is None
    assert structured.constraint(chat(tools=[TOOL], tool_choice="none")) is None
    c = structured.constraint(chat(response_format={"type": "json_object"}))
    assert c is not None and c.json_schema == '{"type": "object"}' and not c.tool_call
    c = structured.constraint(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "array"}}}))
    assert c is not None and json.loads(c.json_schema or "") == {"type": "array"}
    c = structured.constraint(chat(regex="a+"))
    assert c is not None and (c.regex, c.param) == ("a+", "regex")
    c = structured.constraint(chat(tools=[TOOL, {"type": "function", "function": {"name": "g"}}],
                                   tool_choice="required"))
    assert c is not None and c.tool_call and c.param == "tools"
    calls = json.loads(c.json_schema or "")["anyOf"]
    assert [x["properties"]["name"] for x in calls] == [{"const": "f"}, {"const": "g"}]
    assert calls[1]["properties"]["arguments"] == {"type": "object"}
    c = structured.constraint(chat(tools=[TOOL], tool_choice={"type": "function",
                                                              "function": {"name": "f"}}))
    assert c is not None and json.loads(c.json_schema or "")["properties"]["arguments"] == \
        TOOL["function"]["parameters"]  # type: ignore[index]
    sp = validate.sampling_params(chat(regex="b"), 8, 2, 64, None, validate.options(
        chat(regex="b")).constraint)
    assert (sp.regex, sp.json_schema) == ("b", None)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"regex": "a" * 70000}, "regex"),
    ({"tools": [TOOL]}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL] * 129, "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [TOOL], "tool_choice": "required", "regex": "a"}, "regex"),
    ({"tools": [TOOL], "tool_choice": "required", "logprobs": True}, "logprobs"),
])
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(errors.BadRequest) as e:
        structured.constraint(chat(**fields))
    assert e.value.param == param, e.value.message


@pytest.mark.parametrize("text, want", [
    ('{"name": "f", "arguments": {"x": 1}}', ("f", '{"x": 1}')),
    ('{"name":"a\\"b","arguments":[]}', ('a"b', "[]")),
    ('{"name": "f", "arguments": {"x": 1', None),
    ('{"name": "f"', None),
    ("not json", None),
])
def test_parse_tool_call(text: str, want: Any) -> None:
    assert structured.parse_tool_call(text) == want


class Chars:
    """A detokenizer stand-in: token ids are the characters' code points."""

    stopped, used = False, 0

    def step(self, ids: list[int], final: bool) -> str:
        return "".join(map(chr, ids))


def run(text: str, cuts: list[int], finish: str, stream: bool = True
        ) -> tuple[ToolCallState, list[dict[str, Any]]]:
    enc = ChunkEncoder("chat", "id", 0, "m") if stream else None
    st = ToolCallState(Chars(), enc)  # type: ignore[arg-type]
    out = b""
    bounds = [0, *cuts, len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = i == len(bounds) - 2
        out += st.feed(Delta("r", a, [ord(c) for c in text[a:b]], finish if last else None))
    events = [json.loads(x[6:]) for x in out.decode().split("\n\n") if x.startswith("data: ")]
    return st, events


@pytest.mark.parametrize("cuts", [[], [1], [5, 20, 30, 35], list(range(1, 40))])
def test_a_streamed_tool_call_adds_up_to_the_call(cuts: list[int]) -> None:
    text = '{"name": "f", "arguments": {"x": [1, 2]}}'
    st, events = run(text, cuts, "stop")
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["id"] == st.call_id and calls[0]["function"]["name"] == "f"
    assert "".join(tc["function"].get("arguments") or "" for tc in calls) == '{"x": [1, 2]}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert st.calls is not None and st.calls[0].function.arguments == '{"x": [1, 2]}'
    assert not any(d.get("content") for d in deltas)


def test_an_aggregated_tool_call_and_one_cut_short() -> None:
    st, events = run('{"name": "f", "arguments": {}}', [3], "stop", stream=False)
    assert events == [] and st.finish == "tool_calls" and st.calls is not None
    st, events = run('{"name": "f", "argu', [3], "length")
    assert st.calls is None and st.finish == "length"
    (last,) = events[-1]["choices"]
    assert last["delta"]["content"] == '{"name": "f", "argu' and last["finish_reason"] == "length"
