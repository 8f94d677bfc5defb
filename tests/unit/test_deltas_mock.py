"""Decode-handler deltas from both output modes, and the mock engine's contract."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from tandem.engines.base import EngineError, EngineOutput, EngineRequest, EngineRequestError
from tandem.engines.mock import MockEngine
from tandem.runtime.protocol import SamplingParams
from tandem.worker.deltas import DeltaMaker


def test_cumulative_slices_by_sent_count_and_ignores_growth_of_a_live_list():
    m = DeltaMaker("r", "cumulative")
    live = [1, 2]
    d1 = m.make(EngineOutput(live, None, 3, 2))
    live.extend([3, 4, 5])  # the engine keeps appending to the same list
    assert d1 is not None and (d1.offset, d1.token_ids) == (0, [1, 2])
    d2 = m.make(EngineOutput(live, None, 3, 4))
    assert d2 is not None and (d2.offset, d2.token_ids) == (2, [3, 4])
    d3 = m.make(EngineOutput(live, "length", 3, 5))
    assert d3 is not None and (d3.offset, d3.token_ids, d3.finish_reason) == (4, [5], "length")
    assert d3.usage is not None and d3.usage.completion_tokens == 5
    assert m.make(EngineOutput(live, None, 3, 5)) is None  # nothing new, not finished


def test_incremental_passes_through_and_drops_the_repeated_abort_id():
    m = DeltaMaker("r", "incremental")
    assert m.make(EngineOutput([7], None, 1, 1)).token_ids == [7]
    assert m.make(EngineOutput([8, 9], None, 1, 3)).token_ids == [8, 9]
    last = m.make(EngineOutput([9], "abort", 1, 3))  # SGLang repeats the last id on abort
    assert last is not None and last.token_ids == [] and last.offset == 3


def test_out_of_step_engine_output_is_an_error_not_a_silent_loss():
    m = DeltaMaker("r", "incremental")
    m.make(EngineOutput([1], None, 1, 1))
    with pytest.raises(EngineError):
        m.make(EngineOutput([2], None, 1, 3))  # a token went missing


@pytest.fixture
def mock_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 500, "max_position_embeddings": 128, "eos_token_id": 2}))
    return str(tmp_path)


async def collect(engine, req) -> tuple[list[int], str | None]:
    ids: list[int] = []
    reason = None
    async for out in engine.generate(req):
        ids = out.output_ids if engine.output_mode == "cumulative" else ids + out.output_ids
        reason = out.finish_reason
    return ids, reason


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
async def test_mock_engine_is_deterministic_and_frees_pages(mock_dir, mode):
    eng = MockEngine(mock_dir, page_size=4, num_pages=64, output_mode=mode)
    await eng.start()
    try:
        reqs = [EngineRequest(f"r{i}", [1, 2, i], SamplingParams(max_tokens=10)) for i in range(5)]
        first = await asyncio.gather(*(collect(eng, r) for r in reqs))
        again = await asyncio.gather(*(collect(eng, r) for r in reqs))
        assert first == again
        assert all(len(ids) == 10 and reason == "length" for ids, reason in first)
        assert eng.pool.num_free == 64
        # context end: prompt 120 + max_tokens 50 stops at 128
        ids, reason = await collect(eng, EngineRequest("long", [3] * 120, SamplingParams(max_tokens=50)))
        assert (len(ids), reason) == (8, "length")
        with pytest.raises(EngineRequestError):
            await collect(eng, EngineRequest("x", [1] * 128, SamplingParams()))
        with pytest.raises(EngineRequestError):
            await collect(eng, EngineRequest("y", [], SamplingParams()))
        eng.pool.check()
        assert eng.pool.num_free == 64
    finally:
        await eng.shutdown()


async def test_mock_engine_aclose_and_abort_free_pages(mock_dir):
    eng = MockEngine(mock_dir, page_size=4, num_pages=64, step_delay_s=0.001)
    await eng.start()
    try:
        gen = eng.generate(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=100)))
        async with contextlib.aclosing(gen):
            await gen.__anext__()
            assert eng.pool.num_free < 64
        assert eng.pool.num_free == 64
        task = asyncio.create_task(collect(eng, EngineRequest("b", [1], SamplingParams(max_tokens=100))))
        await asyncio.sleep(0.01)
        await eng.abort("b")
        ids, reason = await asyncio.wait_for(task, 5)
        assert reason == "abort" and len(ids) < 100
        assert eng.pool.num_free == 64 and eng.load().running == 0
        eng.pool.check()
    finally:
        await eng.shutdown()


async def test_mock_engine_stop_token_and_min_tokens(mock_dir):
    from tandem.engines.mock import mock_token

    eng = MockEngine(mock_dir, page_size=4, num_pages=64)
    await eng.start()
    try:
        prompt = [5, 6]
        third = mock_token(prompt, 2, 500, frozenset({2}))
        ids, reason = await collect(eng, EngineRequest("s", prompt, SamplingParams(
            max_tokens=20, stop_token_ids=(third,))))
        assert (len(ids), reason, ids[-1]) == (3, "stop", third)
        ids, reason = await collect(eng, EngineRequest("m", prompt, SamplingParams(
            max_tokens=20, stop_token_ids=(third,), min_tokens=5)))
        assert len(ids) > 3
    finally:
        await eng.shutdown()
