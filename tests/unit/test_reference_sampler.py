"""The sampler's draws are keyed by (seed, position): a draw does not depend on the batch, nor on
which draws came before it, so a decode engine can continue a prefill engine's sampling exactly.
The logit processing (bias, repetition / frequency / presence penalties, min_p) is checked number
by number, and logprobs are the raw log_softmax."""

from __future__ import annotations

import pytest
import torch

from tandem.engines.reference.sampler import (
    SampleRow, base_seed, draw_seed, sample, token_logprobs,
)
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


# --- penalties, bias, min_p, logprobs ---------------------------------------------------------------

def greedy_row(prompt: tuple[int, ...] | list[int] = (), output: tuple[int, ...] | list[int] = (),
               **params: object) -> SampleRow:
    sp = SamplingParams(temperature=0.0, **params)  # type: ignore[arg-type]
    return SampleRow(sp, None, len(output), (), list(prompt), list(output))


def test_logit_bias_is_added_to_the_logits() -> None:
    logits = torch.tensor([[1.0, 5.0, 2.0, 0.0]])
    assert sample(logits.clone(), [greedy_row()]) == [1]
    assert sample(logits.clone(), [greedy_row(logit_bias={3: 5.5})]) == [3]  # 0 + 5.5 > 5
    assert sample(logits.clone(), [greedy_row(logit_bias={3: 4.5})]) == [1]
    assert sample(logits.clone(), [greedy_row(logit_bias={1: -100.0})]) == [2]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[3.0, 2.0, -1.0, -1.5]])
    row = greedy_row(prompt=[0], output=[2], repetition_penalty=2.0)
    x = logits.clone()
    assert sample(x, [row]) == [1]  # 3 / 2 = 1.5 < 2
    assert x[0].tolist() == [1.5, 2.0, -2.0, -1.5]  # only seen ids (prompt and output) change


def test_frequency_and_presence_penalties_count_completion_tokens_only() -> None:
    logits = torch.tensor([[4.0, 3.0, 0.0]])
    x = logits.clone()
    sample(x, [greedy_row(prompt=[1, 1, 1], output=[0, 0, 2], frequency_penalty=0.5,
                          presence_penalty=1.0)])
    assert x[0].tolist() == [4.0 - 2 * 0.5 - 1.0, 3.0, 0.0 - 0.5 - 1.0]
    # A negative presence penalty favours what was said already.
    assert sample(logits.clone(), [greedy_row(output=[1], presence_penalty=-2.0)]) == [1]


def test_min_p_keeps_only_tokens_near_the_likeliest() -> None:
    logits = torch.tensor([[2.0, 1.9, -3.0, -3.0]])
    sp = SamplingParams(temperature=1.0, min_p=0.5)
    draws = {sample(logits.clone(), [SampleRow(sp, 7, pos)])[0] for pos in range(200)}
    assert draws == {0, 1}  # exp(-5) of the top is far below half of it
    only_top = SamplingParams(temperature=1.0, min_p=1.0)
    assert {sample(logits.clone(), [SampleRow(only_top, 7, p)])[0] for p in range(50)} == {0}


def test_token_logprobs_are_the_raw_log_softmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    raw = logits.log_softmax(dim=-1)
    out = token_logprobs(raw, [0, 3, 5], [4, 7, int(logits[2].argmax())])
    assert [o.token_id for o in out] == [4, 7, int(logits[2].argmax())]
    for row, o in enumerate(out):
        assert o.logprob == pytest.approx(float(raw[row, o.token_id]), abs=1e-6)
    assert out[0].top == []
    values, ids = raw[1].topk(3)
    assert [t for t, _ in out[1].top] == ids.tolist()
    assert [v for _, v in out[1].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert len(out[2].top) == 5 and out[2].top[0][0] == out[2].token_id
    assert out[2].top[0][1] == pytest.approx(out[2].logprob)
