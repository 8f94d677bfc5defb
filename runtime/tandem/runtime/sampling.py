"""What a request's sampling parameters may be: the limits and the checks, once, for every place
that checks them. The frontend applies them to an OpenAI request's fields before it tokenizes
(tandem.frontend.validate, a 400 naming the field); a worker applies `check_sampling` to every
`Generate` it receives, untrusted (tandem.worker.validate); tandem's engines and the SGLang adapter
to every request they are given (tandem.engines.sampling).

Ranges: max_tokens >= 1, min_tokens in [0, max_tokens], temperature in [0, 1e6], top_p in (0, 1],
top_k >= 0 (0 = off), min_p in [0, 1], presence and frequency penalties in [-2, 2], repetition
penalty in (0, 1e6] (1 = off), logit_bias: at most MAX_LOGIT_BIAS_ENTRIES values in [-100, 100]
keyed by the model's token ids, stop_token_ids: at most MAX_STOP_TOKEN_IDS of the model's token
ids, logprobs in [0, MAX_LOGPROBS] (None = off), seed in [0, 2^64), json_schema and regex (the
grammars of constrained output) at most MAX_GRAMMAR_CHARS characters each, not both. Every number
is finite and fits 64 bits (an engine's integer types), whatever the field, a new one too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from tandem.runtime.wire import SamplingParams

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # a bias value, either sign
MAX_LOGIT_BIAS_ENTRIES = 4096
MAX_STOP_TOKEN_IDS = 8192
# A json_schema or a regex: ordinary shapes compile in under a second at this size; costly ones
# are stopped by the compile deadline (perf/results/grammar_compile.md).
MAX_GRAMMAR_CHARS = 32768
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
SEED_MAX = 2**64 - 1

# field -> (lo, hi, lo excluded)
RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 1e6, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.0, 1e6, True),
}

__all__ = ["MAX_GRAMMAR_CHARS", "MAX_LOGIT_BIAS", "MAX_LOGIT_BIAS_ENTRIES", "MAX_LOGPROBS",
           "MAX_STOP_TOKEN_IDS", "RANGES", "KnownValid", "check_sampling", "grammar_error",
           "logit_bias_error", "logprobs_error", "range_error", "stop_ids_error"]

Problem = tuple[str, str]  # (why, in words; the field)


def range_error(name: str, value: float) -> str | None:
    """Why `value` is not a valid `name` (a field of RANGES), or None."""
    lo, hi, open_lo = RANGES[name]
    if not (lo < value if open_lo else lo <= value) or not value <= hi:  # (NaN fails both)
        return f"{name} must be in {'(' if open_lo else '['}{lo:g}, {hi:g}], got {value}"
    return None


def logit_bias_error(bias: Mapping[int, float], vocab_size: int) -> str | None:
    """`vocab_size` 0: the keys are not checked against a vocabulary."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        return f"logit_bias has at most {MAX_LOGIT_BIAS_ENTRIES} entries"
    for token, value in bias.items():
        if token < 0 or (vocab_size and token >= vocab_size):
            return (f"logit_bias: {token} is not a token id of this model (vocabulary "
                    f"[0, {vocab_size}))")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            return f"logit_bias values must be in [-100, 100], got {value} for token {token}"
    return None


def stop_ids_error(ids: Iterable[int], vocab_size: int) -> str | None:
    ids = tuple(ids)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        return f"stop_token_ids has at most {MAX_STOP_TOKEN_IDS} entries"
    for t in ids:
        if t < 0 or (vocab_size and t >= vocab_size):
            return (f"stop_token_ids: {t} is not a token id of this model (vocabulary "
                    f"[0, {vocab_size}))")
    return None


def grammar_error(name: str, text: str) -> str | None:
    """A json_schema or regex past the size a grammar compiler is given."""
    if len(text) > MAX_GRAMMAR_CHARS:
        return f"{name} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}"
    return None


def logprobs_error(k: int, name: str = "logprobs") -> str | None:
    if not 0 <= k <= MAX_LOGPROBS:
        return f"{name} must be in [0, {MAX_LOGPROBS}], got {k}"
    return None


def _numbers_error(p: SamplingParams) -> Problem | None:
    """Every number of every field finite and within 64 bits; no huge collection."""
    for name in p.__struct_fields__:
        value = getattr(p, name)
        values = (*value.keys(), *value.values()) if isinstance(value, dict) else \
            value if isinstance(value, (tuple, list)) else (value,)
        if len(values) > MAX_STOP_TOKEN_IDS:
            return f"{name} has {len(values)} items; at most {MAX_STOP_TOKEN_IDS}", name
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                return f"{name} must be a finite number", name
            if isinstance(v, int) and not isinstance(v, bool) and not INT_MIN <= v <= (
                    SEED_MAX if name == "seed" else INT_MAX):
                return f"{name} is out of range", name
    return None


def check_sampling(p: SamplingParams, vocab_size: int = 0) -> Problem | None:
    """None if `p` is within every limit above, else (why, the field). `vocab_size` 0: token ids
    are not checked against a vocabulary. What was found valid is remembered for the process
    (requests repeat their parameters: the worker and then its engine check each one)."""
    key = (p, vocab_size)
    if key in _VALID:
        return None
    problem = _check(p, vocab_size)
    if problem is None:
        _VALID.add(key)
    return problem


def _check(p: SamplingParams, vocab_size: int) -> Problem | None:
    problem = _numbers_error(p)
    if problem is not None:
        return problem
    if p.max_tokens < 1:
        return f"max_tokens must be at least 1, got {p.max_tokens}", "max_tokens"
    if not 0 <= p.min_tokens <= p.max_tokens:
        return f"min_tokens must be in [0, max_tokens], got {p.min_tokens}", "min_tokens"
    if p.top_k < 0:
        return "top_k must be >= 0 (0 disables it)", "top_k"
    if p.seed is not None and p.seed < 0:
        return "seed must not be negative", "seed"
    for name in RANGES:
        why = range_error(name, getattr(p, name))
        if why is not None:
            return why, name
    why = stop_ids_error(p.stop_token_ids, vocab_size)
    if why is not None:
        return why, "stop_token_ids"
    if p.logit_bias:
        why = logit_bias_error(p.logit_bias, vocab_size)
        if why is not None:
            return why, "logit_bias"
    if p.logprobs is not None:
        why = logprobs_error(p.logprobs)
        if why is not None:
            return why, "logprobs"
    if p.json_schema is not None and p.regex is not None:
        return "json_schema and regex cannot both be set", "regex"
    for name in ("json_schema", "regex"):
        text = getattr(p, name)
        why = None if text is None else grammar_error(name, text)
        if why is not None:
            return why, name
    return None


class KnownValid:
    """What a check found valid before, remembered (up to `cap` keys; then it starts over). Equal
    keys are equally valid: each field has one type. A key that cannot be hashed (a logit_bias
    dict inside) is never known, so it is checked every time."""

    def __init__(self, cap: int = 256) -> None:
        self._keys: dict[object, None] = {}
        self._cap = cap

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._keys
        except TypeError:
            return False

    def add(self, key: object) -> None:
        try:
            hash(key)
        except TypeError:
            return
        if len(self._keys) >= self._cap:
            self._keys.clear()
        self._keys[key] = None


_VALID = KnownValid()  # (sampling parameters, vocabulary size) found valid
