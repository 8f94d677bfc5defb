"""Constrained output and tool calls, as the OpenAI API asks for them: what a request's
`response_format`, tandem's `regex` extension, `tools` and `tool_choice` become for the engine
(`constraint`: a JSON schema or a regular expression in its SamplingParams), and what a tool call's
output becomes for the client (`parse_tool_call`).

- `response_format`: `text` (nothing), `json_object` (any JSON object: the schema
  `{"type": "object"}`), `json_schema` (its `json_schema.schema`, a JSON Schema object).
- `regex` (extension): the output matches it. Not with a response_format or tools.
- `tools` with `tool_choice` `"required"` or `{"type": "function", "function": {"name": ...}}`:
  the output is constrained to `{"name": <a tool's name>, "arguments": <its parameters' schema>}`
  (any of the tools for "required", the named one otherwise), and returned as the message's
  `tool_calls` (tandem.frontend.choice `ToolCallState`). `tool_choice` `"auto"`, the default when
  tools are given, needs a model-specific parser of free text into tool calls; none is configured
  for any model here, so it is refused naming `tool_choice`. `"none"`: the tools only reach the
  chat template.

The engine compiles the grammar (an invalid schema is its 400, which it names `json_schema`;
`Constraint.param` says which request field that was). Which engine constrains: the reference
engine (xgrammar) and SGLang (its own); the mock engine refuses by name. Every refusal here is a
400 naming its field. A schema or regex is at most MAX_GRAMMAR_CHARS characters
(tandem.runtime.sampling).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.frontend import schemas
from tandem.runtime import errors, sampling

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
ANY_OBJECT = '{"type": "object"}'


@dataclass(slots=True)
class Constraint:
    """What a request's output is constrained to."""

    json_schema: str | None = None
    regex: str | None = None
    param: str = "response_format"  # the request field the engine's `json_schema` came from
    tool_call: bool = False  # the output is a tool call: returned as `tool_calls`


def _bad(message: str, param: str) -> errors.BadRequest:
    return errors.BadRequest(message, param=param)


def _dump(schema: Any, param: str) -> str:
    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON Schema object.", param)
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except (RecursionError, ValueError) as e:  # (nesting past what is encoded)
        raise _bad(f"{param} cannot be encoded: {e}.", param) from None
    why = sampling.grammar_error(param, text)
    if why is not None:
        raise _bad(why + ".", param)
    return text


def constraint(req: schemas.GenerateRequest) -> Constraint | None:
    """The request's constraint (None: free text), or a 400 naming the field."""
    rf = req.response_format
    out: Constraint | None = None
    if rf is not None and rf.type != "text":
        out = Constraint(json_schema=_response_schema(rf))
    if req.regex is not None:
        if out is not None:
            raise _bad("regex cannot be combined with a response_format other than 'text'.",
                       "regex")
        why = sampling.grammar_error("regex", req.regex)
        if why is not None:
            raise _bad(why + ".", "regex")
        out = Constraint(regex=req.regex, param="regex")
    if isinstance(req, schemas.ChatCompletionRequest):
        call = _tool_call(req.tools, req.tool_choice)
        if call is not None:
            if out is not None:
                raise _bad("A tool call cannot be combined with a response_format or a regex: "
                           "its output is the tool's arguments.", out.param)
            if req.logprobs:
                raise _bad("logprobs cannot be combined with a tool call.", "logprobs")
            return call
    return out


def _response_schema(rf: schemas.ResponseFormat) -> str:
    if rf.type == "json_object":
        return ANY_OBJECT
    if rf.type != "json_schema":
        raise _bad(f"response_format type {rf.type!r} is not one of 'text', 'json_object', "
                   f"'json_schema'.", "response_format.type")
    spec = rf.json_schema
    if not isinstance(spec, dict) or "schema" not in spec:
        raise _bad("response_format 'json_schema' needs json_schema.schema, a JSON Schema "
                   "object.", "response_format.json_schema")
    return _dump(spec["schema"], "response_format.json_schema.schema")


def _tool_call(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None
               ) -> Constraint | None:
    if choice == "none" or (choice is None and not tools):
        return None
    if not tools:
        raise _bad("tool_choice needs tools.", "tool_choice")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"At most {MAX_TOOLS} tools, got {len(tools)}.", "tools")
    schemas_by_name = {}
    for i, tool in enumerate(tools):
        name, params = _tool(tool, f"tools[{i}]")
        if name in schemas_by_name:
            raise _bad(f"Two tools are named {name!r}.", f"tools[{i}].function.name")
        schemas_by_name[name] = params
    if choice is None or choice == "auto":
        raise _bad("tool_choice 'auto' (the default when tools are given) needs a tool-call "
                   "parser for this model, and none is configured: set tool_choice to "
                   "'required', a named function, or 'none'.", "tool_choice")
    if choice == "required":
        names = list(schemas_by_name)
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        names = [choice["function"]["name"]]
        if names[0] not in schemas_by_name:
            raise _bad(f"tool_choice names {names[0]!r}, which is not one of the tools.",
                       "tool_choice")
    else:
        raise _bad("tool_choice must be 'none', 'auto', 'required' or "
                   "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
    calls = [{"type": "object", "properties": {"name": {"const": n},
                                               "arguments": schemas_by_name[n]},
              "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return Constraint(json_schema=_dump(schema, "tools"), param="tools", tool_call=True)


def _tool(tool: Any, param: str) -> tuple[str, dict[str, Any]]:
    """One tool's name and parameters' schema (an object with any properties when absent)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise _bad("A tool must be {'type': 'function', 'function': {'name': ...}}.", param)
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise _bad("A function's name is 1 to 64 letters, digits, '_', '.' or '-'.",
                   f"{param}.function.name")
    params = fn.get("parameters")
    if params is None:
        return name, {"type": "object"}
    if not isinstance(params, dict):
        raise _bad("A function's parameters must be a JSON Schema object.",
                   f"{param}.function.parameters")
    return name, params


CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def call_head(text: str) -> tuple[str, int] | None:
    """A tool call's name and where its arguments start in its output, once the output has got
    that far, their first character included (its grammar writes the name first), else None."""
    m = CALL_HEAD.match(text)
    if m is None:
        return None
    try:
        return json.loads(m.group(1)), m.end()
    except ValueError:
        return None


def parse_tool_call(text: str) -> tuple[str, str] | None:
    """A whole tool call's output as (name, its arguments' JSON as the model wrote it), or None
    when it is not one (cut short by max_tokens or a stop string)."""
    head = call_head(text)
    body = text.rstrip()
    if head is None or not body.endswith("}"):
        return None
    args = body[head[1]:-1].rstrip()
    try:
        json.loads(args)
    except ValueError:
        return None
    return head[0], args
