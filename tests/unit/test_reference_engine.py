"""ReferenceEngine behaviour a user would notice: the same tokens alone or batched, sampling that
reproduces with a seed, every finish reason, both output modes, and every page back in the pool
after every scenario (normal end, aclose, cancellation, abort, refusal)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.engines.base import EngineError, EngineOutput, EngineRequest, EngineRequestError
from tandem.engines.reference import ReferenceEngine, write_tiny_model
from tandem.runtime.wire import SamplingParams

GREEDY = {"temperature": 0.0}
PROMPT = [0, 5, 100, 200, 7, 900]
OTHERS = [[0, 17], [0, *range(300, 341)], [3, 2, 1, 4, 1023, 8, 9]]

MakeEngine = Callable[..., Awaitable[ReferenceEngine]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path, seed=0)
    return path


async def wait_idle(engine: ReferenceEngine, timeout: float = 2.0) -> None:
    """Every page comes back promptly, and the accounting holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        load = engine.load()
        if load.running == load.waiting == 0 and load.pages_free == load.pages_total:
            break
        assert asyncio.get_running_loop().time() < deadline, f"engine not idle: {load}"
        await asyncio.sleep(0.002)
    engine.pool.check()
    assert engine.pool.owners() == []


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


async def run(
    engine: ReferenceEngine, rid: str, prompt: list[int], **sampling: Any
) -> list[EngineOutput]:
    req = EngineRequest(rid, list(prompt), SamplingParams(**sampling))
    return [o async for o in engine.generate(req)]


async def tokens(
    engine: ReferenceEngine, prompt: list[int], rid: str = "r", **sampling: Any
) -> list[int]:
    outs = await run(engine, rid, prompt, **sampling)
    assert outs[-1].finish_reason is not None
    return outs[-1].output_ids


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
    outs = await run(engine, "r", PROMPT, max_tokens=7, ignore_eos=True, **GREEDY)
    assert [o.finish_reason for o in outs] == [None] * 6 + ["length"]
    last = outs[-1]
    assert (last.prompt_tokens, last.completion_tokens, len(last.output_ids)) == (6, 7, 7)


async def test_context_end_finishes_with_length(make_engine: MakeEngine, tmp_path: Path,
                                                model_dir: Path) -> None:
    small = tmp_path / "small"
    shutil.copytree(model_dir, small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["max_position_embeddings"] = 12
    (small / "config.json").write_text(json.dumps(cfg))
    engine = await make_engine(small)
    outs = await run(engine, "r", PROMPT, max_tokens=50, ignore_eos=True, **GREEDY)
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 6
    with pytest.raises(EngineRequestError):
        await run(engine, "long", list(range(12)), max_tokens=1)


async def test_stop_token_ids(engine: ReferenceEngine) -> None:
    free_run = await tokens(engine, PROMPT, max_tokens=12, ignore_eos=True, **GREEDY)
    stop = free_run[4]
    cut = free_run.index(stop)
    outs = await run(engine, "r", PROMPT, max_tokens=12, stop_token_ids=(stop,), **GREEDY)
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].output_ids == free_run[: cut + 1]  # the stop id itself is the last output


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
    outs = await run(eos_engine, "a", PROMPT, max_tokens=8, **GREEDY)
    assert outs[-1].finish_reason == "stop" and outs[-1].output_ids == [first]
    outs = await run(eos_engine, "b", PROMPT, max_tokens=8, ignore_eos=True, **GREEDY)
    assert outs[-1].finish_reason == "length" and len(outs[-1].output_ids) == 8
    late = await tokens(eos_engine, PROMPT, max_tokens=8, min_tokens=2, **GREEDY)
    assert first not in late[:2]


async def test_cumulative_and_incremental_give_the_same_tokens(make_engine: MakeEngine) -> None:
    cum = await make_engine(output_mode="cumulative")
    inc = await make_engine(output_mode="incremental")
    params = {"max_tokens": 15, "temperature": 0.7, "seed": 5, "ignore_eos": True}
    cum_outs = await run(cum, "c", PROMPT, **params)
    inc_outs = await run(inc, "i", PROMPT, **params)
    joined: list[int] = []
    for o in inc_outs:
        assert o.completion_tokens == len(joined) + len(o.output_ids)  # offset + len == count
        joined += o.output_ids
    prev: list[int] = []
    for o in cum_outs:
        assert o.output_ids[: len(prev)] == prev and o.completion_tokens == len(o.output_ids)
        prev = o.output_ids
    assert joined == prev and len(joined) == 15


async def test_aclose_mid_stream_frees_pages(engine: ReferenceEngine) -> None:
    gen = engine.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=500, **GREEDY)))
    for _ in range(3):
        await gen.__anext__()
    assert engine.load().running == 1 and engine.pool.num_free < engine.num_pages
    await gen.aclose()
    await wait_idle(engine)


async def test_cancelled_consumer_frees_pages(engine: ReferenceEngine) -> None:
    got: list[EngineOutput] = []

    async def consume() -> None:
        async for o in engine.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=1000))):
            got.append(o)

    task = asyncio.create_task(consume())
    while len(got) < 3:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)


async def test_abort_ends_running_and_waiting_requests(make_engine: MakeEngine) -> None:
    # Pages for one request at a time, so the second one waits.
    engine = await make_engine(num_pages=130, max_batch=4)  # one request takes 127 pages
    params = SamplingParams(max_tokens=500, ignore_eos=True, **GREEDY)
    first = engine.generate(EngineRequest("a", PROMPT, params))
    second = engine.generate(EngineRequest("b", PROMPT, params))
    assert (await first.__anext__()).finish_reason is None
    pending = asyncio.ensure_future(second.__anext__())
    await asyncio.sleep(0.02)
    assert engine.load().waiting == 1 and not pending.done()
    await engine.abort("b")
    out = await pending
    assert out.finish_reason == "abort" and out.output_ids == []
    await engine.abort("a")
    outs = [o async for o in first]
    assert outs[-1].finish_reason == "abort"
    await engine.abort("a")  # twice, and unknown rids, are harmless
    await engine.abort("nope")
    await wait_idle(engine)


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
    for prompt, params in bad:
        with pytest.raises(EngineRequestError):
            await engine.generate(EngineRequest("x", prompt, SamplingParams(**params))).__anext__()
    assert await tokens(engine, PROMPT, max_tokens=20, **GREEDY)  # still serves what fits


async def test_one_delivery_per_step_and_loop_stays_responsive(engine: ReferenceEngine) -> None:
    calls = 0
    deliver = engine._deliver

    def counting(emits: list[Any]) -> None:
        nonlocal calls
        calls += 1
        deliver(emits)

    engine._deliver = counting  # type: ignore[method-assign]
    compute_threads: set[int] = set()
    compute = engine._compute

    def recording(batch: Any) -> list[int]:
        compute_threads.add(threading.get_ident())
        return compute(batch)

    engine._compute = recording  # type: ignore[method-assign]
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while not done.is_set():
            await asyncio.sleep(0.002)
            now = loop.time()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    prompts = [PROMPT, *OTHERS, [0, 9, 8], [0, 77, 300, 12]]
    params = {"max_tokens": 120, "ignore_eos": True, **GREEDY}
    started = asyncio.get_running_loop().time()
    outs = await asyncio.gather(*(tokens(engine, p, rid=f"r{i}", **params)
                                  for i, p in enumerate(prompts)))
    elapsed = asyncio.get_running_loop().time() - started
    done.set()
    await tick
    assert all(len(o) == 120 for o in outs)
    assert calls < 120 + 2 * len(prompts)  # batched per step, not one call per token
    # A loop blocked by compute would stall for the whole run; ours ticks every few ms.
    assert len(gaps) > 10 and max(gaps) < max(0.1, elapsed / 5)
    assert compute_threads and threading.get_ident() not in compute_threads


async def test_shutdown_ends_requests_and_is_idempotent(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    gen = engine.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=2000, **GREEDY)))
    await gen.__anext__()
    await engine.shutdown()
    outs = [o async for o in gen]
    assert outs[-1].finish_reason == "abort"
    await engine.shutdown()
    with pytest.raises(EngineError):
        await engine.generate(EngineRequest("late", PROMPT, SamplingParams())).__anext__()
    never_started = ReferenceEngine(engine.model_dir)
    await never_started.shutdown()
    await never_started.shutdown()


async def test_abort_while_step_computes_frees_after_the_step(engine: ReferenceEngine) -> None:
    gate, entered = threading.Event(), threading.Event()
    compute = engine._compute

    def held(batch: Any) -> list[int]:
        entered.set()
        gate.wait(5)
        return compute(batch)

    engine._compute = held  # type: ignore[method-assign]
    gen = engine.generate(EngineRequest("r", PROMPT, SamplingParams(max_tokens=50, **GREEDY)))
    first = asyncio.ensure_future(gen.__anext__())
    await asyncio.to_thread(entered.wait, 5)
    await engine.abort("r")  # its pages are being written now: held until the step ends
    assert engine.pool.num_free < engine.num_pages and not first.done()
    gate.set()
    out = await first
    assert out.finish_reason == "abort" and out.output_ids == []
    await wait_idle(engine)


async def test_failing_step_fails_its_requests_only(engine: ReferenceEngine) -> None:
    compute = engine._compute
    engine._compute = lambda batch: 1 / 0  # type: ignore[method-assign, assignment]
    with pytest.raises(EngineError, match="ZeroDivisionError"):
        await tokens(engine, PROMPT, max_tokens=5)
    await wait_idle(engine)
    engine._compute = compute  # type: ignore[method-assign]
    assert len(await tokens(engine, PROMPT, max_tokens=5, ignore_eos=True)) == 5
