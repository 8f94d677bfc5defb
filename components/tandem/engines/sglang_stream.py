"""SGLang's requests and streamed items as tandem sees them, with no sglang import (the engine
module, `tandem.engines.sglang`, is the one that imports sglang): the sampling dict and call keywords
built from a tandem request, and `SGLangStream`, which turns one request's items into EngineOutputs.

Sampling: tandem's fields map to SGLang's keys (`max_new_tokens`, `sampling_seed`, top_k 0 -> -1,
logit_bias keys as strings; penalties, min_p, json_schema and regex by name); what SGLang cannot
honour here is refused naming the field (min_tokens without SGLang's tokenizer, seed without
deterministic inference, repetition_penalty above 2). SGLang checks logit_bias keys against its
vocabulary itself (a 400 from its first item). Logprobs are asked of SGLang (`return_logprob`,
`top_logprobs_num`, none for the prompt) and read from its items' `output_token_logprobs` and
`output_top_logprobs` ((logprob, id, text) triples): the model's own distribution, as tandem's
contract says, because the worker sets `SGLANG_RETURN_ORIGINAL_LOGPROB` (`ENGINE_ENV`) before
sglang is imported (SGLang's default applies the temperature first).

A moved request (`resume_offset`: its last prompt ids are tokens an earlier leg produced) runs on
SGLang as a new prompt, which is exact for what SGLang computes from the tokens alone, but not for
what counts output tokens: penalties and constrained output (a grammar would start over) are refused
for one, naming `resume_offset` (seeds are refused already).

Item edges handled here: cumulative mode hands out SGLang's live id list (appended to after the
yield), passed through uncopied with the count read at receipt, so slicing by count is exact;
incremental mode's abort echo repeats the last id already sent and is trimmed by
`completion_tokens`; empty non-final items are dropped; usage fields may be missing (the last value
seen is kept); an abort finish becomes "error" (EngineRequestError for SGLang's 400s).
"""

from __future__ import annotations

from typing import Any

from tandem.engines.base import EngineError, EngineOutput, EngineRequest, EngineRequestError
from tandem.runtime.wire import SamplingParams, TokenLogprobs

SGLANG_TOP_K_DISABLED = -1  # SGLang's "whole vocabulary"; tandem's is 0
SGLANG_MAX_REPETITION_PENALTY = 2.0  # SGLang refuses more
# Set in the worker's environment before sglang is imported (its sampler reads it at import).
ENGINE_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def sampling_dict(sp: SamplingParams, *, deterministic: bool) -> dict[str, Any]:
    """tandem's SamplingParams as SGLang's sampling_params, or EngineRequestError naming a field
    SGLang cannot honour here."""
    if sp.min_tokens > 0:
        raise EngineRequestError("min_tokens is not supported by the sglang engine (SGLang needs "
                                 "its own tokenizer for it; tandem tokenizes)", param="min_tokens")
    if sp.seed is not None and not deterministic:
        raise EngineRequestError("seed needs the sglang engine started with "
                                 "--enable-deterministic-inference (SGLang ignores it otherwise)",
                                 param="seed")
    if sp.repetition_penalty > SGLANG_MAX_REPETITION_PENALTY:
        raise EngineRequestError("repetition_penalty must be in (0, 2] with the sglang engine",
                                 param="repetition_penalty")
    out: dict[str, Any] = {
        "max_new_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else SGLANG_TOP_K_DISABLED, "ignore_eos": sp.ignore_eos,
    }
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.seed is not None:
        out["sampling_seed"] = sp.seed
    # Neutral values are left out: SGLang's defaults are the same.
    for key in ("presence_penalty", "frequency_penalty", "min_p"):
        if getattr(sp, key):
            out[key] = getattr(sp, key)
    if sp.repetition_penalty != 1.0:
        out["repetition_penalty"] = sp.repetition_penalty
    if sp.logit_bias:
        out["logit_bias"] = {str(tok): bias for tok, bias in sp.logit_bias.items()}  # SGLang's keys
    if sp.json_schema is not None:
        out["json_schema"] = sp.json_schema
    if sp.regex is not None:
        out["regex"] = sp.regex
    return out


def check_resume(req: EngineRequest) -> None:
    """A moved request SGLang cannot continue exactly is refused, naming `resume_offset`."""
    sp = req.sampling
    if not req.resume_offset:
        return
    if sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0:
        raise EngineRequestError("the sglang engine cannot continue a moved request with "
                                 "penalties exactly (SGLang would count the tokens already "
                                 "produced as prompt)", param="resume_offset")
    if sp.json_schema is not None or sp.regex is not None:
        raise EngineRequestError("the sglang engine cannot continue a moved request with "
                                 "constrained output (its grammar would start over)",
                                 param="resume_offset")


def generate_kwargs(req: EngineRequest, srid: str, *, deterministic: bool) -> dict[str, Any]:
    """The keywords of one `Engine.async_generate` call (or EngineRequestError naming a field)."""
    check_resume(req)
    kw: dict[str, Any] = {"input_ids": list(req.prompt_ids),
                          "sampling_params": sampling_dict(req.sampling, deterministic=deterministic),
                          "stream": True, "rid": srid}
    if req.sampling.logprobs is not None:
        kw.update(return_logprob=True, top_logprobs_num=req.sampling.logprobs,
                  logprob_start_len=-1)
    if req.bootstrap is not None:
        kw.update(bootstrap_host=req.bootstrap.host, bootstrap_port=req.bootstrap.port,
                  bootstrap_room=req.bootstrap.room)
    if req.cache_salt:  # SGLang's own per-request partition of its prefix cache
        kw["cache_salt"] = req.cache_salt
    return kw


def _finish(reason: Any) -> tuple[str | None, EngineError | None]:
    """SGLang's finish_reason (None, or {type: stop|length|abort, ...}) as tandem's."""
    if reason is None:
        return None, None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind in ("stop", "length"):
        return kind, None
    message = reason.get("message", "") if isinstance(reason, dict) else ""
    status = reason.get("status_code") if isinstance(reason, dict) else None
    text = f"SGLang ended the request ({kind}): {message or 'no reason given'}"
    return "error", EngineRequestError(text) if status == 400 else EngineError(text)


class SGLangStream:
    """Turns one request's SGLang items into EngineOutputs (the state between items)."""

    __slots__ = ("rid", "incremental", "sent", "prompt_tokens", "cached_tokens", "top",
                 "logprobs")

    def __init__(self, rid: str, incremental: bool, prompt_tokens: int,
                 logprobs: int | None = None) -> None:
        self.rid = rid
        self.incremental = incremental
        self.sent = 0  # completion tokens delivered
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.top = logprobs  # None: the request asked for no logprobs
        # cumulative mode: every token's logprobs so far, converted once each (DeltaMaker slices)
        self.logprobs: list[TokenLogprobs] = []

    def convert(self, item: dict[str, Any]) -> EngineOutput | None:
        ids: list[int] = item.get("output_ids") or []
        meta: dict[str, Any] = item.get("meta_info") or {}
        finish, error = _finish(meta.get("finish_reason"))
        self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
        self.cached_tokens = meta.get("cached_tokens", self.cached_tokens)
        count = meta.get("completion_tokens")
        if self.incremental:
            if count is not None and self.sent + len(ids) > count:  # the abort echo
                keep = max(0, count - self.sent)
                ids = ids[len(ids) - keep:] if keep else []
            total = self.sent + len(ids)
        else:
            total = len(ids) if count is None else min(count, len(ids))
        if finish is None and total == self.sent:
            return None  # an empty non-final item
        lps = None if self.top is None else self._logprobs(meta, len(ids), total)
        self.sent = total
        return EngineOutput(self.rid, ids, finish, self.prompt_tokens,  # type: ignore[arg-type]
                            total, self.cached_tokens, error, lps)

    def _logprobs(self, meta: dict[str, Any], new: int, total: int) -> list[TokenLogprobs]:
        """The logprobs of this item's tokens: in incremental mode the last `new` of the item's
        (its abort echo carries them all), in cumulative mode every token's up to `total`."""
        toks: list[Any] = meta.get("output_token_logprobs") or []
        tops: list[Any] = meta.get("output_top_logprobs") or []
        if self.incremental:
            start, end, out = len(toks) - new, len(toks), []
        else:
            start, end, out = len(self.logprobs), total, self.logprobs
        if start < 0 or end > len(toks) or (self.top and end > len(tops)):
            raise EngineError(f"{self.rid}: SGLang sent logprobs for {len(toks)} tokens, "
                              f"{len(tops)} with top logprobs; {end} expected")
        for i in range(start, end):
            lp, tid = toks[i][0], toks[i][1]
            top = [(int(t[1]), float(t[0])) for t in tops[i]] if self.top else []
            out.append(TokenLogprobs(int(tid), float(lp), top))
        return out
