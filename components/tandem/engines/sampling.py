"""What engines accept in a request's `SamplingParams` (`check_sampling`, every engine: the limits
of tandem.runtime.sampling) and what tandem's own engines, mock and reference, accept in a request
(`check_request`, once at submit); and the facts about the parameters the step needs.

Constrained output (`json_schema`, `regex`: `grammar_param`) is each engine's own: the reference
engine compiles it (tandem.engines.reference.grammar), the mock refuses it naming itself
(tandem.engines.stepper `Stepper.constraint`). Every refusal is an EngineRequestError naming its
field (the frontend's 400).
"""

from __future__ import annotations

from tandem.engines.base import ModelSpec
from tandem.runtime.errors import EngineRequestError
from tandem.runtime.sampling import check_sampling as sampling_problem
from tandem.runtime.wire import SamplingParams


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
    check_sampling(p, spec.vocab_size)
    if p.logprobs is not None and not carries_logprobs:
        raise _refuse("logprobs: this worker's KV handoff cannot carry the first token's "
                      "logprobs", "logprobs")


def grammar_param(p: SamplingParams) -> str | None:
    """The field that carries the request's grammar (constrained output), if it has one."""
    if p.json_schema is not None:
        return "json_schema"
    return "regex" if p.regex is not None else None


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
    """Refuse sampling parameters outside the limits (tandem.runtime.sampling) with an
    EngineRequestError naming the field, for every engine (the SGLang adapter too); `vocab_size`
    0 skips the token id checks."""
    problem = sampling_problem(p, vocab_size)
    if problem is not None:
        raise EngineRequestError(problem[0], param=problem[1])


def adjusts_logits(p: SamplingParams) -> bool:
    """Whether any penalty or bias changes the logits (False: the step skips that work)."""
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                or p.logit_bias)
