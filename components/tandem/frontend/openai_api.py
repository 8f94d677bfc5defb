"""The OpenAI HTTP API as tandem speaks it: request schemas for /v1/completions and
/v1/chat/completions, their validation (every refusal is `errors.BadRequest` with a clear message and
the offending `param`), and the response bodies, shaped exactly as the OpenAI SDK parses them.

Context length follows vLLM: a prompt of `max_context` tokens or more is refused; so is
`prompt + max_tokens > max_context`. A chat request without `max_tokens` may use the rest of the
context (vLLM); a completions request defaults to `FrontendConfig.default_max_tokens` (OpenAI: 16).
Unknown request fields are ignored, as the OpenAI API does for fields it does not know.

Several choices: `n` is 1..MAX_N; a completions request may carry up to MAX_PROMPTS prompts, and
`prompts * n` is at most MAX_CHOICES. With a `seed`, choice `i` of a prompt samples with
`seed + i`, so the n choices differ yet the response is reproducible.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, TypeVar

import msgspec

from tandem.runtime import errors
from tandem.runtime.wire import SamplingParams

ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_N = 64
MAX_PROMPTS = 64
MAX_CHOICES = 256

# --- requests -------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _GenerateRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    stream_interval: int | None = None  # tandem extension: coalesce this many tokens per chunk


class CompletionRequest(_GenerateRequest, kw_only=True):
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
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


class ChatCompletionRequest(_GenerateRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension


R = TypeVar("R", CompletionRequest, ChatCompletionRequest)
_decoders: dict[type, msgspec.json.Decoder[Any]] = {cls: msgspec.json.Decoder(cls) for cls in (CompletionRequest, ChatCompletionRequest)}
_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")
_FIELD_RE = re.compile(r"required field `([^`]+)`")


def decode_request(body: bytes, cls: type[R]) -> R:
    """Decode a JSON body against a request schema; any failure is a 400 naming the field."""
    try:
        return _decoders[cls].decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _PATH_RE.search(text) or _FIELD_RE.search(text)
        raise errors.BadRequest(text, param=m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise errors.BadRequest(f"Malformed JSON in request body: {e}") from None


# --- validation -----------------------------------------------------------------------------------


def check_model(req: _GenerateRequest, served_model: str) -> None:
    if req.model is not None and req.model != served_model:
        raise errors.ModelNotFound(
            f"The model `{req.model}` does not exist or you do not have access to it.",
            param="model")


def _check_common(req: _GenerateRequest, max_tokens: int | None, max_tokens_param: str) -> None:
    if not 1 <= req.n <= MAX_N:
        raise errors.BadRequest(f"n must be between 1 and {MAX_N}, got {req.n}.", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise errors.BadRequest(f"{max_tokens_param} must be at least 1, got {max_tokens}.",
                                param=max_tokens_param)
    if req.temperature is not None and req.temperature < 0:
        raise errors.BadRequest(f"temperature must be non-negative, got {req.temperature}.",
                                param="temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise errors.BadRequest(f"top_p must be in (0, 1], got {req.top_p}.", param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise errors.BadRequest(f"top_k must be -1 (disabled) or at least 0, got {req.top_k}.",
                                param="top_k")
    if req.min_tokens < 0:
        raise errors.BadRequest(f"min_tokens must be non-negative, got {req.min_tokens}.",
                                param="min_tokens")
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise errors.BadRequest(
            f"min_tokens ({req.min_tokens}) must not exceed {max_tokens_param} ({max_tokens}).",
            param="min_tokens")
    for s in stops_of(req):
        if not s:
            raise errors.BadRequest("stop strings must not be empty.", param="stop")
    for t in req.stop_token_ids or ():
        if t < 0:
            raise errors.BadRequest(f"stop_token_ids must be non-negative, got {t}.",
                                    param="stop_token_ids")
    if req.stream_options is not None and not req.stream:
        raise errors.BadRequest("The 'stream_options' parameter is only allowed when 'stream' "
                                "is enabled.", param="stream_options")
    if req.stream_interval is not None and req.stream_interval < 1:
        raise errors.BadRequest(f"stream_interval must be a positive integer, got "
                                f"{req.stream_interval}.", param="stream_interval")


def stops_of(req: _GenerateRequest) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    if isinstance(req.stop, str):
        return (req.stop,)
    return tuple(req.stop)


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    """`max_completion_tokens` wins over the deprecated `max_tokens` (as in vLLM)."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def validate_chat(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Check a chat request; return its messages as plain dicts for the chat template."""
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    _check_common(req, chat_max_tokens(req), param)
    if req.logprobs or req.top_logprobs:
        raise errors.BadRequest("logprobs are not supported yet.", param="logprobs")
    if not req.messages:
        raise errors.BadRequest("messages must contain at least one message.", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(req.messages):
        if msg.role not in ROLES:
            raise errors.BadRequest(
                f"Invalid role {msg.role!r} in messages[{i}]: expected one of "
                f"{', '.join(ROLES)}.", param=f"messages[{i}].role")
        content: str | None
        if isinstance(msg.content, list):
            texts: list[str] = []
            for j, part in enumerate(msg.content):
                if part.type != "text" or part.text is None:
                    raise errors.BadRequest(
                        f"Content parts of type {part.type!r} are not supported: this model takes "
                        f"text only.", param=f"messages[{i}].content[{j}]")
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = msg.content
        if content is None and not (msg.role == "assistant" and msg.tool_calls):
            raise errors.BadRequest(f"messages[{i}] has no content.",
                                    param=f"messages[{i}].content")
        d: dict[str, Any] = {"role": msg.role, "content": content}
        if msg.name is not None:
            d["name"] = msg.name
        if msg.tool_calls is not None:
            d["tool_calls"] = msg.tool_calls
        if msg.tool_call_id is not None:
            d["tool_call_id"] = msg.tool_call_id
        out.append(d)
    return out


def validate_completion(req: CompletionRequest) -> list[str | list[int]]:
    """Check a completions request; return its prompts (one or more), each text or token ids."""
    _check_common(req, req.max_tokens, "max_tokens")
    if req.logprobs:
        raise errors.BadRequest("logprobs are not supported yet.", param="logprobs")
    if req.echo:
        raise errors.BadRequest("echo is not supported yet.", param="echo")
    if req.best_of is not None and req.best_of != 1:
        raise errors.BadRequest("best_of is not supported yet.", param="best_of")
    if req.suffix is not None:
        raise errors.BadRequest("suffix is not supported yet.", param="suffix")
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise errors.BadRequest("prompt must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [_check_ids([p for p in prompt if isinstance(p, int)], "prompt")]
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise errors.BadRequest("prompt must be a string, a list of token ids, or a list of "
                                "either.", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise errors.BadRequest(f"At most {MAX_PROMPTS} prompts per request, got {len(prompt)}.",
                                param="prompt")
    if len(prompt) * req.n > MAX_CHOICES:
        raise errors.BadRequest(f"prompts * n must be at most {MAX_CHOICES}, got "
                                f"{len(prompt)} * {req.n}.", param="n")
    out: list[str | list[int]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, list):
            if not p:
                raise errors.BadRequest(f"prompt[{i}] must not be empty.", param=f"prompt[{i}]")
            out.append(_check_ids(p, f"prompt[{i}]"))
        else:
            assert isinstance(p, str)
            out.append(p)
    return out


def _check_ids(ids: list[int], param: str) -> list[int]:
    for t in ids:
        if t < 0:
            raise errors.BadRequest(f"Token id {t} is out of range.", param=param)
    return ids


def sampling_params(req: _GenerateRequest, max_tokens: int | None, prompt_tokens: int,
                    max_context: int, default_max_tokens: int | None) -> SamplingParams:
    """The engine's sampling parameters, after the context-length check. `default_max_tokens`
    None means "the rest of the context"."""
    if prompt_tokens >= max_context:
        raise errors.BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, your request "
            f"has {prompt_tokens} input tokens. Please reduce the length of the input.",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    param = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens = max_context - prompt_tokens
        if default_max_tokens is not None:
            max_tokens = min(max_tokens, default_max_tokens)
    elif prompt_tokens + max_tokens > max_context:
        raise errors.BadRequest(
            f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
            f"{max_context} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_context} - {prompt_tokens}).", param=param)
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=req.seed,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=min(req.min_tokens, max_tokens),
    )


# --- responses ------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class ResponseMessage(msgspec.Struct):
    role: str
    content: str | None


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    logprobs: None
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


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: None
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
    logprobs: None
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


def chat_completion(rid: str, created: int, model: str, text: str, finish: str | None,
                    usage: UsageInfo) -> ChatCompletion:
    return ChatCompletion(rid, "chat.completion", created, model,
                          [ChatChoice(0, ResponseMessage("assistant", text), None, finish)], usage)


def text_completion(rid: str, created: int, model: str, text: str, finish: str | None,
                    usage: UsageInfo | None) -> Completion:
    return Completion(rid, "text_completion", created, model,
                      [CompletionChoice(0, text, None, finish)], usage)


def chat_completion_choices(rid: str, created: int, model: str,
                            outs: list[tuple[str, str | None]], usage: UsageInfo) -> ChatCompletion:
    """Several choices, `outs[index] = (text, finish_reason)`."""
    return ChatCompletion(rid, "chat.completion", created, model,
                          [ChatChoice(i, ResponseMessage("assistant", text), None, fin)
                           for i, (text, fin) in enumerate(outs)], usage)


def text_completion_choices(rid: str, created: int, model: str,
                            outs: list[tuple[str, str | None]], usage: UsageInfo) -> Completion:
    return Completion(rid, "text_completion", created, model,
                      [CompletionChoice(i, text, None, fin) for i, (text, fin) in enumerate(outs)],
                      usage)
