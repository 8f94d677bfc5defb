"""What a worker checks in a `Generate` before its engine sees it (ARCHITECTURE.md, "Worker").

A frontend validates what clients send; a worker still meets bytes from any peer that reached its
socket, so it refuses, with one reason in words, what would hurt an engine or the process: an empty
prompt, token ids outside the model's vocabulary, a non-finite or out-of-range number anywhere in
the sampling parameters (NaN temperature, negative max_tokens or top_k, integers past 64 bits,
huge stop lists), a malformed request id or bootstrap address. It does not repeat the engine's own
semantic checks (context length, min_tokens <= max_tokens, ...): the engine refuses those with
its own words. Every check is O(prompt length) or less, done in C where it scans the prompt.

`check_generate` is pure: the server turns a reason into an error delta (ErrorKind.BAD_REQUEST).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.engines.sampling import KnownValid
from tandem.runtime.wire import Bootstrap, Generate, SamplingParams

MAX_RID_CHARS = 256
MAX_STOP_TOKEN_IDS = 8192
MAX_HOST_CHARS = 255
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # what every engine's integer types hold
SEED_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Limits:
    """What the worker's engine can take (0 = unknown: that check is skipped)."""

    vocab_size: int = 0
    max_context: int = 0


def check_generate(g: Generate, limits: Limits) -> str | None:
    """None if `g` may go to the engine, else why not."""
    if not g.rid or len(g.rid) > MAX_RID_CHARS:
        return f"request id must have 1 to {MAX_RID_CHARS} characters"
    why = check_prompt(g.prompt_ids, limits)
    if why is None and not 0 <= g.resume_offset < len(g.prompt_ids):
        why = "resume_offset must be at least 0 and less than the prompt's length"
    if why is None:
        why = check_sampling(g.sampling, limits)
    if why is None and g.bootstrap is not None:
        why = check_bootstrap(g.bootstrap)
    return why


def check_prompt(ids: list[int], limits: Limits) -> str | None:
    if not ids:
        return "prompt is empty"
    if limits.max_context and len(ids) > limits.max_context:
        return f"prompt has {len(ids)} tokens; this model's context is {limits.max_context}"
    lo, hi = min(ids), max(ids)
    top = limits.vocab_size or INT_MAX + 1
    if lo < 0 or hi >= top:
        return f"prompt has token ids outside [0, {top})"
    return None


_VALID = KnownValid()  # sampling parameters found valid (they repeat)


def check_sampling(p: SamplingParams, limits: Limits) -> str | None:
    """`_check_sampling`, remembering the last few distinct valid ones."""
    if p in _VALID:
        return None
    why = _check_sampling(p)
    if why is None:
        _VALID.add(p)
    return why


def _check_sampling(p: SamplingParams) -> str | None:
    # Every number, whatever the field (new fields included): finite, and within 64 bits.
    for name in p.__struct_fields__:
        value = getattr(p, name)
        values = (*value.keys(), *value.values()) if isinstance(value, dict) else \
            value if isinstance(value, (tuple, list)) else (value,)
        if len(values) > MAX_STOP_TOKEN_IDS:
            return f"{name} has {len(values)} items; at most {MAX_STOP_TOKEN_IDS}"
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                return f"{name} must be a finite number"
            if isinstance(v, int) and not isinstance(v, bool) and not INT_MIN <= v <= (
                    SEED_MAX if name == "seed" else INT_MAX):
                return f"{name} is out of range"
    if p.max_tokens < 0:
        return "max_tokens must not be negative"
    if p.min_tokens < 0:
        return "min_tokens must not be negative"
    if p.temperature < 0:
        return "temperature must be >= 0"
    if not 0.0 < p.top_p <= 1.0:
        return "top_p must be in (0, 1]"
    if p.top_k < 0:
        return "top_k must be >= 0 (0 disables it)"
    if p.seed is not None and p.seed < 0:
        return "seed must not be negative"
    if any(t < 0 for t in p.stop_token_ids):
        return "stop_token_ids must not be negative"
    return None


def check_bootstrap(b: Bootstrap) -> str | None:
    if not b.host or len(b.host) > MAX_HOST_CHARS:
        return "bootstrap host is empty or too long"
    if not 0 < b.port < 65536:
        return "bootstrap port must be in [1, 65535]"
    if b.room < 0:
        return "bootstrap room must not be negative"
    return None
