"""MockEngine: the engine contract with no compute, for scale and runtime-overhead measurements.

Token ids are deterministic (a function of the prompt and the position), so two runs agree and a
test can predict them. Everything else is the shared step loop (tandem.engines.stepper): real page
accounting (pages for min(prompt + max_tokens, context) tokens taken at admission, back on
finish or cancel), a running batch capped at `max_batch`, admission that waits for pages, and the
PD handoff of tandem.engines.handoff (its transfers simulated by tandem.kv.transfer.movers.SimulatedMover).

Timing (`tandem.config.MockTiming`, the flags' own section): a step sleeps for its prefill cost
(per prompt token admitted that step) plus its decode cost (per step, and per sequence in the step), plus an optional fixed delay; with
every cost zero a step sleeps not at all and yields to the event loop once. A PD prefill worker's
sequences do not decode: its steps cost their prompt tokens only.

Sampling parameters, on a toy model: the mock's logits are NATURAL_LOGIT for its natural token
(`mock_token`) and 0 for every other id. `logit_bias` and the penalties apply to these logits with
the reference engine's math and order (bias; repetition over prompt and completion; frequency and
presence over the completion), and the mock takes the argmax, always (temperature, top-k, top-p and
min_p have no effect: the likeliest token survives every filter). Ties go to the natural token,
then to biased ids, lowest first, then to the first id after the natural one that is not an EOS id
and is not seen by an active penalty. So a bias above NATURAL_LOGIT forces its token at every
position, and a penalty can stop that repetition: with bias 11 on a token, presence_penalty 2 (or
repetition_penalty 1.2) lets it out once, frequency_penalty 0.5 twice. Stop ids held back by
min_tokens are never picked. Logprobs are the toy model's raw distribution: log_softmax of those
logits before any bias or penalty (`mock_logprobs`); the alternatives are the natural token, then
the lowest other ids.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import math
from collections.abc import Collection

from tandem.config import MockTiming, WorkerConfig
from tandem.engines.base import EngineRequest, ModelSpec
from tandem.engines.handoff import HandoffSpec
from tandem.engines.sampling import adjusts_logits
from tandem.engines.scheduler import Batch, Scheduler, Sequence
from tandem.engines.grammars import refuse
from tandem.engines.stepper import Stepper
from tandem.engines.pages import page_bytes
from tandem.runtime.wire import OutputMode, TokenLogprobs

UNLIMITED_PREFILL_TOKENS = 1 << 62  # the mock admits every prompt that fits, as it always has
NATURAL_LOGIT = 10.0  # the toy model's logit for the mock's token; every other id has 0


def mock_seed(prompt_ids: list[int]) -> int:
    """What the mock's ids for this prompt depend on (computed once per request)."""
    return ((sum(prompt_ids) * 1_000_003 + len(prompt_ids)) & 0xFFFFFFFF) + 13


def mock_token(prompt_ids: list[int], position: int, vocab: int, avoid: frozenset[int],
               seed: int | None = None) -> int:
    """The id the mock engine emits at `position` for this prompt (stable across processes);
    `seed`: mock_seed(prompt_ids), when the caller has it."""
    tok = ((mock_seed(prompt_ids) if seed is None else seed) + position * 7919) % vocab
    while tok in avoid:
        tok = (tok + 1) % vocab
    return tok


def mock_adjusted(natural: int, seq: Sequence, vocab: int, avoid: frozenset[int],
                  banned: Collection[int]) -> int:
    """The mock's pick once `seq`'s logit_bias and penalties apply to its toy logits."""
    p = seq.sampling
    scores = {natural: NATURAL_LOGIT}
    for tok, bias in sorted((p.logit_bias or {}).items()):
        scores[tok] = scores.get(tok, 0.0) + bias
    counts: dict[int, int] = {}
    if p.frequency_penalty or p.presence_penalty:
        for tok in seq.all_output:
            counts[tok] = counts.get(tok, 0) + 1
    seen = set(seq.origin_prompt).union(seq.all_output) if p.repetition_penalty != 1.0 else set()
    fallback = next((t for t in ((natural + j) % vocab for j in range(1, vocab))
                     if t not in scores and t not in avoid and t not in banned
                     and t not in counts and t not in seen), natural)
    scores.setdefault(fallback, 0.0)
    best, best_score = natural, -math.inf
    for tok, x in scores.items():  # natural first, then biased ids by id, then the fallback
        if tok in banned:
            continue
        if tok in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        n = counts.get(tok, 0)
        x -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
        if x > best_score:
            best, best_score = tok, x
    return best


def mock_logprobs(natural: int, token: int, top: int, vocab: int) -> TokenLogprobs:
    """The toy model's raw logprobs at a position whose natural token is `natural`."""
    log_z = NATURAL_LOGIT + math.log1p((vocab - 1) * math.exp(-NATURAL_LOGIT))
    low = -log_z  # every id but the natural one
    alts = [(natural, NATURAL_LOGIT - log_z)] if top else []
    alts += [(t, low) for t in range(top + 1) if t != natural][: max(0, top - 1)]
    return TokenLogprobs(token, NATURAL_LOGIT - log_z if token == natural else low, alts)


def read_model_config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg: dict[str, Any] = json.load(f)
    return cfg


def spec_from_config(model_dir: str, cfg: dict[str, Any]) -> ModelSpec:
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelSpec(
        name=os.path.basename(os.path.normpath(model_dir)),
        max_context=int(cfg.get("max_position_embeddings", 2048)),
        eos_token_ids=eos_ids,
        vocab_size=int(cfg["vocab_size"]),
    )


class ModelledCopies:
    """The mock's host tier copier: no bytes, the time its copies would take at the modelled
    rates (`--mock-d2h-bytes-per-s`, `--mock-h2d-bytes-per-s`), owed by the next step."""

    def __init__(self, page_bytes: int, timing: MockTiming) -> None:
        self.page_bytes = page_bytes
        self.d2h, self.h2d = timing.mock_d2h_bytes_per_s, timing.mock_h2d_bytes_per_s
        self._owed = 0.0

    def save(self, pages: Collection[int], slots: Collection[int]) -> None:
        if self.d2h:
            self._owed += len(pages) * self.page_bytes / self.d2h

    def load(self, slots: Collection[int], pages: Collection[int]) -> float:
        took = len(pages) * self.page_bytes / self.h2d if self.h2d else 0.0
        self._owed += took
        return took

    def owed(self) -> float:
        """The copies' seconds since the last call (the step that calls sleeps them)."""
        owed, self._owed = self._owed, 0.0
        return owed


class MockEngine(Stepper):
    name = "mock"

    def __init__(self, model_dir: str, *, page_size: int = WorkerConfig.page_size,
                 num_pages: int = WorkerConfig.num_pages, max_batch: int = WorkerConfig.max_batch,
                 output_mode: OutputMode | None = None, timing: MockTiming = MockTiming(),
                 handoff: HandoffSpec | None = None,
                 prefix_cache: bool = WorkerConfig.prefix_cache,
                 check_pages: bool = WorkerConfig.check_kv, max_prefill_tokens: int = 0,
                 host_pages: int = WorkerConfig.host_kv_pages) -> None:
        cfg = read_model_config(model_dir)
        self.spec = spec_from_config(model_dir, cfg)
        heads = int(cfg.get("num_attention_heads", 8))
        head_dim = int(cfg.get("head_dim", int(cfg.get("hidden_size", 512)) // heads))
        # What one page would take in the reference engine's layout (float32).
        self.page_bytes = page_bytes(int(cfg.get("num_hidden_layers", 2)), page_size,
                                     int(cfg.get("num_key_value_heads", heads)), head_dim, 4)
        num_pages = num_pages or max(1, (max_batch * self.spec.max_context) // page_size)
        super().__init__(page_size=page_size, num_pages=num_pages, max_batch=max_batch,
                         output_mode=output_mode,
                         max_prefill_tokens=max_prefill_tokens or UNLIMITED_PREFILL_TOKENS,
                         handoff=handoff, prefix_cache=prefix_cache, check_pages=check_pages,
                         host_pages=host_pages)
        self.timing = timing
        self._copies = ModelledCopies(self.page_bytes, timing)
        if self.pool.host is not None:
            self.pool.host.copier = self._copies
            self.pool.host.compute_s_per_token = timing.mock_prefill_us_per_token / 1e6
        self._avoid = frozenset(self.spec.eos_token_ids)

    def new_sequence(self, req: EngineRequest, pd: str) -> Sequence:
        seq = super().new_sequence(req, pd)
        seq.memo = mock_seed(seq.origin_prompt)
        return seq

    def constraint(self, req: EngineRequest) -> None:
        refuse(req.sampling, self.name, ": it produces no real text")

    async def run(self, batch: Batch) -> list[int]:
        num_prompt_tokens = Scheduler.prefill_tokens(batch)
        # A PD prefill worker's sequences only compute their prompt (and sample the first token
        # with it): no decode step. Aggregated, a sequence whose prompt (or its last chunk) is
        # prefilled now decodes in this step.
        prefill = batch.prefill
        num_decoding = len(batch.decode) + (
            sum(1 for s in prefill if s.pd != "prefill" and Scheduler.samples(s))
            if prefill else 0)
        cost = self.timing.step_cost(num_prompt_tokens, num_decoding) + self._copies.owed()
        # The step's tokens come out when its compute would have finished (sleep(0): a yield).
        await asyncio.sleep(cost)
        vocab, avoid = self.spec.vocab_size, self._avoid
        seqs = batch.all()
        # (a sequence's memo is its seed: mock_seed of its original prompt)
        tokens = [mock_token(s.prompt_ids, s.position, vocab, avoid, s.memo) for s in seqs]
        extras = [i for i, s in enumerate(seqs) if s.extras]
        if extras:
            self._extras(batch, seqs, tokens, extras)
        return tokens

    def _extras(self, batch: Batch, seqs: list[Sequence], tokens: list[int],
                extras: list[int]) -> None:
        """Bias and penalties, then logprobs, for the sequences that ask (in place)."""
        vocab, natural = self.spec.vocab_size, list(tokens)
        for i in extras:
            seq = seqs[i]
            if adjusts_logits(seq.sampling):
                tokens[i] = mock_adjusted(natural[i], seq, vocab, self._avoid, seq.banned_ids())
            if seq.logprobs is not None:
                if batch.logprobs is None:
                    batch.logprobs = [None] * len(seqs)
                batch.logprobs[i] = mock_logprobs(natural[i], tokens[i],
                                                  seq.sampling.logprobs or 0, vocab)
