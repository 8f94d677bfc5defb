"""Decode-handler deltas from both output modes, and what is particular to the mock engine
(its tokens, its PD quarantine); the contract itself is tests/conformance."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.engines.base import EngineError, EngineOutput, EngineRequest, EngineRequestError
from tandem.engines.mock import MockEngine, mock_token
from tandem.kv.handoff import QUARANTINE_GRACE_S
from tandem.runtime.wire import SamplingParams
from tandem.worker.deltas import DeltaMaker
from tests.conformance.engines import PdLink
from tests.conformance.harness import Recorder, finished, wait_idle


def test_cumulative_slices_by_sent_count_and_ignores_growth_of_a_live_list():
    m = DeltaMaker("r", "cumulative")
    live = [1, 2]
    d1 = m.make(EngineOutput("r", live, None, 3, 2))
    live.extend([3, 4, 5])  # the engine keeps appending to the same list
    assert d1 is not None and (d1.offset, d1.token_ids) == (0, [1, 2])
    d2 = m.make(EngineOutput("r", live, None, 3, 4))
    assert d2 is not None and (d2.offset, d2.token_ids) == (2, [3, 4])
    d3 = m.make(EngineOutput("r", live, "length", 3, 5))
    assert d3 is not None and (d3.offset, d3.token_ids, d3.finish_reason) == (4, [5], "length")
    assert d3.usage is not None and d3.usage.completion_tokens == 5
    assert m.make(EngineOutput("r", live, None, 3, 5)) is None  # nothing new, not finished


def test_incremental_passes_through_and_drops_the_repeated_abort_id():
    m = DeltaMaker("r", "incremental")
    assert m.make(EngineOutput("r", [7], None, 1, 1)).token_ids == [7]
    assert m.make(EngineOutput("r", [8, 9], None, 1, 3)).token_ids == [8, 9]
    last = m.make(EngineOutput("r", [9], "abort", 1, 3))  # SGLang repeats the last id on abort
    assert last is not None and last.token_ids == [] and last.offset == 3


def test_out_of_step_engine_output_is_an_error_not_a_silent_loss():
    m = DeltaMaker("r", "incremental")
    m.make(EngineOutput("r", [1], None, 1, 1))
    with pytest.raises(EngineError):
        m.make(EngineOutput("r", [2], None, 1, 3))  # a token went missing


@pytest.fixture
def mock_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 500, "max_position_embeddings": 128, "eos_token_id": 2}))
    return str(tmp_path)


async def collect(engine, req) -> tuple[list[int], str | None]:
    run = await finished(Recorder(engine).submit(engine, req.rid, req.prompt_ids, req.sampling,
                                                 req.bootstrap))
    return run.ids, run.finish


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
        assert first[0][0] == [mock_token([1, 2, 0], i, 500, frozenset({2})) for i in range(10)]
        assert eng.load().pages_free == 64
        # context end: prompt 120 + max_tokens 50 stops at 128
        ids, reason = await collect(eng, EngineRequest("long", [3] * 120, SamplingParams(max_tokens=50)))
        assert (len(ids), reason) == (8, "length")
        sink = Recorder(eng)
        with pytest.raises(EngineRequestError):  # refused at once, at submit
            sink.submit(eng, "x", [1] * 128, SamplingParams())
        with pytest.raises(EngineRequestError):
            sink.submit(eng, "y", [], SamplingParams())
        await wait_idle(eng)
    finally:
        await eng.shutdown()


async def test_mock_engine_cancel_frees_pages_and_silences_the_sink(mock_dir):
    eng = MockEngine(mock_dir, page_size=4, num_pages=64, step_delay_s=0.001)
    await eng.start()
    try:
        sink = Recorder(eng)
        run = sink.submit(eng, "a", [1, 2, 3], SamplingParams(max_tokens=100))
        while len(run.outputs) < 3:
            await asyncio.sleep(0.001)
        assert eng.load().pages_free < 64 and run.handle is not None
        run.handle.cancel()
        n = len(run.outputs)
        await asyncio.sleep(0.02)  # steps go on; the cancelled request gets nothing more
        assert len(run.outputs) == n and run.finish is None and run.error is None
        assert eng.load().pages_free == 64 and eng.load().running == 0
        run.handle.cancel()  # twice is harmless
        eng.pool.check()
    finally:
        await eng.shutdown()


async def test_mock_engine_stop_token_and_min_tokens(mock_dir):
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


async def test_mock_decode_cancelled_during_the_handoff_frees_its_pages_after_quarantine(mock_dir):
    link = PdLink()
    link.timeout_s = 0.2  # the transfer deadline: the quarantine is it + the grace
    d = MockEngine(mock_dir, page_size=4, num_pages=64,
                   handoff=link.handoff("decode", "d", local_kv=False))
    p = MockEngine(mock_dir, page_size=4, num_pages=64,
                   handoff=link.handoff("prefill", "p", local_kv=False))
    await p.start()
    await d.start()
    try:
        assert p.bootstrap_addr == f"127.0.0.1:{link.port}" and d.bootstrap_addr == ""
        sink = Recorder(d)
        run = sink.submit(d, "pd", [4, 5, 6], SamplingParams(max_tokens=12), link.bootstrap())
        while d.load().pages_reserved == 0:  # no prefill ever comes: the KV never arrives
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # the fetch is under way
        assert run.handle is not None
        run.handle.cancel()
        assert d.load().pages_reserved > 0  # P might still write: quarantined, not freed
        await wait_idle(d, timeout=0.2 + QUARANTINE_GRACE_S + 2.0)
        assert run.outputs == []
    finally:
        await d.shutdown()
        await p.shutdown()
