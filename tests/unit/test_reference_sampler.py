"""The sampler's draws are keyed by (seed, position): a draw does not depend on the batch, nor on
which draws came before it, so a decode engine can continue a prefill engine's sampling exactly."""

from __future__ import annotations

import torch

from tandem.engines.reference.sampler import SampleRow, base_seed, draw_seed, sample
from tandem.runtime.wire import SamplingParams


def test_draw_seed_is_a_pure_mix() -> None:
    seeds = {draw_seed(s, p) for s in (0, 1, 2, -1, (1 << 64) + 3) for p in range(50)}
    assert len(seeds) == 250 and all(0 <= x < 1 << 63 for x in seeds)
    assert draw_seed(7, 3) == draw_seed(7, 3)


def test_draws_depend_on_seed_and_position_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    sp = SamplingParams(temperature=0.8, seed=11)
    rows = [SampleRow(sp, 11, pos) for pos in range(6)]
    batched = sample(logits.clone(), rows)
    alone = [sample(logits[i : i + 1].clone(), [rows[i]])[0] for i in reversed(range(6))]
    assert batched == alone[::-1]
    greedy = SampleRow(SamplingParams(temperature=0.0), None, 0)
    mixed = sample(logits[[0, 3]].clone(), [greedy, rows[3]])
    assert mixed == [int(logits[0].argmax()), batched[3]]
    # Another seed or position draws differently (over many positions, surely somewhere).
    flat = torch.zeros(1, 300)
    a = [sample(flat.clone(), [SampleRow(sp, 11, p)])[0] for p in range(20)]
    b = [sample(flat.clone(), [SampleRow(sp, 12, p)])[0] for p in range(20)]
    assert a != b and len(set(a)) > 10


def test_base_seed() -> None:
    assert base_seed(SamplingParams(temperature=0.0, seed=5)) is None
    assert base_seed(SamplingParams(temperature=0.5, seed=5)) == 5
    assert base_seed(SamplingParams(temperature=0.5)) != base_seed(SamplingParams(temperature=0.5))
