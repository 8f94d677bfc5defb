"""Decode-handler deltas from both output modes, and the mock engine's contract."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from tandem.engines.base import EngineError, EngineOutput, EngineRequest, EngineRequestError
from tandem.engines.mock import MockEngine
from tandem.runtime.wire import SamplingParams
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


class Sink:
    """An OutputSink that records what the engine's fast path delivers."""

    def __init__(self, cumulative: bool = True) -> None:
        self.cumulative = cumulative
        self.outs: list[tuple[list[int], str | None, int]] = []
        self.failed: EngineError | None = None
        self.done = asyncio.Event()

    def put(self, out: EngineOutput) -> None:
        ids = list(out.output_ids[:out.completion_tokens]) if self.cumulative else list(out.output_ids)
        self.outs.append((ids, out.finish_reason, out.completion_tokens))
        if out.finish_reason is not None:
            self.done.set()

    def fail(self, err: EngineError) -> None:
        self.failed = err
        self.done.set()

    @property
    def ids(self) -> list[int]:
        if self.cumulative:
            return self.outs[-1][0] if self.outs else []
        return [t for ids, _, _ in self.outs for t in ids]


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
async def test_fast_path_delivers_what_generate_yields(mock_dir, mode):
    eng = MockEngine(mock_dir, page_size=4, num_pages=64, output_mode=mode)
    await eng.start()
    try:
        reqs = [EngineRequest(f"r{i}", [1, 2, i], SamplingParams(max_tokens=10)) for i in range(5)]
        want = await asyncio.gather(*(collect(eng, r) for r in reqs))
        sinks = [Sink(mode == "cumulative") for _ in reqs]
        for r, s in zip(reqs, sinks):
            assert eng.open_stream(r, s) is not None
            assert not s.outs  # nothing is delivered before open_stream returns
        await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in sinks)), 5)
        assert [(s.ids, s.outs[-1][1]) for s in sinks] == want
        assert all(s.outs[-1][2] == 10 for s in sinks)
        assert eng.pool.num_free == 64
        eng.pool.check()
    finally:
        await eng.shutdown()


async def test_fast_path_refuses_at_once_and_cancel_frees_pages_and_silences_the_sink(mock_dir):
    eng = MockEngine(mock_dir, page_size=4, num_pages=64, step_delay_s=0.001)
    await eng.start()
    try:
        with pytest.raises(EngineRequestError):
            eng.open_stream(EngineRequest("empty", [], SamplingParams()), Sink())
        s = Sink()
        handle = eng.open_stream(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=1000)), s)
        assert handle is not None
        while len(s.outs) < 3:
            await asyncio.sleep(0.001)
        assert eng.pool.num_free < 64
        handle.cancel()
        n = len(s.outs)
        await asyncio.sleep(0.02)  # steps go on; the cancelled request gets nothing more
        assert len(s.outs) == n and s.failed is None and not s.done.is_set()
        assert eng.pool.num_free == 64 and eng.load().running == 0
        handle.cancel()  # twice is harmless
        eng.pool.check()
    finally:
        await eng.shutdown()


async def _mock_pd(mock_dir, transfer_timeout_s: float = 5.0, **decode_kw):
    from tandem.kv.handoff import DecodeSide, PrefillSide
    from tandem.kv.movers import SimulatedMover
    from tests.cluster import free_port

    p = MockEngine(mock_dir, page_size=4, num_pages=64)
    d = MockEngine(mock_dir, page_size=4, num_pages=64, **decode_kw)
    await p.start()
    await d.start()
    p.prefill_side = PrefillSide(SimulatedMover("p", p.page_bytes, 64), "127.0.0.1", free_port(),
                                 room_timeout_s=5, transfer_timeout_s=5)
    await p.prefill_side.start()
    d.decode_side = DecodeSide(SimulatedMover("d", d.page_bytes, 64), "d", done_timeout_s=5,
                               transfer_timeout_s=transfer_timeout_s)
    return p, d


async def _close_pd(p, d):
    for e in (d, p):
        await e.shutdown()
    await d.decode_side.close()
    await p.prefill_side.close()


async def test_fast_path_decode_continues_the_prefill_exactly(mock_dir):
    from tandem.runtime.wire import Bootstrap

    p, d = await _mock_pd(mock_dir)
    try:
        want, _ = await collect(d, EngineRequest("agg", [4, 5, 6], SamplingParams(max_tokens=12)))
        host, _, port = p.prefill_side.address.rpartition(":")
        req = EngineRequest("pd", [4, 5, 6], SamplingParams(max_tokens=12), Bootstrap(host, int(port), 7))
        s = Sink()
        assert d.open_stream(req, s) is not None
        assert p.open_stream(req, Sink()) is None  # a prefill has no fast path: generate()
        prefill = asyncio.create_task(collect(p, req))
        await asyncio.wait_for(s.done.wait(), 5)
        assert (await prefill)[1] == "length"
        assert s.failed is None and s.ids == want and s.outs[-1][1] == "length"
        assert d.pool.num_free == 64 and p.pool.num_free == 64
    finally:
        await _close_pd(p, d)


async def test_fast_path_decode_cancelled_during_the_handoff_frees_its_pages(mock_dir):
    from tandem.runtime.wire import Bootstrap

    p, d = await _mock_pd(mock_dir, transfer_timeout_s=0.2)  # the quarantine is its + grace
    try:
        host, _, port = p.prefill_side.address.rpartition(":")
        req = EngineRequest("pd", [4, 5, 6], SamplingParams(max_tokens=12), Bootstrap(host, int(port), 9))
        s = Sink()
        handle = d.open_stream(req, s)  # no prefill ever comes: the KV never arrives
        assert handle is not None
        await asyncio.sleep(0.05)
        assert d.pool.num_free < 64
        handle.cancel()
        for _ in range(200):  # the decode side gives the pages back once no write can land
            if d.pool.num_free == 64:
                break
            await asyncio.sleep(0.05)
        assert d.pool.num_free == 64 and not s.outs and s.failed is None
    finally:
        await _close_pd(p, d)
