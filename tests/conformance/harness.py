"""What conformance (and engine) tests share: a recording OutputSink that runs every output
through the worker's DeltaMaker, and the idle/page checks every scenario ends with."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engines.base import Engine, EngineError, EngineOutput, EngineRequest, Handle
from tandem.runtime.wire import Bootstrap, SamplingParams, TokenLogprobs
from tandem.worker.deltas import DeltaMaker


@dataclass
class Run:
    """One request as its sink saw it."""

    rid: str
    ids: list[int] = field(default_factory=list)  # the tokens, as the deltas carried them
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # theirs, when asked for
    outputs: list[tuple[list[int], str | None, int]] = field(default_factory=list)
    finish: str | None = None
    cached: int = 0  # the last output's cached_tokens
    error: EngineError | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    handle: Handle | None = None
    # Called with this run after each output is recorded, inside the sink's on_step: a test acts
    # there at a known point of the run, not after a sleep that a fast engine can outrun. (An
    # IteratorEngine logs and swallows what on_step raises: record there, assert after.)
    on_output: Callable[[Run], None] | None = None


class Recorder:
    """An OutputSink: checks `offset + len == completion_tokens` on every output (DeltaMaker), and
    that logprobs match their tokens one for one, and records what each request got, the number of
    on_step calls, and the threads they came on."""

    def __init__(self, engine: Engine) -> None:
        self.mode = engine.output_mode
        self.runs: dict[str, Run] = {}
        self.makers: dict[str, DeltaMaker] = {}
        self.calls = 0
        self.threads: set[int] = set()

    def expect(self, rid: str) -> Run:
        run = self.runs[rid] = Run(rid)
        self.makers[rid] = DeltaMaker(rid, self.mode)
        return run

    def on_step(self, outputs: list[EngineOutput]) -> None:
        self.calls += 1
        self.threads.add(threading.get_ident())
        for out in outputs:
            run = self.runs[out.rid]
            self._record(run, out)
            if run.on_output is not None:
                run.on_output(run)

    def _record(self, run: Run, out: EngineOutput) -> None:
        assert run.finish is None, f"{out.rid}: an output after its last one"
        n = out.completion_tokens
        ids = list(out.output_ids[:n]) if self.mode == "cumulative" else list(out.output_ids)
        run.outputs.append((ids, out.finish_reason, n))
        if out.error is not None:
            assert out.finish_reason == "error"
            run.error, run.finish = out.error, "error"
            run.done.set()
            return
        delta = self.makers[out.rid].make(out)  # raises when out of step
        if delta is not None:
            assert delta.offset + len(delta.token_ids) == n
            run.ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                assert len(delta.logprobs) == len(delta.token_ids)
                assert [lp.token_id for lp in delta.logprobs] == delta.token_ids
                run.logprobs.extend(delta.logprobs)
        if out.finish_reason is not None:
            run.finish, run.cached = out.finish_reason, out.cached_tokens
            run.done.set()

    def submit(self, engine: Engine, rid: str, prompt: list[int], sp: SamplingParams,
               bootstrap: Bootstrap | None = None) -> Run:
        run = self.expect(rid)
        run.handle = engine.submit(EngineRequest(rid, list(prompt), sp, bootstrap), self)
        return run


async def finished(run: Run, timeout: float = 30.0) -> Run:
    await asyncio.wait_for(run.done.wait(), timeout)
    return run


async def generate(engine: Engine, rid: str, prompt: list[int], timeout: float = 30.0,
                   **sampling: object) -> Run:
    """Submit one request with a sink of its own and wait for its last output."""
    return await finished(Recorder(engine).submit(engine, rid, prompt,
                                                  SamplingParams(**sampling)), timeout)  # type: ignore[arg-type]


async def wait_idle(engine: Engine, timeout: float = 5.0) -> None:
    """Every page comes back (within `timeout`), nothing runs or waits, and the pool's
    invariant holds."""
    deadline = time.monotonic() + timeout
    while True:
        load = engine.load()
        if load.running == load.waiting == 0 and load.pages_free == load.pages_total:
            break
        assert time.monotonic() < deadline, f"{engine.name} engine not idle: {load}"
        await asyncio.sleep(0.005)
    assert load.pages_reserved == 0
    pool = getattr(engine, "pool", None)
    if pool is not None:
        pool.check()
        assert pool.owners() == []
