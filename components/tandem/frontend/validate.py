"""Decoding and validating OpenAI requests: every field is applied or refused with a 400 (an
`errors.BadRequest` whose `param` names it), and what is applied becomes the engine's
`SamplingParams` (`sampling_params`) or a frontend-side option (`Options`: stop strings, echo,
logprobs rendering, usage in every chunk).

Context length follows vLLM: a prompt of `max_context` tokens or more is refused; so is
`prompt + max_tokens > max_context`. A chat request without `max_tokens` may use the rest of the
context (vLLM); a completions request defaults to `FrontendConfig.default_max_tokens` (OpenAI: 16).

Several choices: `n` is 1..MAX_N; a completions request may carry up to MAX_PROMPTS prompts, and
`prompts * n` is at most MAX_CHOICES. With a `seed`, choice `i` of a prompt samples with
`(seed + i) mod 2^63`, so the n choices differ, the response is reproducible and no seed overflows.

Constrained output (`response_format`, the `regex` extension) and tool calls (`tools`,
`tool_choice`) are tandem.frontend.structured's: `sampling_params` carries what they become.

What is refused everywhere, with the field named: `best_of` > 1, `suffix`, `echo` with `logprobs`
(prompt logprobs are not computed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from tandem.frontend.http import PayloadTooLarge
from tandem.frontend import fields, structured
from tandem.frontend.structured import Constraint
from tandem.frontend.schemas import (ChatCompletionRequest, CompletionRequest,
                                     DetokenizeRequest, GenerateRequest, TokenizeRequest)
from tandem.runtime import errors, sampling
from tandem.runtime.wire import SamplingParams

ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_N = 64
MAX_PROMPTS = 64
MAX_CHOICES = 256
MAX_STOPS = 64
MAX_STOP_CHARS = 1024
MAX_PROMPT_CHARS = 4_000_000  # every prompt or message of a request together: past it, 413
SEED_MOD = 2**63

R = TypeVar("R", CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
_decoders: dict[type, msgspec.json.Decoder[Any]] = {
    cls: msgspec.json.Decoder(cls)
    for cls in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)}
_PATH_RE = re.compile(r"`\$\.?([^`]*)`$")
_FIELD_RE = re.compile(r"required field `([^`]+)`")


def decode_request(body: bytes, cls: type[R]) -> R:
    """Decode a JSON body against a request schema; any failure is a 400 naming the field when
    there is one: a field tandem does not apply (tandem.frontend.fields: every such field named),
    a wrong type, a number out of range, a body that is not an object, invalid UTF-8, or nesting
    too deep to decode."""
    try:
        return _decoders[cls].decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        unknown = fields.parse_unknown(text)
        if unknown is not None:
            field, path = unknown
            raise (fields.nested_refusal(text, field, path) if path else
                   fields.refusal(body, cls, field)) from None
        m = _PATH_RE.search(text) or _FIELD_RE.search(text)
        raise errors.BadRequest(text, param=m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise errors.BadRequest(f"Malformed JSON in request body: {e}") from None
    except UnicodeDecodeError:
        raise errors.BadRequest("The request body is not valid UTF-8.") from None
    except RecursionError:
        raise errors.BadRequest("The request body is nested too deeply.") from None


def check_model(req: GenerateRequest | TokenizeRequest | DetokenizeRequest,
                served_model: str) -> None:
    if req.model is not None and req.model != served_model:
        raise errors.ModelNotFound(
            f"The model `{req.model}` does not exist or you do not have access to it.",
            param="model")


def _bad(message: str, param: str) -> errors.BadRequest:
    return errors.BadRequest(message, param=param)


def _check(why: str | None, param: str) -> None:
    """A limit of tandem.runtime.sampling, applied to the request's field `param`."""
    if why is not None:
        raise _bad(why + ".", param)


@dataclass(slots=True)  # (not frozen: a frozen dataclass's __init__ costs more, per request)
class Options:
    """What the frontend itself does for a request (the engine sees only `constraint`, through
    `sampling_params`)."""

    n: int
    stream: bool
    stops: tuple[str, ...]
    include_stop: bool
    skip_special_tokens: bool
    echo: bool
    logprobs: int | None  # top alternatives per token; None = no logprobs in the response
    include_usage: bool
    continuous_usage: bool
    constraint: Constraint | None  # constrained output, a tool call (tandem.frontend.structured)


def options(req: ChatCompletionRequest | CompletionRequest) -> Options:
    so = req.stream_options
    logprobs: int | None
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        echo = False
    else:
        logprobs, echo = req.logprobs, bool(req.echo)
    return Options(n=req.n or 1, stream=bool(req.stream), stops=stops_of(req),
                   include_stop=bool(req.include_stop_str_in_output),
                   skip_special_tokens=req.skip_special_tokens is not False, echo=echo,
                   logprobs=logprobs, include_usage=bool(so and so.include_usage),
                   continuous_usage=bool(so and so.continuous_usage_stats),
                   constraint=structured.constraint(req))


def _check_common(req: GenerateRequest, max_tokens: int | None, max_tokens_param: str,
                  vocab_size: int) -> None:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise _bad(f"n must be between 1 and {MAX_N}, got {n}.", "n")
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"{max_tokens_param} must be at least 1, got {max_tokens}.", max_tokens_param)
    for name in sampling.RANGES:  # temperature, top_p, min_p and the penalties
        value = getattr(req, name)
        if value is not None:
            _check(sampling.range_error(name, value), name)
    if req.top_k is not None and req.top_k < -1:
        raise _bad(f"top_k must be -1 (disabled) or at least 0, got {req.top_k}.", "top_k")
    min_tokens = req.min_tokens or 0
    if min_tokens < 0:
        raise _bad(f"min_tokens must be non-negative, got {min_tokens}.", "min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad(f"min_tokens ({min_tokens}) must not exceed {max_tokens_param} "
                   f"({max_tokens}).", "min_tokens")
    stops = stops_of(req)
    if len(stops) > MAX_STOPS:
        raise _bad(f"At most {MAX_STOPS} stop strings, got {len(stops)}.", "stop")
    for s in stops:
        if not s:
            raise _bad("stop strings must not be empty.", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise _bad(f"A stop string has at most {MAX_STOP_CHARS} characters.", "stop")
    if req.stop_token_ids:
        _check(sampling.stop_ids_error(req.stop_token_ids, vocab_size), "stop_token_ids")
    if req.logit_bias:
        _check(sampling.logit_bias_error(req.logit_bias, vocab_size), "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise _bad("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                   "stream_options")
    if req.stream_interval is not None and req.stream_interval < 1:
        raise _bad(f"stream_interval must be a positive integer, got {req.stream_interval}.",
                   "stream_interval")


def stops_of(req: GenerateRequest) -> tuple[str, ...]:
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


def max_tokens_param(req: GenerateRequest) -> str:
    """The name of the field that gave the request's max_tokens (see chat_max_tokens)."""
    chat = isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
    return "max_completion_tokens" if chat else "max_tokens"


def check_response_logprobs(req: GenerateRequest, opts: Options, max_tokens: list[int],
                            limit: int) -> None:
    """A non-streamed response is held whole until it is sent: the token logprobs it may carry
    (over its choices, `max_tokens` each, times 1 + the alternatives per token) are at most
    `limit` (--max-response-logprobs). A stream is written as it is made: no cap."""
    if opts.stream or opts.logprobs is None:
        return
    most = sum(max_tokens) * (1 + opts.logprobs)
    if most > limit:
        param = max_tokens_param(req)
        raise _bad(f"A response that is not streamed carries at most {limit} token logprobs; "
                   f"this one could carry {most} ({len(max_tokens)} choice(s) of up to "
                   f"{max(max_tokens)} tokens, each with {1 + opts.logprobs} logprobs). Lower "
                   f"{param}, n or the logprobs asked for, or set stream to true.", param)


def check_prompt_chars(n: int, param: str) -> None:
    if n > MAX_PROMPT_CHARS:
        raise PayloadTooLarge(f"The {param} have {n} characters; at most {MAX_PROMPT_CHARS}.",
                              param=param)


def validate_chat(req: ChatCompletionRequest, vocab_size: int = 2**63) -> list[dict[str, Any]]:
    """Check a chat request; return its messages as plain dicts for the chat template."""
    _check_common(req, chat_max_tokens(req), max_tokens_param(req), vocab_size)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise _bad("top_logprobs needs logprobs to be true.", "top_logprobs")
        _check(sampling.logprobs_error(req.top_logprobs, "top_logprobs"), "top_logprobs")
    if not req.messages:
        raise _bad("messages must contain at least one message.", "messages")
    out: list[dict[str, Any]] = []
    chars = 0
    for i, msg in enumerate(req.messages):
        d = message_dict(msg, i)
        chars += len(d["content"] or "")
        out.append(d)
    check_prompt_chars(chars, "messages")
    return out


def message_dict(msg: Any, i: int) -> dict[str, Any]:
    """One chat message (schemas.ChatMessage) as the template's dict; refuses what it cannot be."""
    if msg.role not in ROLES:
        raise _bad(f"Invalid role {msg.role!r} in messages[{i}]: expected one of "
                   f"{', '.join(ROLES)}.", f"messages[{i}].role")
    content: str | None
    if isinstance(msg.content, list):
        texts: list[str] = []
        for j, part in enumerate(msg.content):
            if part.type != "text" or part.text is None:
                raise _bad(f"Content parts of type {part.type!r} are not supported: this model "
                           f"takes text only.", f"messages[{i}].content[{j}]")
            texts.append(part.text)
        content = "\n".join(texts)
    else:
        content = msg.content
    if content is None and not (msg.role == "assistant" and msg.tool_calls):
        raise _bad(f"messages[{i}] has no content.", f"messages[{i}].content")
    d: dict[str, Any] = {"role": msg.role, "content": content}
    if msg.name is not None:
        d["name"] = msg.name
    if msg.tool_calls is not None:
        d["tool_calls"] = msg.tool_calls
    if msg.tool_call_id is not None:
        d["tool_call_id"] = msg.tool_call_id
    return d


def validate_completion(req: CompletionRequest, vocab_size: int = 2**63
                        ) -> list[str | list[int]]:
    """Check a completions request; return its prompts (one or more), each text or token ids."""
    _check_common(req, req.max_tokens, "max_tokens", vocab_size)
    if req.logprobs is not None:
        _check(sampling.logprobs_error(req.logprobs), "logprobs")
    if req.echo and req.logprobs is not None:
        raise _bad("echo with logprobs is not supported (prompt logprobs are not computed).",
                   "echo")
    if req.best_of is not None and req.best_of != 1:
        raise _bad("best_of is not supported.", "best_of")
    if req.suffix:
        raise _bad("suffix is not supported.", "suffix")
    prompt = req.prompt
    n = req.n or 1
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), "prompt")
        return [prompt]
    if not prompt:
        raise _bad("prompt must not be empty.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [_check_ids([p for p in prompt if isinstance(p, int)], "prompt")]
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise _bad("prompt must be a string, a list of token ids, or a list of either.", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise _bad(f"At most {MAX_PROMPTS} prompts per request, got {len(prompt)}.", "prompt")
    if len(prompt) * n > MAX_CHOICES:
        raise _bad(f"prompts * n must be at most {MAX_CHOICES}, got {len(prompt)} * {n}.", "n")
    out: list[str | list[int]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, list):
            if not p:
                raise _bad(f"prompt[{i}] must not be empty.", f"prompt[{i}]")
            out.append(_check_ids(p, f"prompt[{i}]"))
        else:
            assert isinstance(p, str)
            out.append(p)
    check_prompt_chars(sum(len(p) for p in out if isinstance(p, str)), "prompt")
    return out


def _check_ids(ids: list[int], param: str) -> list[int]:
    for t in ids:
        if t < 0:
            raise _bad(f"Token id {t} is out of range.", param)
    return ids


def seed_of(seed: int | None, i: int) -> int | None:
    """The seed of choice `i`: `(seed + i) mod 2^63` (never negative, never past 63 bits)."""
    return None if seed is None else (seed + i) % SEED_MOD


def sampling_params(req: GenerateRequest, max_tokens: int | None, prompt_tokens: int,
                    max_context: int, default_max_tokens: int | None,
                    constraint: Constraint | None = None) -> SamplingParams:
    """The engine's sampling parameters, after the context-length check. `default_max_tokens`
    None means "the rest of the context"; `constraint` (structured.constraint) its grammar."""
    chat = isinstance(req, ChatCompletionRequest)
    if prompt_tokens >= max_context:
        raise _bad(f"This model's maximum context length is {max_context} tokens. However, your "
                   f"request has {prompt_tokens} input tokens. Please reduce the length of the "
                   f"input.", "messages" if chat else "prompt")
    param = max_tokens_param(req)
    if max_tokens is None:
        max_tokens = max_context - prompt_tokens
        if default_max_tokens is not None:
            max_tokens = min(max_tokens, default_max_tokens)
    elif prompt_tokens + max_tokens > max_context:
        raise _bad(f"'{param}' is too large: {max_tokens}. This model's maximum context length "
                   f"is {max_context} tokens and your request has {prompt_tokens} input tokens "
                   f"({max_tokens} > {max_context} - {prompt_tokens}).", param)
    logprobs: int | None
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs  # type: ignore[attr-defined]
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=seed_of(req.seed, 0),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=min(req.min_tokens or 0, max_tokens),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=dict(req.logit_bias) if req.logit_bias else None,
        min_p=req.min_p or 0.0,
        logprobs=logprobs,
        json_schema=None if constraint is None else constraint.json_schema,
        regex=None if constraint is None else constraint.regex,
    )
