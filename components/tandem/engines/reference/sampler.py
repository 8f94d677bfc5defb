"""Turning one step's logits into next tokens, and the tokens' logprobs.

The logits go through, in order: min_tokens masking of stop ids, `logit_bias` (added), the
repetition penalty (over prompt and completion: a seen token's positive logit divided by it, a
negative one multiplied), the frequency and presence penalties (over the completion: subtract
`frequency x count + presence x (count > 0)`); greedy takes the argmax of that. Sampling goes on
with temperature, min_p (drop tokens whose probability is below min_p x the likeliest's), top-k,
top-p. Rows that ask for none of the penalties or the bias skip that work.

Logprobs (`token_logprobs`) are the model's own distribution: log_softmax of the raw logits, before
any of the above, taken by the caller before `sample` (which works in place). So they do not
depend on the sampling settings, and a greedy and a sampled run report the same numbers.

Random draws are keyed, not streamed: the draw for a request's completion token `position` uses a
generator seeded with `draw_seed(seed, position)`, a mix of the request's base seed and the
position. So a seeded request produces the same tokens whatever else shares its batch, and also
whichever engine draws which token: in disaggregated serving the prefill engine draws token 0 and
the decode engine tokens 1.., exactly the draws an aggregated run makes. Unseeded requests get a
random base seed. Temperature below `GREEDY_BELOW` means greedy.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.engines.sampling import adjusts_logits
from tandem.runtime.wire import SamplingParams, TokenLogprobs

GREEDY_BELOW = 1e-5
_M64 = (1 << 64) - 1
_seed_source = random.SystemRandom()


def base_seed(params: SamplingParams) -> int | None:
    """The request's base seed (None for greedy). Unseeded requests get a random one."""
    if params.temperature < GREEDY_BELOW:
        return None
    return params.seed if params.seed is not None else _seed_source.getrandbits(63)


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for completion token `position` of a request with base seed `seed`:
    63 bits, well mixed, a pure function of both (any Python int seed is accepted)."""
    return _splitmix64(_splitmix64(seed & _M64) ^ (position & _M64)) >> 1


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    seed: int | None  # base seed (sampler.base_seed); None for greedy
    position: int  # completion tokens before this one (0 for the first)
    banned: Collection[int] = ()  # ids masked out for this step (stop ids before min_tokens)
    prompt_ids: Sequence[int] = ()  # what the penalties look at (read only when one is on)
    output_ids: Sequence[int] = ()
    extras: bool = True  # False: no bias nor penalty to apply (the caller knows it cheaply)


def sample(logits: Tensor, rows: list[SampleRow]) -> list[int]:
    """logits [B, V] float32 (changed in place), one SampleRow per row -> B token ids."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        banned = [t for t in row.banned if 0 <= t < vocab]
        if banned:
            logits[i, banned] = float("-inf")
        if row.extras and adjusts_logits(row.params):
            _adjust(logits[i], row)
    out = logits.argmax(dim=-1).tolist()
    sampled = [i for i, r in enumerate(rows) if r.params.temperature >= GREEDY_BELOW]
    if not sampled:
        return out
    params = [rows[i].params for i in sampled]
    probs = _probs(logits[sampled], params)
    gen = torch.Generator(device=logits.device)
    for j, i in enumerate(sampled):
        row = rows[i]
        seed = row.seed if row.seed is not None else _seed_source.getrandbits(63)
        gen.manual_seed(draw_seed(seed, row.position))
        out[i] = int(torch.multinomial(probs[j], 1, generator=gen))
    return out


def _adjust(x: Tensor, row: SampleRow) -> None:
    """logit_bias, then the repetition, frequency and presence penalties, on one row in place."""
    p, device = row.params, x.device
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
        x.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=x.dtype,
                                          device=device))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor([*row.prompt_ids, *row.output_ids], dtype=torch.int64,
                            device=device).unique()
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
        out = torch.tensor(list(row.output_ids), dtype=torch.int64, device=device)
        counts = torch.bincount(out, minlength=x.shape[0]).to(x.dtype)
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def token_logprobs(raw: Tensor, tops: list[int], tokens: list[int]) -> list[TokenLogprobs]:
    """raw: log_softmax of the logits of the rows that asked for logprobs [R, V]; tops: how many
    alternatives each asked for; tokens: what each sampled. One TokenLogprobs per row."""
    ids = torch.tensor(tokens, dtype=torch.int64, device=raw.device)
    chosen = raw.gather(1, ids[:, None])[:, 0].tolist()
    k = max(tops)
    top_lp: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        values, indices = raw.topk(min(k, raw.shape[1]), dim=-1)
        top_lp, top_ids = values.tolist(), indices.tolist()
    return [TokenLogprobs(t, lp, list(zip(top_ids[j][:n], top_lp[j][:n])) if n else [])
            for j, (t, lp, n) in enumerate(zip(tokens, chosen, tops))]


def _probs(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Temperature, then min_p, top-k, top-p, row by row but vectorized; returns probabilities."""
    device, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    x = logits / temps[:, None]
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=x.dtype)
        probs = x.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        x = x.masked_fill(probs < floor, float("-inf"))
    if any(p.top_k > 0 for p in params):
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        kth = x.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=x.dtype)
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = sorted_x.softmax(dim=-1)
        # Drop a token when the ones ranked above it already cover top_p; the first always stays.
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    return x.softmax(dim=-1)
