"""Decode-handler deltas from both output modes (logprobs included), and what is particular to the
mock engine (its tokens, its toy model of the sampling parameters and logprobs, its PD quarantine);
the contract itself is tests/conformance."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from tandem.config import MockTiming
from tandem.engines.base import EngineError, EngineOutput, EngineRequest, EngineRequestError
from tandem.engines.mock import NATURAL_LOGIT, MockEngine, mock_token
from tandem.kv.bootstrap.decode import QUARANTINE_GRACE_S
from tandem.runtime.wire import SamplingParams, TokenLogprobs
from tandem.worker.deltas import DeltaMaker
from tests.conformance.engines import PdLink
from tests.conformance.harness import Recorder, Run, finished, wait_idle


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


def test_incremental_passes_through_and_an_untrimmed_abort_echo_is_out_of_step():
    m = DeltaMaker("r", "incremental")
    first = [7]
    d1 = m.make(EngineOutput("r", first, None, 1, 1))
    assert d1 is not None and d1.token_ids is first  # the contract makes it the consumer's
    d2 = m.make(EngineOutput("r", [8, 9], None, 1, 3))
    assert d2 is not None and (d2.offset, d2.token_ids) == (1, [8, 9])
    # SGLang's abort echo (its last id again) is trimmed in tandem.engines.sglang_stream
    # (tests/sglang); one that got this far is a count that does not add up.
    with pytest.raises(EngineError):
        m.make(EngineOutput("r", [9], "abort", 1, 3))
    last = m.make(EngineOutput("r", [], "abort", 1, 3))  # (nothing was counted as sent)
    assert last is not None and (last.offset, last.token_ids, last.finish_reason) == (3, [], "abort")


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
    eng = MockEngine(mock_dir, page_size=4, num_pages=64, timing=MockTiming(step_delay_ms=1))
    await eng.start()
    try:
        sink = Recorder(eng)
        run = sink.submit(eng, "a", [1, 2, 3], SamplingParams(max_tokens=100))
        held: list[int] = []
        cancelled = asyncio.Event()

        def cancel_at_the_third(r: Run) -> None:  # from the sink: a known point, 97 steps to go
            if len(r.outputs) == 3:
                held.append(eng.load().pages_free)
                assert r.handle is not None
                r.handle.cancel()
                cancelled.set()

        run.on_output = cancel_at_the_third
        await asyncio.wait_for(cancelled.wait(), 10)
        assert held[0] < 64
        await asyncio.sleep(0.02)  # steps go on; the cancelled request gets nothing more
        assert len(run.outputs) == 3 and run.finish is None and run.error is None
        assert eng.load().pages_free == 64 and eng.load().running == 0
        assert run.handle is not None
        run.handle.cancel()  # twice is harmless
        eng.pool.check()
    finally:
        await eng.shutdown()


class DeltaLog:
    """A sink that turns outputs into deltas as the worker does, and keeps them."""

    def __init__(self, mode: str) -> None:
        self.makers: dict[str, DeltaMaker] = {}
        self.mode = mode
        self.deltas: dict[str, list[tuple]] = {}
        self.done: dict[str, asyncio.Event] = {}

    def add(self, rid: str) -> None:
        self.makers[rid] = DeltaMaker(rid, self.mode)
        self.deltas[rid], self.done[rid] = [], asyncio.Event()

    def on_step(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            d = self.makers[out.rid].make(out)
            if d is not None:  # (copied: a live list would otherwise show later tokens)
                self.deltas[out.rid].append((d.offset, list(d.token_ids), d.finish_reason,
                                             d.usage, None if d.logprobs is None else
                                             list(d.logprobs)))
            if out.finish_reason is not None:
                self.done[out.rid].set()


async def test_mock_engine_incremental_gives_the_deltas_cumulative_gives(mock_dir):
    """The default (incremental: the step's own token) and cumulative (the live list, sliced by
    the worker) make the same deltas: ids, offsets, finishes, usage and logprobs."""
    reqs = [("long", [1, 2, 3], SamplingParams(max_tokens=9)),
            ("ctx", [3] * 125, SamplingParams(max_tokens=50)),  # ends at the context
            ("stop", [5, 6], SamplingParams(max_tokens=20, stop_token_ids=(
                mock_token([5, 6], 2, 500, frozenset({2})),))),
            ("lp", [7, 8], SamplingParams(max_tokens=5, logprobs=2)),
            ("bias", [9], SamplingParams(max_tokens=4, logit_bias={42: 11.0},
                                         presence_penalty=2.0))]
    seen = {}
    for mode in (None, "cumulative"):
        eng = MockEngine(mock_dir, page_size=4, num_pages=128, output_mode=mode)
        assert eng.output_mode == (mode or "incremental")
        await eng.start()
        try:
            sink = DeltaLog(eng.output_mode)
            for rid, prompt, sp in reqs:
                sink.add(rid)
                eng.submit(EngineRequest(rid, prompt, sp), sink)
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in sink.done.values())), 10)
            seen[eng.output_mode] = sink.deltas
        finally:
            await eng.shutdown()
    assert seen["incremental"] == seen["cumulative"]
    assert [len(d) for d in seen["incremental"].values()] == [9, 3, 3, 5, 4]


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
        await wait_idle(d, timeout=0.2 + QUARANTINE_GRACE_S + 10.0)  # (a deadline for a hang)
        assert run.outputs == []
    finally:
        await d.shutdown()
        await p.shutdown()


# --- logprobs through the decode handler; the mock's sampling parameters --------------------------


def lp(tok: int) -> TokenLogprobs:
    return TokenLogprobs(tok, -0.1 * tok, [(tok, -0.1 * tok)])


def test_cumulative_logprobs_are_sliced_with_their_ids():
    m = DeltaMaker("r", "cumulative")
    ids, lps = [1, 2], [lp(1), lp(2)]
    d1 = m.make(EngineOutput("r", ids, None, 3, 2, logprobs=lps))
    ids.append(3)
    lps.append(lp(3))  # a live list grew after the output was made
    ids.append(4)
    lps.append(lp(4))
    assert d1 is not None and d1.logprobs == [lp(1), lp(2)]
    d2 = m.make(EngineOutput("r", ids, "length", 3, 4, logprobs=lps))
    assert d2 is not None and d2.token_ids == [3, 4] and d2.logprobs == [lp(3), lp(4)]
    assert d2.logprobs is not lps  # the delta owns its list (merging extends it in place)
    d2.extend(d1)
    assert lps == [lp(1), lp(2), lp(3), lp(4)]


def test_incremental_logprobs_pass_through():
    m = DeltaMaker("r", "incremental")
    assert m.make(EngineOutput("r", [7], None, 1, 1, logprobs=[lp(7)])).logprobs == [lp(7)]
    last = m.make(EngineOutput("r", [], "length", 1, 1, logprobs=[]))
    assert last is not None and last.token_ids == [] and last.logprobs == []
    plain = DeltaMaker("q", "incremental").make(EngineOutput("q", [5], None, 1, 1))
    assert plain is not None and plain.logprobs is None


def test_logprobs_out_of_step_with_ids_are_an_error():
    m = DeltaMaker("r", "incremental")
    with pytest.raises(EngineError):
        m.make(EngineOutput("r", [1, 2], None, 1, 2, logprobs=[lp(1)]))


async def mock_ids(eng, prompt, **sampling) -> list[int]:
    sp = SamplingParams(**{"max_tokens": 6, "ignore_eos": True, **sampling})
    return (await finished(Recorder(eng).submit(eng, "r", prompt, sp))).ids


async def test_mock_sampling_parameters_have_their_documented_effects(mock_dir):
    eng = MockEngine(mock_dir, page_size=4, num_pages=64)
    await eng.start()
    try:
        prompt, t = [1, 2, 3], 42
        natural = [mock_token(prompt, i, 500, frozenset({2})) for i in range(6)]
        assert await mock_ids(eng, prompt) == natural
        assert await mock_ids(eng, prompt, logit_bias={t: 11.0}) == [t] * 6  # above NATURAL_LOGIT
        assert await mock_ids(eng, prompt, logit_bias={t: 9.0}) == natural
        # A penalty stops the repetition the bias causes: presence once, frequency 0.5 twice.
        assert await mock_ids(eng, prompt, logit_bias={t: 11.0}, presence_penalty=2.0) == \
            [t, *natural[1:]]
        assert await mock_ids(eng, prompt, logit_bias={t: 11.0}, frequency_penalty=0.5) == \
            [t, t, *natural[2:]]
        assert await mock_ids(eng, prompt, logit_bias={t: 11.0}, repetition_penalty=1.2) == \
            [t, *natural[1:]]
        assert await mock_ids(eng, [t, 7], logit_bias={t: 11.0}, repetition_penalty=1.2) == \
            [mock_token([t, 7], i, 500, frozenset({2})) for i in range(6)]  # seen in the prompt
        # Pushing the natural token down lets the next id that is not EOS through.
        down = await mock_ids(eng, prompt, logit_bias={natural[0]: -20.0}, max_tokens=1)
        assert down == [(natural[0] + 1) % 500 if (natural[0] + 1) % 500 != 2 else 3]
        assert await mock_ids(eng, prompt, min_p=1.0, temperature=1.0) == natural  # no effect
    finally:
        await eng.shutdown()


async def test_mock_logprobs_are_its_toy_models(mock_dir):
    eng = MockEngine(mock_dir, page_size=4, num_pages=64)
    await eng.start()
    try:
        prompt = [1, 2, 3]
        run = await finished(Recorder(eng).submit(eng, "r", prompt, SamplingParams(
            max_tokens=4, logprobs=3, logit_bias={42: 11.0}, presence_penalty=2.0)))
        log_z = math.log(math.exp(NATURAL_LOGIT) + 499)
        natural = [mock_token(prompt, i, 500, frozenset({2})) for i in range(4)]
        assert run.ids == [42, *natural[1:]]
        first = run.logprobs[0]  # raw: the bias does not show
        assert first.token_id == 42 and first.logprob == pytest.approx(-log_z)
        assert first.top[0] == (natural[0], pytest.approx(NATURAL_LOGIT - log_z))
        assert [tok for tok, _ in first.top[1:]] == [t for t in (0, 1, 2) if t != natural[0]][:2]
        assert all(lp.logprob == pytest.approx(NATURAL_LOGIT - log_z) for lp in run.logprobs[1:])
    finally:
        await eng.shutdown()
