"""On a CUDA GPU: the reference model and sampler compute on CUDA what they compute on the CPU.

The paged prefill and decode on CUDA against the CPU's cache-free forward (float32, TF32 off, as
the engine runs), and the sampler's logit adjustments, logprobs and seeded draws, which are what
make a prefill worker's first token and a decode worker's later ones the tokens an aggregated run
samples. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tandem.engines.reference.model import Llama, page_table
from tandem.engines.reference.sampler import SampleRow, sample, token_logprobs
from tandem.runtime.wire import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[0, 17], [0, 5, 100, 200, 7, 900, 33, 44, 1000, 12, 13], [0, *range(300, 337)]]
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def models(tiny_model: str) -> tuple[Llama, Llama]:
    return Llama.from_checkpoint(tiny_model), Llama.from_checkpoint(tiny_model, device="cuda:0")


def test_tf32_is_off_for_matmuls() -> None:
    assert not torch.backends.cuda.matmul.allow_tf32  # the tolerances below assume full float32


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_cuda_prefill_and_decode_match_the_cpu(models: tuple[Llama, Llama],
                                                     page_size: int) -> None:
    cpu, gpu = models
    dev = torch.device("cuda:0")
    kv = gpu.new_kv_cache(num_pages=64, page_size=page_size)
    assert kv.is_cuda
    full = [cpu.forward_full(torch.tensor(p)) for p in PROMPTS]
    free = list(range(63, -1, -1))
    pages = [[free.pop(3 * (i % 2)) for i in range(-(-len(p) // page_size))] for p in PROMPTS]
    pos = []
    for i, p in enumerate(PROMPTS):
        n = max(1, len(p) - 3)
        last = gpu.prefill(kv, torch.tensor(p[:n], device=dev),
                           torch.tensor(pages[i], device=dev))
        torch.testing.assert_close(last.cpu(), full[i][n - 1], **TOL)
        pos.append(n)
    while live := [i for i, p in enumerate(PROMPTS) if pos[i] < len(p)]:
        toks = torch.tensor([PROMPTS[i][pos[i]] for i in live], device=dev)
        positions = torch.tensor([pos[i] for i in live], device=dev)
        table = page_table([pages[i][: pos[i] // page_size + 1] for i in live], dev)
        logits = gpu.decode(kv, toks, positions, table).cpu()
        for row, i in enumerate(live):
            torch.testing.assert_close(logits[row], full[i][pos[i]], **TOL)
            pos[i] += 1


def _rows(params: list[SamplingParams], seeds: list[int | None]) -> list[SampleRow]:
    return [SampleRow(p, s, position=3, prompt_ids=[1, 2, 3, 9], output_ids=[9, 9, 4])
            for p, s in zip(params, seeds, strict=True)]


def test_greedy_adjustments_pick_the_same_tokens(models: tuple[Llama, Llama]) -> None:
    cpu, _ = models
    logits = cpu.forward_full(torch.tensor(PROMPTS[1]))[-4:]  # 4 rows, bit-identical inputs
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0,
                       presence_penalty=0.5),
        SamplingParams(temperature=0.0, logit_bias={7: -100.0, 11: 30.0}),
    ]
    rows = _rows(params, [None] * 4)
    on_cpu = sample(logits.clone(), rows)
    on_gpu = sample(logits.clone().cuda(), rows)
    assert on_gpu == on_cpu and on_cpu[1] == 5


def test_seeded_draws_do_not_depend_on_the_batch(models: tuple[Llama, Llama]) -> None:
    """The same (seed, position) draws the same token in any batch, in any row."""
    cpu, _ = models
    logits = cpu.forward_full(torch.tensor(PROMPTS[2]))[-3:].cuda()
    params = [SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=1.3, top_k=20, min_p=0.02, seed=2),
              SamplingParams(temperature=0.7, top_p=0.8, seed=3)]
    seeds = [11, 22, 33]
    together = sample(logits.clone(), _rows(params, seeds))
    backwards = sample(logits.flip(0).clone(), _rows(params[::-1], seeds[::-1]))
    alone = [sample(logits[i : i + 1].clone(), _rows([params[i]], [seeds[i]]))[0]
             for i in range(3)]
    assert together == backwards[::-1] == alone


def test_logprobs_on_cuda_match_the_cpu(models: tuple[Llama, Llama]) -> None:
    cpu, _ = models
    raw = cpu.forward_full(torch.tensor(PROMPTS[0])).log_softmax(dim=-1)
    tokens = raw.argmax(dim=-1).tolist()
    want = token_logprobs(raw, [5, 0], tokens)
    got = token_logprobs(raw.cuda(), [5, 0], tokens)
    for w, g in zip(want, got, strict=True):
        assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-5
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
