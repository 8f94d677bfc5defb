"""IteratorEngine on its own: per-request iterators become one on_step call per loop pass per sink;
errors become one "error" output; a refusal raised before the first output is an
EngineRequestError; cancel and shutdown leave no task and no output behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tandem.engines.base import EngineError, EngineOutput, EngineRequest, EngineRequestError
from tandem.engines.iterator import IteratorEngine
from tandem.runtime.wire import SamplingParams
from tests.conformance.harness import Recorder, finished


class Lockstep(IteratorEngine):
    """Every request yields one incremental token per loop pass; prompt[0] picks a behaviour:
    1 = raise ValueError before the first output, 2 = raise after two, 3 = end with no finish."""

    name = "lockstep"
    output_mode = "incremental"

    async def start(self) -> None:
        self._mark_started()

    async def _stream(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        kind = req.prompt_ids[0]
        if kind == 1:
            raise ValueError("prompt too long for this engine")
        for i in range(req.sampling.max_tokens):
            await asyncio.sleep(0)
            if kind == 2 and i == 2:
                raise RuntimeError("device lost")
            if kind == 3 and i == 2:
                return
            last = i + 1 == req.sampling.max_tokens
            yield EngineOutput(req.rid, [100 + i], "length" if last else None, 1, i + 1)


class Sink(Recorder):
    def __init__(self, engine: IteratorEngine) -> None:
        super().__init__(engine)
        self.batches: list[list[str]] = []

    def on_step(self, outputs: list[EngineOutput]) -> None:
        self.batches.append([o.rid for o in outputs])
        super().on_step(outputs)


async def started() -> Lockstep:
    engine = Lockstep()
    await engine.start()
    return engine


async def test_one_on_step_per_pass_per_sink_with_every_output() -> None:
    engine = await started()
    a, b = Sink(engine), Sink(engine)
    runs = [s.submit(engine, f"{name}{i}", [0], SamplingParams(max_tokens=5))
            for s, name in ((a, "a"), (b, "b")) for i in range(4)]
    assert a.calls == b.calls == 0  # never before submit returned (nor in the same pass)
    for run in runs:
        assert (await finished(run)).ids == [100, 101, 102, 103, 104]
    assert a.calls == b.calls == 5  # 4 requests x 5 tokens, in lockstep: 5 calls per sink
    assert all(sorted(batch) == ["a0", "a1", "a2", "a3"] for batch in a.batches)
    await engine.shutdown()


async def test_refusal_from_the_first_anext_is_an_engine_request_error() -> None:
    engine = await started()
    run = await finished(Recorder(engine).submit(engine, "r", [1], SamplingParams()))
    assert run.finish == "error" and type(run.error) is EngineRequestError
    assert "too long" in str(run.error)
    await engine.shutdown()


async def test_a_failure_mid_stream_is_one_error_output_after_what_was_sent() -> None:
    engine = await started()
    rec = Recorder(engine)
    run = await finished(rec.submit(engine, "r", [2], SamplingParams(max_tokens=9)))
    assert run.ids == [100, 101] and run.finish == "error"
    assert type(run.error) is EngineError and "device lost" in str(run.error)
    assert run.outputs[-1] == ([], "error", 2)  # the count delivered so far, no new id
    run2 = await finished(rec.submit(engine, "s", [3], SamplingParams(max_tokens=9)))
    assert run2.finish == "error" and "without a finish" in str(run2.error)
    assert engine.load().running == 0
    await engine.shutdown()


async def test_cancel_drops_outputs_not_yet_delivered_and_the_task() -> None:
    engine = await started()
    rec = Sink(engine)
    run = rec.submit(engine, "r", [0], SamplingParams(max_tokens=1000))
    other = rec.submit(engine, "o", [0], SamplingParams(max_tokens=3))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # "r" has an output gathered, its delivery not yet run
    assert engine.num_undelivered
    run.handle.cancel()  # type: ignore[union-attr]
    seen = len(run.outputs)
    await finished(other)
    await asyncio.sleep(0.01)
    assert len(run.outputs) == seen and run.finish is None
    assert engine.load().running == 0 and not engine.num_tasks
    with pytest.raises(EngineRequestError):  # a duplicate rid in flight is refused at once
        rec.submit(engine, "o2", [0], SamplingParams(max_tokens=100))
        rec.submit(engine, "o2", [0], SamplingParams())
    await engine.shutdown()
    await engine.shutdown()
    assert not engine.num_tasks


async def test_submit_before_start_and_after_fail_all_is_refused() -> None:
    engine = Lockstep()
    with pytest.raises(EngineError):
        engine.submit(EngineRequest("r", [0], SamplingParams()), Recorder(engine))
    await engine.start()
    rec = Recorder(engine)
    run = rec.submit(engine, "r", [0], SamplingParams(max_tokens=1000))
    await asyncio.sleep(0.001)
    engine.fail_all(EngineError("the library died"))
    await finished(run)
    assert run.finish == "error" and "died" in str(run.error)
    with pytest.raises(EngineError, match="died"):
        engine.submit(EngineRequest("s", [0], SamplingParams()), rec)
    await engine.shutdown()
