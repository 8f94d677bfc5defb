"""The OpenAI API's request and response bodies as tandem speaks them (msgspec Structs), shaped
exactly as the OpenAI SDK sends and parses them.

Requests: every optional field may be absent or an explicit JSON `null`, which means the same
("not given": the SDK sends `n=None`, `stream=None`). Integers carry their range in the type, so
decoding alone refuses an out-of-range number with a 400 naming the field (tandem.frontend.validate
turns msgspec's error into it); a float that overflows (1e400) is refused the same way, and JSON
has no NaN or Infinity. An unknown field is refused (OpenAI's behaviour; the 400 names every one,
tandem.frontend.fields), except inside a chat message: clients send back the assistant message
they were given, with keys of the SDK's that tandem has no use for.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

I64 = 2**63 - 1
NonNegInt = Annotated[int, Meta(ge=0, le=I64)]
PosInt = Annotated[int, Meta(ge=1, le=I64)]
TokenId = Annotated[int, Meta(ge=0, le=I64)]
# Messages in one chat request: past it, a 400 while the body decodes (a million empty messages
# cost the template seconds of the event loop before; long agent conversations hold hundreds).
MAX_MESSAGES = 4096
AnyInt = Annotated[int, Meta(ge=-(2**63), le=I64)]

# --- requests -------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    json_schema: dict[str, Any] | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: AnyInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: AnyInt | None = None
    min_p: float | None = None
    seed: AnyInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[AnyInt] | None = None
    ignore_eos: bool | None = None
    min_tokens: AnyInt | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: AnyInt | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's: the prefix cache partition (tandem.frontend.salt)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[AnyInt, float] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    stream_interval: AnyInt | None = None  # tandem extension: coalesce this many tokens per chunk
    regex: str | None = None  # tandem extension: the output matches this regular expression
    priority: AnyInt | None = None  # vLLM's: lower is served first (default 0)


class CompletionRequest(GenerateRequest, kw_only=True):
    prompt: str | list[str | AnyInt | list[AnyInt]]
    logprobs: AnyInt | None = None
    echo: bool | None = None
    best_of: AnyInt | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(GenerateRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)]
    max_completion_tokens: AnyInt | None = None
    logprobs: bool | None = None
    top_logprobs: AnyInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /tokenize: a completions `prompt`, or chat `messages` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[AnyInt]


# --- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens served from the worker's prefix cache


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON


class ToolCall(msgspec.Struct):
    id: str
    type: str
    function: FunctionCall


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None  # the next part of the arguments' JSON


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A part of a streamed tool call (`delta.tool_calls`): the first carries its id, type and
    name; the rest, the next part of its arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class ResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | msgspec.Raw | None  # Raw: rendered already (openai_api.LogprobsJson)
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | msgspec.Raw | None  # Raw: as in ChatChoice
    finish_reason: str | None


class Completion(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int | None


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str
