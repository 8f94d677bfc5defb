"""The engine contract, checked the same way for every engine in engines.ENGINES: lifecycle,
refusal at submit, outputs that add up (`offset + len == completion_tokens`) in both output modes,
one sink call per step, cancel, shutdown, and PD decode continuing the prefill exactly. Every
scenario ends with every page free and the page accounting intact."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tandem.engines.base import EngineError, EngineRequest, EngineRequestError
from tandem.runtime.wire import Load, SamplingParams
from tests.conformance.engines import Make, PdLink
from tests.conformance.harness import Recorder, Run, finished, generate, wait_idle

GREEDY: dict[str, Any] = {"temperature": 0.0}
PROMPTS = [[0, 5, 100, 200, 7, 900], [0, 17], [3, 2, 1, 4, 1023, 8, 9], [0, *range(300, 320)]]


async def test_lifecycle(make: Make) -> None:
    engine = await make(start=False)
    with pytest.raises(EngineError):  # not started: no work taken
        engine.submit(EngineRequest("early", [1, 2], SamplingParams()), Recorder(engine))
    await engine.shutdown()  # never started: safe, and safe twice
    await engine.shutdown()
    engine = await make()
    run = await generate(engine, "r", [1, 2, 3], max_tokens=3, **GREEDY)
    assert run.finish == "length" and len(run.ids) == 3
    await wait_idle(engine)
    await engine.shutdown()
    await engine.shutdown()
    with pytest.raises(EngineError):  # shut down: no work taken
        engine.submit(EngineRequest("late", [1, 2], SamplingParams()), Recorder(engine))


async def test_shutdown_after_a_failed_start(make: Make) -> None:
    engine = await make("broken", start=False)
    with pytest.raises(EngineError):
        await engine.start()
    await engine.shutdown()
    await engine.shutdown()


async def test_refusals_are_raised_at_once_and_hold_nothing(make: Make) -> None:
    engine = await make()
    sink = Recorder(engine)
    too_long = list(range(4, 4 + engine.spec.max_context))
    for prompt, sp in ((too_long, SamplingParams()), ([], SamplingParams()),
                       ([1, 2], SamplingParams(max_tokens=10_000 * engine.num_pages))):
        with pytest.raises(EngineRequestError):
            sink.submit(engine, f"bad{len(sink.runs)}", prompt, sp)
    await asyncio.sleep(0.05)
    assert sink.calls == 0
    await wait_idle(engine, timeout=0.1)
    assert (await generate(engine, "ok", [1, 2], max_tokens=2)).finish == "length"


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
async def test_outputs_add_up_and_come_once_per_step(make: Make, mode: str) -> None:
    engine = await make(output_mode=mode, num_pages=128)
    sink = Recorder(engine)
    n = 24
    runs = [sink.submit(engine, f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY))
            for i, p in enumerate(PROMPTS)]
    assert sink.calls == 0  # nothing is delivered before submit returns
    for run in runs:
        await finished(run)
        assert run.finish == "length" and run.error is None and len(run.ids) == n
        assert [o[2] for o in run.outputs] == list(range(1, n + 1))  # one token per step
    # Batched: one call per engine step for all requests, not one per request per step.
    assert sink.calls < n + 2 * len(PROMPTS)
    assert sink.threads == {threading.get_ident()}  # on the event loop thread
    again = [await generate(engine, f"a{i}", p, max_tokens=n, ignore_eos=True, **GREEDY)
             for i, p in enumerate(PROMPTS)]
    assert [a.ids for a in again] == [r.ids for r in runs]  # the same alone as batched
    await wait_idle(engine)


async def test_both_output_modes_give_the_same_tokens(make: Make) -> None:
    cum, inc = await make(output_mode="cumulative"), await make(output_mode="incremental")
    sp = {"max_tokens": 12, "temperature": 0.7, "seed": 5, "ignore_eos": True}
    a = await generate(cum, "c", PROMPTS[0], **sp)
    b = await generate(inc, "i", PROMPTS[0], **sp)
    assert a.ids == b.ids and len(a.ids) == 12
    for ids, _, n in a.outputs:  # cumulative: each output extends the one before
        assert len(ids) == n
    for e in (cum, inc):
        await wait_idle(e)


# The cancel and shutdown tests act from inside the sink (Run.on_output) at a known output, never
# after a sleep: a mock or SGLang-fake step costs one event-loop pass, so even a 1 ms sleep can wake
# after the request has ended. On those loop-driven engines nothing steps between an output and
# what its callback does. The reference engine steps on its own thread and may be a few steps ahead
# of the loop, but each test acts with 59 or more of the request's steps (milliseconds each) to go.
async def test_cancel_frees_pages_and_silences_the_sink(make: Make) -> None:
    engine = await make(num_pages=300)
    sink = Recorder(engine)
    sp = SamplingParams(max_tokens=1000, ignore_eos=True, **GREEDY)
    long = sink.submit(engine, "long", PROMPTS[0], sp)
    other = sink.submit(engine, "other", PROMPTS[1],
                        SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY))
    held: list[bool] = []

    def cancel_at_the_third(run: Run) -> None:  # `long` has 997 tokens to go
        if len(run.outputs) == 3:
            held.append(engine.load().pages_free < engine.num_pages)
            assert run.handle is not None
            run.handle.cancel()

    long.on_output = cancel_at_the_third
    await finished(other)  # 57 steps went on; the cancelled request got nothing more
    assert held == [True]
    assert len(long.outputs) == 3 and long.finish is None
    assert long.handle is not None
    long.handle.cancel()  # twice is harmless
    await wait_idle(engine)


async def test_cancel_a_request_waiting_for_pages(make: Make) -> None:
    engine = await make(num_pages=20)  # one request's worth of pages (4 tokens each)
    sink = Recorder(engine)
    sp = SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY)
    first = sink.submit(engine, "first", [1, 2, 3], sp)
    second = sink.submit(engine, "second", [1, 2, 3], sp)
    loads: list[Load] = []

    def cancel_second(run: Run) -> None:  # on `first`'s first output: it has 59 tokens to go
        if len(run.outputs) == 1:
            loads.append(engine.load())
            assert second.handle is not None
            second.handle.cancel()

    first.on_output = cancel_second
    await finished(first)
    assert [(load.running, load.waiting) for load in loads] == [(1, 1)]  # `second` was waiting
    assert first.finish == "length" and len(first.ids) == 60
    await wait_idle(engine)
    assert second.outputs == []  # (checked once idle: nothing can still come)


async def test_shutdown_ends_requests_with_abort(make: Make) -> None:
    engine = await make()
    sink = Recorder(engine)
    run = sink.submit(engine, "r", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    started = asyncio.Event()
    run.on_output = lambda _: started.set()
    await started.wait()  # one loop pass after the first output: 199 tokens to go
    await engine.shutdown()
    assert run.finish == "abort" and run.done.is_set()
    assert engine.load().pages_free == engine.num_pages


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
async def test_pd_decode_continues_the_prefill_exactly(make: Make, mode: str) -> None:
    link = PdLink()
    agg = await make(output_mode=mode, num_pages=128)
    prefill = await make("prefill", link=link, output_mode=mode, num_pages=128)
    decode = await make("decode", link=link, output_mode=mode, num_pages=128)
    cases = [(p, {"max_tokens": 9, **(GREEDY if i % 2 else {"temperature": 0.8, "seed": i})})
             for i, p in enumerate(PROMPTS)]
    for i, (prompt, kw) in enumerate(cases):
        want = await generate(agg, f"a{i}", prompt, **kw)
        b = link.bootstrap()
        sp = SamplingParams(**kw)
        p_run = Recorder(prefill).submit(prefill, f"pd{i}", prompt, sp, b)
        d_run = Recorder(decode).submit(decode, f"pd{i}", prompt, sp, b)
        await finished(p_run)
        await finished(d_run)
        assert p_run.finish == "length", p_run.error
        assert p_run.ids == want.ids[:1], (d_run.error, d_run.ids, want.ids)
        assert len(p_run.outputs) == 1
        assert d_run.outputs[0][0] == want.ids[:1]  # the first token goes out on its own
        assert d_run.ids == want.ids and d_run.finish == want.finish
    for e in (agg, prefill, decode):
        await wait_idle(e)
