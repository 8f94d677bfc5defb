"""Turning one step's logits into next tokens: greedy, or temperature / top-k / top-p sampling,
with min_tokens masking of stop ids.

Random draws are keyed, not streamed: the draw for a request's completion token `position` uses a
generator seeded with `draw_seed(seed, position)`, a mix of the request's base seed and the
position. So a seeded request produces the same tokens whatever else shares its batch, and also
whichever engine draws which token: in disaggregated serving the prefill engine draws token 0 and
the decode engine tokens 1.., exactly the draws an aggregated run makes. Unseeded requests get a
random base seed. Temperature below `GREEDY_BELOW` means greedy.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.runtime.wire import SamplingParams

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


def sample(logits: Tensor, rows: list[SampleRow]) -> list[int]:
    """logits [B, V] float32, one SampleRow per row -> B token ids."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        banned = [t for t in row.banned if 0 <= t < vocab]
        if banned:
            logits[i, banned] = float("-inf")
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


def _probs(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Temperature, then top-k, then top-p, row by row but vectorized; returns probabilities."""
    device, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    x = logits / temps[:, None]
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
