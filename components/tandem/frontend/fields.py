"""Request fields tandem does not apply: every one is a 400 that names it, never accepted and
ignored (OpenAI's behaviour: "Unrecognized request argument supplied").

The request Structs (tandem.frontend.schemas) forbid unknown fields, so msgspec stops at the
first; `refusal` then reads the body's top-level keys once more (only on this error path) so that
the 400 names every field the request carries that tandem does not apply, not just the first:
its message says why for each, and its `param` lists them (comma-separated, in the body's order).

Fields that users of vLLM, SGLang or OpenAI send and tandem knows it does not apply are in
`NOT_APPLIED`, each with its reason; any other name is unknown, with the nearest known field
suggested (a typo such as `max_token` must not run to the end of the context).

Inside a chat message, keys other than `role`, `content`, `name`, `tool_calls` and
`tool_call_id` are not refused: clients send back the assistant message they were given, with
the SDK's `refusal`, `annotations`, `audio` and `function_call` keys in it.
"""

from __future__ import annotations

import difflib
import functools
import msgspec

from tandem.runtime import errors

_GUIDED = "not supported: use response_format (json_schema) or regex"
_TEMPLATE = "not supported: the server's chat template is applied as it is"
NOT_APPLIED: dict[str, str] = {
    # OpenAI: cache routing (tandem honours vLLM's cache_salt for isolation).
    "prompt_cache_key": "not supported: tandem's prefix cache needs no key",
    # vLLM's sampling extensions tandem does not have.
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "prompt_logprobs": "prompt logprobs are not computed",
    "bad_words": "not supported: use logit_bias",
    "allowed_token_ids": "not supported: use logit_bias",
    "truncate_prompt_tokens": "not supported: prompts are never truncated",
    "spaces_between_special_tokens": "not supported",
    "return_tokens_as_token_ids": "not supported",
    "return_token_ids": "not supported",
    "logits_processors": "not supported",
    "vllm_xargs": "not supported",
    "kv_transfer_params": "not supported: tandem moves the KV itself",
    "request_id": "not supported: tandem names every request itself (the response's id)",
    # Constrained output under other names.
    "guided_json": _GUIDED, "guided_regex": _GUIDED, "guided_choice": _GUIDED,
    "guided_grammar": _GUIDED, "guided_decoding_backend": _GUIDED,
    "guided_whitespace_pattern": _GUIDED, "structured_outputs": _GUIDED, "json_schema": _GUIDED,
    "ebnf": _GUIDED,
    # The chat template's inputs.
    "add_generation_prompt": _TEMPLATE, "continue_final_message": _TEMPLATE,
    "add_special_tokens": _TEMPLATE, "chat_template": _TEMPLATE, "documents": _TEMPLATE,
    "mm_processor_kwargs": "not supported: this model takes text only",
    # SGLang's extensions.
    "lora_path": "not supported: no adapters are loaded",
    "no_stop_trim": "not supported: use include_stop_str_in_output",
    "separate_reasoning": "not supported: no reasoning parser is configured",
    "stream_reasoning": "not supported: no reasoning parser is configured",
    "return_hidden_states": "not supported",
    "custom_logit_processor": "not supported",
    "rid": "not supported: tandem names every request itself (the response's id)",
    # OpenAI fields tandem has no equivalent for.
    "functions": "deprecated by OpenAI and not supported: use tools",
    "function_call": "deprecated by OpenAI and not supported: use tool_choice",
    "audio": "not supported: this model takes and gives text only",
    "modalities": "not supported: this model takes and gives text only",
    "prediction": "not supported",
    "reasoning_effort": "not supported: this model has no reasoning mode",
    "service_tier": "not supported",
    "store": "not supported: nothing is stored",
    "metadata": "not supported: nothing is stored",
    "web_search_options": "not supported",
}


MAX_NAMED = 32  # fields a 400 names (a body of a million made-up keys gets a short answer)
MAX_NAME_CHARS = 64


@functools.cache
def known_fields(cls: type) -> tuple[str, ...]:
    """(Kept per class: msgspec's reading of a class leaves a reference cycle each time.)"""
    return tuple(f.encode_name for f in msgspec.structs.fields(cls))


def unapplied(keys: list[str], cls: type) -> list[str]:
    """The keys of a request body (in order) that `cls` does not have."""
    known = set(known_fields(cls))
    return [k for k in keys if k not in known]


def refusal(body: bytes, cls: type, first: str) -> errors.BadRequest:
    """The 400 for a body with unknown top-level fields (`first`: the one msgspec named)."""
    try:
        obj = msgspec.json.decode(body)
        keys = list(obj) if isinstance(obj, dict) else []
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        keys = []
    names = [n[:MAX_NAME_CHARS] for n in unapplied(keys, cls) or [first]]
    more = len(names) - MAX_NAMED
    names = names[:MAX_NAMED]
    known = known_fields(cls)
    reasons = []
    for name in names:
        why = NOT_APPLIED.get(name)
        if why is None:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            why = "unknown field" + (f" (did you mean `{near[0]}`?)" if near else "")
        reasons.append(f"`{name}`: {why}")
    if more > 0:
        reasons.append(f"and {more} more")
    noun = "argument" if len(names) == 1 else "arguments"
    return errors.BadRequest(f"Unrecognized request {noun} supplied: {'; '.join(reasons)}.",
                             param=",".join(names))


def nested_refusal(text: str, field: str, path: str) -> errors.BadRequest:
    """The 400 for an unknown field inside a nested object (msgspec's `text` names it)."""
    return errors.BadRequest(f"Unrecognized request argument supplied: `{field}` in "
                             f"`{path}` ({text}).", param=f"{path}.{field}" if path else field)


def parse_unknown(text: str) -> tuple[str, str] | None:
    """(field, path) from msgspec's "Object contains unknown field `x` - at `$.y`", or None."""
    prefix = "Object contains unknown field `"
    if not text.startswith(prefix):
        return None
    field, _, rest = text[len(prefix):].partition("`")
    at = rest.partition("`")[2].rpartition("`")[0]  # "$" or "$.stream_options"
    return field, at[2:] if at.startswith("$.") else ""

