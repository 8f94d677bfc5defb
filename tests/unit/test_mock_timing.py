"""The mock engine's timing model: costs show up as time (generous bounds, not a perf assertion),
and zero costs add no sleeps at all."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from tandem.engines.base import EngineRequest
from tandem.config import MockTiming, WorkerConfig
from tandem.engines.mock import MockEngine
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
        assert eng.pool.idle()  # every page free or cached
        return elapsed
    finally:
        await eng.shutdown()


def req(rid: str, n_prompt: int, max_tokens: int) -> EngineRequest:
    return EngineRequest(rid, [3] * n_prompt, SamplingParams(max_tokens=max_tokens))


def test_step_cost_adds_prefill_and_decode_parts():
    t = MockTiming(step_delay_ms=1, mock_prefill_us_per_token=100, mock_decode_step_us=10_000,
                   mock_decode_us_per_seq=2000)
    assert t.step_cost(0, 0) == pytest.approx(0.001)
    assert t.step_cost(100, 0) == pytest.approx(0.011)
    assert t.step_cost(0, 5) == pytest.approx(0.001 + 0.01 + 0.01)
    assert MockTiming().step_cost(10_000, 4096) == 0.0


async def test_decode_step_cost_paces_tokens(mock_dir):
    eng = MockEngine(mock_dir, timing=MockTiming(mock_decode_step_us=50_000))
    elapsed = await run(eng, [req("a", 4, 10)])
    assert elapsed >= 0.45  # 10 steps of 50 ms


async def test_decode_cost_per_sequence_grows_with_the_batch(mock_dir):
    eng = MockEngine(mock_dir, timing=MockTiming(mock_decode_us_per_seq=5000))
    elapsed = await run(eng, [req(f"r{i}", 4, 5) for i in range(8)])
    assert elapsed >= 0.18  # 5 steps of 8 sequences * 5 ms


async def test_prefill_cost_is_per_prompt_token(mock_dir):
    eng = MockEngine(mock_dir, timing=MockTiming(mock_prefill_us_per_token=2000))
    elapsed = await run(eng, [req("a", 200, 1)])
    assert elapsed >= 0.38  # 200 tokens * 2 ms


async def test_batch_cap_serializes_requests(mock_dir):
    eng = MockEngine(mock_dir, max_batch=1, timing=MockTiming(mock_decode_step_us=20_000))
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


def test_a_worker_config_is_the_one_timing_model_its_engine_runs(mock_dir):
    """One MockTiming (tandem.config): the flags' values are what the engine's steps cost."""
    from tandem.engines.factory import make_engine

    cfg = WorkerConfig(model=mock_dir, engine="mock", step_delay_ms=1.5,
                       mock_prefill_us_per_token=20, mock_decode_step_us=300,
                       mock_decode_us_per_seq=4, kv_bytes_per_s=1e9)
    eng = make_engine(cfg)
    assert isinstance(eng, MockEngine) and eng.timing == MockTiming.of(cfg)
    assert eng.timing.step_cost(10, 2) == pytest.approx(0.0015 + 200e-6 + 300e-6 + 8e-6)


def test_engine_constructors_take_their_defaults_from_the_worker_config():
    """No engine repeats a default tandem.config holds: built with no arguments, an engine has
    a worker's page size, pages, batch cap, device and timing."""
    import inspect

    from tandem.engines.reference.engine import ReferenceEngine
    from tandem.engines.sglang import SGLangOptions

    for cls in (MockEngine, ReferenceEngine, SGLangOptions):
        params = inspect.signature(cls).parameters
        for name in ("page_size", "num_pages", "max_batch", "device", "host", "log_level"):
            if name in params and not (cls is SGLangOptions and name in ("max_batch",
                                                                          "num_pages")):
                assert params[name].default == getattr(WorkerConfig, name), (cls, name)
    assert inspect.signature(MockEngine).parameters["timing"].default == MockTiming()
