"""The mock engine's timing model: costs show up as time (generous bounds, not a perf assertion),
and zero costs add no sleeps at all."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from tandem.engines.base import EngineRequest
from tandem.engines.mock import MockEngine, MockTiming
from tandem.runtime.wire import SamplingParams
from tests.conformance.harness import Recorder, finished


@pytest.fixture
def mock_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 500, "max_position_embeddings": 256, "eos_token_id": 2}))
    return str(tmp_path)


async def run(eng: MockEngine, reqs: list[EngineRequest]) -> float:
    await eng.start()
    try:
        sink = Recorder(eng)
        t0 = time.monotonic()
        runs = [sink.submit(eng, r.rid, r.prompt_ids, r.sampling) for r in reqs]
        await asyncio.gather(*(finished(r) for r in runs))
        elapsed = time.monotonic() - t0
        counts = [len(r.ids) for r in runs]
        assert counts == [r.sampling.max_tokens for r in reqs]
        assert eng.pool.num_free == eng.num_pages
        return elapsed
    finally:
        await eng.shutdown()


def req(rid: str, n_prompt: int, max_tokens: int) -> EngineRequest:
    return EngineRequest(rid, [3] * n_prompt, SamplingParams(max_tokens=max_tokens))


def test_step_cost_adds_prefill_and_decode_parts():
    t = MockTiming(step_s=0.001, prefill_s_per_token=0.0001, decode_step_s=0.01,
                   decode_s_per_seq=0.002)
    assert t.step_cost(0, 0) == pytest.approx(0.001)
    assert t.step_cost(100, 0) == pytest.approx(0.011)
    assert t.step_cost(0, 5) == pytest.approx(0.001 + 0.01 + 0.01)
    assert MockTiming().step_cost(10_000, 4096) == 0.0


async def test_decode_step_cost_paces_tokens(mock_dir):
    eng = MockEngine(mock_dir, timing=MockTiming(decode_step_s=0.05))
    elapsed = await run(eng, [req("a", 4, 10)])
    assert elapsed >= 0.45  # 10 steps of 50 ms


async def test_decode_cost_per_sequence_grows_with_the_batch(mock_dir):
    eng = MockEngine(mock_dir, timing=MockTiming(decode_s_per_seq=0.005))
    elapsed = await run(eng, [req(f"r{i}", 4, 5) for i in range(8)])
    assert elapsed >= 0.18  # 5 steps of 8 sequences * 5 ms


async def test_prefill_cost_is_per_prompt_token(mock_dir):
    eng = MockEngine(mock_dir, timing=MockTiming(prefill_s_per_token=0.002))
    elapsed = await run(eng, [req("a", 200, 1)])
    assert elapsed >= 0.38  # 200 tokens * 2 ms


async def test_batch_cap_serializes_requests(mock_dir):
    eng = MockEngine(mock_dir, max_batch=1, timing=MockTiming(decode_step_s=0.02))
    elapsed = await run(eng, [req(f"r{i}", 4, 5) for i in range(3)])
    assert elapsed >= 0.27  # 3 requests one after another, 5 steps of 20 ms each


async def test_zero_costs_add_no_sleeps(mock_dir, monkeypatch):
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float, *args: object) -> object:
        delays.append(delay)
        return await real_sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    eng = MockEngine(mock_dir)
    await run(eng, [req(f"r{i}", 8, 20) for i in range(16)])
    assert delays and all(d == 0 for d in delays)


def test_timing_flags_reach_the_worker_config_through_tandem_up(mock_dir):
    """What `tandem up` forwards to a worker is what that worker parses."""
    from tandem.cli import parse
    from tandem.up import make_plan

    up = parse(["up", "--model", mock_dir, "--engine", "mock", "--mock-prefill-us-per-token",
                "2.5", "--mock-decode-step-us", "1000", "--mock-decode-us-per-seq", "30"])
    plan = make_plan(up.config, up.forwarded)
    (worker,) = plan.workers
    cfg = parse(list(worker.argv)).config
    assert (cfg.engine, cfg.mock_prefill_us_per_token, cfg.mock_decode_step_us,
            cfg.mock_decode_us_per_seq) == ("mock", 2.5, 1000.0, 30.0)
    plain = parse(["worker", "--model", mock_dir]).config
    assert (plain.mock_prefill_us_per_token, plain.mock_decode_step_us,
            plain.mock_decode_us_per_seq) == (0.0, 0.0, 0.0)
