"""What engines accept in a request's `SamplingParams` (`check_sampling`, every engine) and what
tandem's own engines, mock and reference, accept in a request (`check_request`, once at submit);
and the facts about the parameters the step needs.

Ranges: temperature >= 0, top_p in (0, 1], top_k >= 0 (0 = off), min_p in [0, 1], presence and
frequency penalties in [-2, 2], repetition penalty > 0, logit_bias values in [-100, 100] with keys
in the model's vocabulary, logprobs in [0, MAX_LOGPROBS] (None = off). Constrained output
(`json_schema`, `regex`) needs a grammar engine: these engines refuse it, naming the field.
Every refusal is an EngineRequestError naming its field (the frontend's 400).
"""

from __future__ import annotations

import math

from tandem.engines.base import ModelSpec
from tandem.runtime.errors import EngineRequestError
from tandem.runtime.wire import SamplingParams

MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency, either sign
MAX_LOGIT_BIAS = 100.0


def _refuse(why: str, param: str) -> EngineRequestError:
    return EngineRequestError(why, param=param)


def check_request(prompt: list[int], p: SamplingParams, spec: ModelSpec,
                  carries_logprobs: bool = True) -> None:
    """Refuse a request these engines cannot take: an empty prompt, one that fills the context,
    bad sampling parameters, or logprobs a PD handoff cannot carry (`carries_logprobs`)."""
    if not prompt:
        raise EngineRequestError("prompt is empty")
    if len(prompt) >= spec.max_context:
        raise EngineRequestError(f"prompt has {len(prompt)} tokens; this model's context is "
                                 f"{spec.max_context} tokens")
    key = (p, spec.vocab_size)  # (parameters repeat: each valid set is checked once per vocab)
    if key not in _VALID:
        check_sampling(p, spec.vocab_size)
        _VALID.add(key)
    for name in ("json_schema", "regex"):
        if getattr(p, name) is not None:
            raise _refuse(f"{name} (constrained output) is not supported by this engine; "
                          "the sglang engine supports it", name)
    if p.logprobs is not None and not carries_logprobs:
        raise _refuse("logprobs: this worker's KV handoff cannot carry the first token's "
                      "logprobs", "logprobs")


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


_VALID = KnownValid()  # (sampling parameters, vocabulary size) that check_sampling let through
_STOPS: dict[tuple[tuple[int, ...], bool, tuple[int, ...]], frozenset[int]] = {}


def stop_ids(p: SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The ids that end a request: its stop ids, and EOS unless it ignores it (remembered per
    distinct set: requests repeat them)."""
    key = (p.stop_token_ids, p.ignore_eos, eos_token_ids)
    stop = _STOPS.get(key)
    if stop is None:
        stop = frozenset(p.stop_token_ids if p.ignore_eos else
                         (*p.stop_token_ids, *eos_token_ids))
        if len(_STOPS) >= 256:
            _STOPS.clear()
        _STOPS[key] = stop
    return stop


def check_sampling(p: SamplingParams, vocab_size: int = 0) -> None:
    """Refuse sampling parameters out of range (EngineRequestError naming the field), for every
    engine (the SGLang adapter too); `vocab_size` 0 skips the logit_bias key check."""
    if p.max_tokens < 1:
        raise _refuse("max_tokens must be at least 1", "max_tokens")
    if not p.temperature >= 0:
        raise _refuse("temperature must be >= 0", "temperature")
    if not 0.0 < p.top_p <= 1.0:
        raise _refuse("top_p must be in (0, 1]", "top_p")
    if p.top_k < 0:
        raise _refuse("top_k must be >= 0 (0 disables it)", "top_k")
    if p.min_tokens < 0 or p.min_tokens > p.max_tokens:
        raise _refuse("min_tokens must be in [0, max_tokens]", "min_tokens")
    if not 0.0 <= p.min_p <= 1.0:
        raise _refuse("min_p must be in [0, 1]", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -MAX_PENALTY <= getattr(p, name) <= MAX_PENALTY:
            raise _refuse(f"{name} must be in [-2, 2]", name)
    if not (p.repetition_penalty > 0 and math.isfinite(p.repetition_penalty)):
        raise _refuse("repetition_penalty must be > 0 (1 disables it)", "repetition_penalty")
    if p.logit_bias:
        for token, bias in p.logit_bias.items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise _refuse(f"logit_bias values must be in [-100, 100] (token {token}: {bias})",
                              "logit_bias")
            if token < 0 or (vocab_size and token >= vocab_size):
                raise _refuse(f"logit_bias key {token} is not a token id of this model "
                              f"(vocabulary [0, {vocab_size}))", "logit_bias")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        raise _refuse(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")


def adjusts_logits(p: SamplingParams) -> bool:
    """Whether any penalty or bias changes the logits (False: the step skips that work)."""
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                or p.logit_bias)
