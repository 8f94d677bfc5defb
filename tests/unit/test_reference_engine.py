"""ReferenceEngine behaviour a user would notice: the same tokens alone or batched, sampling that
reproduces with a seed, every finish reason, both output modes, and every page back in the pool
after every scenario (normal end, cancel mid-stream or while waiting or while its step computes,
refusal, a failing step). Steps are held or failed through the public `compute_hook`."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.engines.base import EngineError, EngineOutput, EngineRequestError
from tandem.engines.reference import ReferenceEngine, write_tiny_model
from tandem.engines.reference.engine import Compute, ComputeHook
from tandem.engines.scheduler import Batch
from tandem.runtime.wire import SamplingParams
from tests.conformance.harness import Recorder, Run, finished, generate, wait_idle

GREEDY = {"temperature": 0.0}
PROMPT = [0, 5, 100, 200, 7, 900]
OTHERS = [[0, 17], [0, *range(300, 341)], [3, 2, 1, 4, 1023, 8, 9]]

MakeEngine = Callable[..., Awaitable[ReferenceEngine]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path, seed=0)
    return path


@pytest.fixture
async def make_engine(model_dir: Path) -> AsyncIterator[MakeEngine]:
    engines: list[ReferenceEngine] = []

    async def make(path: Path | None = None, **kw: Any) -> ReferenceEngine:
        kw.setdefault("page_size", 4)
        kw.setdefault("max_batch", 16)
        engine = ReferenceEngine(path or model_dir, **kw)
        engines.append(engine)
        await engine.start()
        return engine

    yield make
    for engine in engines:
        await wait_idle(engine)
        await engine.shutdown()


@pytest.fixture
async def engine(make_engine: MakeEngine) -> ReferenceEngine:
    return await make_engine()


async def run(engine: ReferenceEngine, rid: str, prompt: list[int], **sampling: Any) -> Run:
    return await generate(engine, rid, list(prompt), **sampling)


async def tokens(
    engine: ReferenceEngine, prompt: list[int], rid: str = "r", **sampling: Any
) -> list[int]:
    r = await run(engine, rid, prompt, **sampling)
    assert r.finish is not None and r.error is None
    return r.ids


def start(engine: ReferenceEngine, rid: str, prompt: list[int], sink: Recorder | None = None,
          **sampling: Any) -> Run:
    return (sink or Recorder(engine)).submit(engine, rid, prompt, SamplingParams(**sampling))


def test_engine_attributes(model_dir: Path) -> None:
    e = ReferenceEngine(model_dir, page_size=8, num_pages=100, output_mode="incremental")
    assert (e.name, e.page_size, e.num_pages, e.output_mode) == ("reference", 8, 100, "incremental")
    assert e.spec.name == model_dir.name and e.spec.max_context == 2048
    assert e.spec.eos_token_ids == (1, 3) and e.spec.vocab_size == 1024
    assert e.pool.num_pages == 100 and e.load().pages_total == 100


async def test_greedy_same_alone_batched_and_across_runs(engine: ReferenceEngine) -> None:
    alone = await tokens(engine, PROMPT, max_tokens=24, **GREEDY)
    assert len(alone) == 24 and len(set(alone)) > 5
    assert await tokens(engine, PROMPT, max_tokens=24, **GREEDY) == alone
    others = [tokens(engine, p, rid=f"o{i}", max_tokens=30, **GREEDY) for i, p in enumerate(OTHERS)]
    batched = await asyncio.gather(tokens(engine, PROMPT, max_tokens=24, **GREEDY), *others)
    assert batched[0] == alone
    for i, p in enumerate(OTHERS):  # and each of the others matches its own solo run
        assert await tokens(engine, p, max_tokens=30, **GREEDY) == batched[i + 1]


async def test_seeded_sampling_reproducible(engine: ReferenceEngine) -> None:
    params = {"max_tokens": 20, "temperature": 1.0, "seed": 42, "ignore_eos": True}
    alone = await tokens(engine, PROMPT, **params)
    others = [tokens(engine, p, rid=f"o{i}", max_tokens=20, temperature=0.8, seed=i)
              for i, p in enumerate(OTHERS)]
    batched = await asyncio.gather(tokens(engine, PROMPT, **params), *others)
    assert batched[0] == alone
    assert await tokens(engine, PROMPT, **{**params, "seed": 43}) != alone
    greedy = await tokens(engine, PROMPT, max_tokens=20, ignore_eos=True, **GREEDY)
    assert alone != greedy
    # top_k=1 is greedy whatever the seed and temperature
    assert await tokens(engine, PROMPT, **{**params, "top_k": 1}) == greedy
    assert await tokens(engine, PROMPT, **{**params, "top_p": 1e-6, "seed": 7}) == greedy
    filtered = await tokens(engine, PROMPT, **{**params, "top_k": 5, "top_p": 0.9})
    assert len(filtered) == 20


async def test_max_tokens_finishes_with_length(engine: ReferenceEngine) -> None:
    r = await run(engine, "r", PROMPT, max_tokens=7, ignore_eos=True, **GREEDY)
    assert [o[1] for o in r.outputs] == [None] * 6 + ["length"]
    ids, _, n = r.outputs[-1]
    assert engine.output_mode == "incremental"  # the default: each output carries its new id
    assert (n, len(ids), len(r.ids)) == (7, 1, 7)


async def test_context_end_finishes_with_length(make_engine: MakeEngine, tmp_path: Path,
                                                model_dir: Path) -> None:
    small = tmp_path / "small"
    shutil.copytree(model_dir, small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["max_position_embeddings"] = 12
    (small / "config.json").write_text(json.dumps(cfg))
    engine = await make_engine(small)
    r = await run(engine, "r", PROMPT, max_tokens=50, ignore_eos=True, **GREEDY)
    assert r.finish == "length" and len(r.ids) == 6
    with pytest.raises(EngineRequestError):
        start(engine, "long", list(range(12)), max_tokens=1)


async def test_stop_token_ids(engine: ReferenceEngine) -> None:
    free_run = await tokens(engine, PROMPT, max_tokens=12, ignore_eos=True, **GREEDY)
    stop = free_run[4]
    cut = free_run.index(stop)
    r = await run(engine, "r", PROMPT, max_tokens=12, stop_token_ids=(stop,), **GREEDY)
    assert r.finish == "stop"
    assert r.ids == free_run[: cut + 1]  # the stop id itself is the last output


async def test_min_tokens_holds_back_stop_ids(engine: ReferenceEngine) -> None:
    first = (await tokens(engine, PROMPT, max_tokens=1, **GREEDY))[0]
    assert await tokens(engine, PROMPT, max_tokens=8, stop_token_ids=(first,), **GREEDY) == [first]
    out = await tokens(engine, PROMPT, max_tokens=8, stop_token_ids=(first,), min_tokens=3,
                       **GREEDY)
    assert first not in out[:3] and len(out) >= 4


async def test_eos_and_ignore_eos(make_engine: MakeEngine, tmp_path: Path, model_dir: Path,
                                  engine: ReferenceEngine) -> None:
    first = (await tokens(engine, PROMPT, max_tokens=1, **GREEDY))[0]
    eos_dir = tmp_path / "eos"  # the same model, with the greedy first token made an EOS id
    shutil.copytree(model_dir, eos_dir)
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3, first]}))
    eos_engine = await make_engine(eos_dir)
    assert first in eos_engine.spec.eos_token_ids
    r = await run(eos_engine, "a", PROMPT, max_tokens=8, **GREEDY)
    assert r.finish == "stop" and r.ids == [first]
    r = await run(eos_engine, "b", PROMPT, max_tokens=8, ignore_eos=True, **GREEDY)
    assert r.finish == "length" and len(r.ids) == 8
    late = await tokens(eos_engine, PROMPT, max_tokens=8, min_tokens=2, **GREEDY)
    assert first not in late[:2]


async def test_cumulative_and_incremental_give_the_same_tokens(make_engine: MakeEngine) -> None:
    cum = await make_engine(output_mode="cumulative")
    inc = await make_engine(output_mode="incremental")
    params = {"max_tokens": 15, "temperature": 0.7, "seed": 5, "ignore_eos": True}
    cum_run = await run(cum, "c", PROMPT, **params)
    inc_run = await run(inc, "i", PROMPT, **params)
    joined: list[int] = []
    for ids, _, n in inc_run.outputs:
        assert n == len(joined) + len(ids)  # offset + len == count
        joined += ids
    prev: list[int] = []
    for ids, _, n in cum_run.outputs:
        assert ids[: len(prev)] == prev and n == len(ids)
        prev = ids
    assert joined == prev == cum_run.ids == inc_run.ids and len(joined) == 15


async def test_cumulative_outputs_share_one_growing_list(make_engine: MakeEngine) -> None:
    # No copy of the whole id list per token: every output of a request hands out the same list.
    engine = await make_engine(output_mode="cumulative")
    seen: list[list[int]] = []

    class Keep(Recorder):
        def on_step(self, outputs: list[EngineOutput]) -> None:
            seen.extend(o.output_ids for o in outputs)
            super().on_step(outputs)

    r = await finished(start(engine, "r", PROMPT, Keep(engine), max_tokens=20, ignore_eos=True))
    assert len(seen) == 20 and all(ids is seen[0] for ids in seen) and seen[0] == r.ids


# The cancel and shutdown tests act from the sink (Run.on_output) at a known output, not after a
# sleep: what a sleep lets happen depends on the machine's load.
async def test_cancel_mid_stream_frees_pages(engine: ReferenceEngine) -> None:
    r = start(engine, "r", PROMPT, max_tokens=500, **GREEDY)
    held: list[tuple[int, bool]] = []
    cancelled = asyncio.Event()

    def cancel_at_the_third(run: Run) -> None:  # 497 tokens to go
        if len(run.outputs) == 3:
            load = engine.load()
            held.append((load.running, load.pages_free < load.pages_total))
            assert run.handle is not None
            run.handle.cancel()
            cancelled.set()

    r.on_output = cancel_at_the_third
    await asyncio.wait_for(cancelled.wait(), 30)
    await wait_idle(engine)
    assert held == [(1, True)]
    assert len(r.outputs) == 3 and r.finish is None  # (steps computed ahead are dropped)


async def test_cancel_ends_running_and_waiting_requests(make_engine: MakeEngine) -> None:
    # Pages for one request at a time, so the second one waits.
    engine = await make_engine(num_pages=130, max_batch=4)  # one request takes 127 pages
    sink = Recorder(engine)
    params: dict[str, Any] = {"max_tokens": 500, "ignore_eos": True, **GREEDY}
    first = start(engine, "a", PROMPT, sink, **params)
    second = start(engine, "b", PROMPT, sink, **params)
    waiting: list[int] = []
    cancelled = asyncio.Event()

    def cancel_both(run: Run) -> None:  # a few steps in, 497 to go: `second` still waits
        if len(run.outputs) == 3:
            assert first.handle is not None and second.handle is not None
            waiting.append(engine.load().waiting)
            second.handle.cancel()
            waiting.append(engine.load().waiting)
            first.handle.cancel()
            first.handle.cancel()  # twice is harmless
            cancelled.set()

    first.on_output = cancel_both
    await asyncio.wait_for(cancelled.wait(), 30)
    await wait_idle(engine)
    assert waiting == [1, 0]
    assert len(first.outputs) == 3 and first.finish is None and not second.outputs


async def test_refused_requests(make_engine: MakeEngine) -> None:
    engine = await make_engine(num_pages=8)  # 32 tokens of KV in all
    bad = [
        ([], {}),
        (list(range(2048)), {}),  # prompt fills the whole context
        ([0, 5000], {}),  # token id outside the vocabulary
        (PROMPT, {"max_tokens": 100}),  # more pages than the pool has
        (PROMPT, {"max_tokens": 0}),
        (PROMPT, {"top_p": 0.0}),
        (PROMPT, {"temperature": -1.0}),
    ]
    sink = Recorder(engine)
    for prompt, params in bad:
        with pytest.raises(EngineRequestError):
            start(engine, f"x{len(sink.runs)}", prompt, sink, **params)
    assert sink.calls == 0
    assert await tokens(engine, PROMPT, max_tokens=20, **GREEDY)  # still serves what fits


async def test_one_delivery_per_step_and_loop_stays_responsive(engine: ReferenceEngine) -> None:
    compute_threads: set[int] = set()
    ticked = threading.Event()  # set by the loop's ticker
    ticked_during_a_step: list[bool] = []

    def hook(batch: Batch, compute: Compute) -> list[int]:
        compute_threads.add(threading.get_ident())
        if len(ticked_during_a_step) < 10:  # the loop must go on while a step is in compute:
            ticked.clear()  # held here, the step waits for a tick (a loop that computed the
            ticked_during_a_step.append(ticked.wait(10))  # step itself could not tick)
        return compute(batch)

    engine.compute_hook = hook
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticked.set()
            await asyncio.sleep(0.001)

    tick = asyncio.create_task(ticker())
    prompts = [PROMPT, *OTHERS, [0, 9, 8], [0, 77, 300, 12]]
    sink = Recorder(engine)
    params: dict[str, Any] = {"max_tokens": 120, "ignore_eos": True, **GREEDY}
    runs = [start(engine, f"r{i}", p, sink, **params) for i, p in enumerate(prompts)]
    for r in runs:
        await finished(r)
    done.set()
    await tick
    assert all(len(r.ids) == 120 for r in runs)
    assert sink.calls < 120 + 2 * len(prompts)  # batched per step, not one call per token
    assert ticked_during_a_step == [True] * 10
    assert compute_threads and threading.get_ident() not in compute_threads
    assert sink.threads == {threading.get_ident()}  # outputs arrive on the loop


async def test_shutdown_ends_requests_and_is_idempotent(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    r = start(engine, "r", PROMPT, max_tokens=2000, **GREEDY)
    started = asyncio.Event()
    r.on_output = lambda _: started.set()
    await started.wait()  # 1999 tokens to go
    await engine.shutdown()
    assert r.finish == "abort"
    await engine.shutdown()
    with pytest.raises(EngineError):
        start(engine, "late", PROMPT)
    never_started = ReferenceEngine(engine.model_dir)
    await never_started.shutdown()
    await never_started.shutdown()


def held(entered: threading.Event, gate: threading.Event) -> ComputeHook:
    def hook(batch: Batch, compute: Compute) -> list[int]:
        entered.set()
        gate.wait(5)
        return compute(batch)

    return hook


async def test_cancel_while_step_computes_frees_after_the_step(engine: ReferenceEngine) -> None:
    gate, entered = threading.Event(), threading.Event()
    engine.compute_hook = held(entered, gate)
    r = start(engine, "r", PROMPT, max_tokens=50, **GREEDY)
    await asyncio.to_thread(entered.wait, 5)
    assert r.handle is not None
    r.handle.cancel()  # its pages are being written now: held until the step ends
    assert engine.pool.num_free < engine.num_pages
    gate.set()
    engine.compute_hook = None
    await wait_idle(engine)
    assert r.outputs == []  # nothing after the cancel


async def test_failing_step_fails_its_requests_only(engine: ReferenceEngine) -> None:
    def fail(batch: Batch, compute: Compute) -> list[int]:
        raise ZeroDivisionError("division by zero")

    engine.compute_hook = fail
    r = await run(engine, "r", PROMPT, max_tokens=5)
    assert r.finish == "error" and r.error is not None
    assert isinstance(r.error, EngineError) and "ZeroDivisionError" in str(r.error)
    await wait_idle(engine)
    engine.compute_hook = None
    assert len(await tokens(engine, PROMPT, max_tokens=5, ignore_eos=True)) == 5


# --- sampling parameters and logprobs -------------------------------------------------------------

REPEATS = [0, 17]  # greedy falls into a two-token loop on this prompt


def most_repeated(ids: list[int]) -> int:
    return max(ids.count(t) for t in ids)


async def test_a_large_logit_bias_makes_its_token_the_output(engine: ReferenceEngine) -> None:
    out = await tokens(engine, PROMPT, max_tokens=8, logit_bias={42: 100.0}, ignore_eos=True,
                       **GREEDY)
    assert out == [42] * 8
    plain = await tokens(engine, PROMPT, max_tokens=8, ignore_eos=True, **GREEDY)
    banned = await tokens(engine, PROMPT, max_tokens=8, ignore_eos=True,
                          logit_bias={plain[0]: -100.0}, **GREEDY)
    assert banned[0] != plain[0]


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"repetition_penalty": 1.5}])
async def test_a_strong_penalty_stops_the_repetition_greedy_falls_into(
        engine: ReferenceEngine, penalty: dict[str, float]) -> None:
    greedy = await tokens(engine, REPEATS, max_tokens=24, ignore_eos=True, **GREEDY)
    assert most_repeated(greedy) >= 4
    penalized = await tokens(engine, REPEATS, max_tokens=24, ignore_eos=True, **penalty, **GREEDY)
    assert penalized != greedy and most_repeated(penalized) <= 2


async def test_min_p_one_samples_only_the_likeliest(engine: ReferenceEngine) -> None:
    greedy = await tokens(engine, PROMPT, max_tokens=12, ignore_eos=True, **GREEDY)
    sampled = await tokens(engine, PROMPT, max_tokens=12, ignore_eos=True, temperature=1.5,
                           seed=3)
    assert sampled != greedy
    assert await tokens(engine, PROMPT, max_tokens=12, ignore_eos=True, temperature=1.5, seed=3,
                        min_p=1.0) == greedy


def check_logprobs(model: Any, prompt: list[int], r: Run, k: int) -> None:
    """Each token's logprobs are the log_softmax of the model's logits at its position."""
    import torch

    logits = model.forward_full(torch.tensor(prompt + r.ids[:-1]))[len(prompt) - 1:]
    raw = logits.log_softmax(dim=-1)
    assert [lp.token_id for lp in r.logprobs] == r.ids
    for pos, lp in enumerate(r.logprobs):
        assert lp.logprob == pytest.approx(float(raw[pos, lp.token_id]), abs=1e-4)
        values, ids = raw[pos].topk(k)
        assert len(lp.top) == k
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
        for (tok, _), want in zip(lp.top, ids.tolist()):  # the same ids, up to near-ties
            assert tok == want or abs(float(raw[pos, tok]) - float(raw[pos, want])) < 1e-4


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
async def test_logprobs_are_the_models_log_softmax(make_engine: MakeEngine, model_dir: Path,
                                                   mode: str) -> None:
    from tandem.engines.reference.model import Llama

    engine = await make_engine(output_mode=mode)
    model = Llama.from_checkpoint(model_dir)
    sink = Recorder(engine)
    asked = [start(engine, "g", PROMPT, sink, max_tokens=10, logprobs=5, **GREEDY),
             start(engine, "s", OTHERS[1], sink, max_tokens=10, logprobs=2, temperature=0.9,
                   seed=5, presence_penalty=1.0, logit_bias={7: 3.0}),
             start(engine, "z", OTHERS[0], sink, max_tokens=6, logprobs=0, **GREEDY)]
    plain = start(engine, "p", OTHERS[2], sink, max_tokens=10, **GREEDY)
    for r in [*asked, plain]:
        await finished(r)
    check_logprobs(model, PROMPT, asked[0], 5)
    check_logprobs(model, OTHERS[1], asked[1], 2)  # raw: penalties and bias do not show
    check_logprobs(model, OTHERS[0], asked[2], 0)
    assert plain.logprobs == [] and len(plain.ids) > 0
    assert await tokens(engine, PROMPT, max_tokens=10, **GREEDY) == asked[0].ids


async def test_logprobs_cost_nothing_when_not_asked(engine: ReferenceEngine) -> None:
    seen: list[Batch] = []

    def hook(batch: Batch, compute: Compute) -> list[int]:
        out = compute(batch)
        seen.append(batch)
        return out

    engine.compute_hook = hook
    r = await run(engine, "r", PROMPT, max_tokens=4, **GREEDY)
    assert all(out_ids for out_ids, _, _ in r.outputs) and seen
    assert all(b.logprobs is None for b in seen)


async def test_logit_bias_outside_the_vocabulary_is_refused(engine: ReferenceEngine) -> None:
    for bias in ({1024: 1.0}, {5: 200.0}):
        with pytest.raises(EngineRequestError) as e:
            start(engine, "bad", PROMPT, logit_bias=bias)
        assert e.value.param == "logit_bias"


async def test_chunked_prefill_gives_the_same_tokens_and_logprobs(make_engine: MakeEngine,
                                                                  model_dir: Path) -> None:
    """`max_prefill_tokens` 5: a 42-token prompt is prefilled 5 tokens a step (its first token
    sampled with its last chunk), no step computes more than 5 prompt tokens, and every answer
    (greedy, seeded, logprobs) equals the unchunked engine's; no page leaks."""
    from tandem.engines.reference.model import Llama
    from tandem.engines.scheduler import Scheduler

    whole = await make_engine()
    steps: list[list[tuple[str, int, bool]]] = []

    def record(batch: Batch, step: Compute) -> list[int]:
        steps.append([(s.rid, s.prefill_end - s.num_cached, Scheduler.samples(s))
                      for s in batch.prefill])
        assert Scheduler.prefill_tokens(batch) <= 5
        return step(batch)

    chunked = await make_engine(max_prefill_tokens=5, compute_hook=record)
    long = OTHERS[1]  # 42 tokens
    want = await tokens(whole, long, max_tokens=8, **GREEDY)
    sink = Recorder(chunked)
    runs = [start(chunked, "long", long, sink, max_tokens=8, logprobs=3, **GREEDY),
            start(chunked, "short", OTHERS[0], sink, max_tokens=4, **GREEDY),
            start(chunked, "seeded", PROMPT, sink, max_tokens=6, temperature=1.0, seed=9)]
    for r in runs:
        await finished(r)
    assert runs[0].ids == want
    check_logprobs(Llama.from_checkpoint(model_dir), long, runs[0], 3)
    assert runs[1].ids == await tokens(whole, OTHERS[0], max_tokens=4, **GREEDY)
    assert runs[2].ids == await tokens(whole, PROMPT, max_tokens=6, temperature=1.0, seed=9)
    longs = [(n, last) for step in steps for rid, n, last in step if rid == "long"]
    assert [n for n, _ in longs] == [5] * 8 + [2] and [last for _, last in longs] == \
        [False] * 8 + [True]
    # the chunk in progress goes first in each step; the short request (2 tokens) rides the
    # long prompt's last chunk (2 of the budget's 5), and the seeded one takes the last token
    # of that step's budget, then the rest of its prompt in the next
    last_long = max(i for i, step in enumerate(steps) if any(r == "long" for r, *_ in step))
    assert steps[last_long] == [("long", 2, True), ("short", 2, True), ("seeded", 1, False)]
    assert steps[last_long + 1][0] == ("seeded", 5, True)
    await wait_idle(chunked)
    assert chunked.pool.idle() and chunked.pool.num_held == 0
