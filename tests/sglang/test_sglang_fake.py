"""The SGLang adapter over a fake `sglang.Engine` that reproduces SGLang's stream shapes and edges:
tokens exact in both output modes (offsets checked by the worker's DeltaMaker), aborts, PD, crashes,
cancellation and shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from tandem.engines.base import EngineError, EngineOutput, EngineRequest, EngineRequestError
from tandem.engines.sglang import SGLangEngine, SGLangOptions, SGLangSetupError
from tandem.runtime.wire import Bootstrap, SamplingParams, TokenLogprobs
from tests.conformance.harness import Recorder, finished
from tests.sglang.fake_sglang import World, fake_server_args, logprob, token, top

PROMPT = [5, 6, 7, 8]
MODES = ["cumulative", "incremental"]


class Raw(Recorder):
    """A Recorder that also keeps each output as delivered (before any later mutation)."""

    def __init__(self, engine: SGLangEngine) -> None:
        super().__init__(engine)
        self.raw: list[EngineOutput] = []
        self.live_grew = 0  # outputs whose live list had grown past completion_tokens

    def on_step(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            if self.mode == "cumulative" and len(out.output_ids) > out.completion_tokens:
                self.live_grew += 1
            self.raw.append(EngineOutput(out.rid, list(out.output_ids), out.finish_reason,
                                         out.prompt_tokens, out.completion_tokens,
                                         out.cached_tokens, out.error))
        super().on_step(outputs)


async def make(world: World, role: str = "agg", mode: str = "cumulative",
               fatal: list[str] | None = None, **opts: object) -> SGLangEngine:
    engine = SGLangEngine(
        SGLangOptions(model="/models/tiny", role=role, output_mode=mode,  # type: ignore[arg-type]
                      **opts),  # type: ignore[arg-type]
        engine_factory=world.factory, server_args_builder=fake_server_args,
        on_fatal=(fatal if fatal is not None else []).append)
    await engine.start()
    return engine


def expected(n: int, prompt: list[int] = PROMPT) -> list[int]:
    return [token(prompt, i) for i in range(n)]


async def idle(engine: SGLangEngine) -> None:
    for _ in range(100):
        if engine.load().running == 0 and not engine.num_tasks:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"not idle: {engine.load()} tasks={engine.num_tasks}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_step", [1, 3])
async def test_stream_is_token_exact(mode: str, per_step: int) -> None:
    world = World(tokens_per_step=per_step)
    engine = await make(world, mode=mode)
    rec = Raw(engine)
    run = await finished(rec.submit(engine, "a", PROMPT, SamplingParams(max_tokens=10)))
    assert run.ids == expected(10) and run.finish == "length"
    last = rec.raw[-1]
    assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (4, 10, 0)
    if per_step == 3:  # the final item carries several ids (10 = 3+3+3+1)
        assert len(run.outputs[-1][0]) == (10 if mode == "cumulative" else 1)
        assert [n for _, _, n in run.outputs] == [3, 6, 9, 10]
    await engine.shutdown()


async def test_live_list_mutated_after_the_yield_changes_nothing_sent() -> None:
    world = World()
    engine = await make(world, mode="cumulative")
    rec = Raw(engine)
    run = await finished(rec.submit(engine, "a", PROMPT, SamplingParams(max_tokens=20)))
    assert rec.live_grew > 0, "the fake should have grown the live list before delivery"
    assert run.ids == expected(20)
    await engine.shutdown()


@pytest.mark.parametrize("mode", MODES)
async def test_missing_usage_fields_and_empty_items(mode: str) -> None:
    world = World(drop_usage=True, empty_items=True)
    engine = await make(world, mode=mode)
    rec = Raw(engine)
    run = await finished(rec.submit(engine, "a", PROMPT, SamplingParams(max_tokens=6)))
    assert run.ids == expected(6)
    assert all(out.finish_reason or out.output_ids for out in rec.raw), "an empty item got out"
    assert (rec.raw[-1].prompt_tokens, rec.raw[-1].completion_tokens) == (4, 6)
    await engine.shutdown()


def expected_logprobs(ids: list[int], k: int) -> list[TokenLogprobs]:
    return [TokenLogprobs(t, logprob(t), [(i, lp) for lp, i, _ in top(t, k)]) for t in ids]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("k", [0, 2])
async def test_logprobs_follow_their_tokens_in_both_modes(mode: str, per_step: int,
                                                          k: int) -> None:
    """SGLang's logprob lists are cumulative (live) or the item's own: either way each token gets
    its own, with its top-k (the Recorder checks the ids match one for one)."""
    world = World(tokens_per_step=per_step, step_s=0.001)
    engine = await make(world, mode=mode)
    rec = Recorder(engine)
    run = await finished(rec.submit(engine, "a", PROMPT, SamplingParams(max_tokens=10,
                                                                        logprobs=k)))
    assert run.ids == expected(10)
    assert run.logprobs == expected_logprobs(run.ids, k)
    await engine.shutdown()


async def test_incremental_abort_echo_carries_no_extra_logprob() -> None:
    """The abort echo's logprobs are every token's: the adapter takes none of them (its ids are
    trimmed to none), so the logprobs stay one per token."""
    world = World(step_s=0.002)
    engine = await make(world, mode="incremental")
    rec = Recorder(engine)
    seen = asyncio.Event()
    run = rec.submit(engine, "a", PROMPT, SamplingParams(max_tokens=1000, logprobs=1))
    run.on_output = lambda r: seen.set() if len(r.ids) >= 3 else None
    await asyncio.wait_for(seen.wait(), 10)
    fake = world.engines[0]
    (srid,) = fake.reqs
    fake.tokenizer_manager.abort_request(rid=srid)
    await finished(run)
    assert run.finish == "error" and run.ids == expected(len(run.ids))
    assert run.logprobs == expected_logprobs(run.ids, 1)
    await idle(engine)
    await engine.shutdown()


async def test_incremental_abort_echo_yields_no_duplicate() -> None:
    world = World(step_s=0.002)
    engine = await make(world, mode="incremental")
    rec = Raw(engine)
    run = rec.submit(engine, "a", PROMPT, SamplingParams(max_tokens=1000))
    while len(run.ids) < 3:
        await asyncio.sleep(0.001)
    fake = world.engines[0]
    (srid,) = fake.reqs
    fake.tokenizer_manager.abort_request(rid=srid)  # SGLang ends it, not tandem: the echo comes
    await finished(run)
    n = rec.raw[-1].completion_tokens
    assert run.ids == expected(n) and len(set(run.ids)) == len(run.ids)
    assert run.finish == "error" and type(run.error) is EngineError
    assert rec.raw[-1].prompt_tokens == 4  # the echo lacks it; the last value seen is kept
    await idle(engine)
    await engine.shutdown()


async def test_what_sglang_refuses_or_crashes_on_is_refused_at_submit() -> None:
    world = World()
    engine = await make(world)
    for prompt, sp in (([], SamplingParams()), ([1] * 4096, SamplingParams()),
                       ([5, 5000], SamplingParams()),  # out of the vocabulary: SGLang would crash
                       ([1] * 4000, SamplingParams(max_tokens=500))):  # SGLang's own limits
        with pytest.raises(EngineRequestError):  # checked at submit, before anything is held
            engine.submit(EngineRequest("bad", prompt, sp), Recorder(engine))
    await idle(engine)
    await engine.shutdown()


@pytest.mark.parametrize(("sampling", "param"), [({"min_tokens": 2}, "min_tokens"),
                                                 ({"seed": 7}, "seed"),
                                                 ({"json_schema": "{}"}, "json_schema"),
                                                 ({"regex": "a+"}, "regex")])
async def test_sampling_sglang_cannot_honour_is_refused_naming_it(sampling: dict[str, int],
                                                                  param: str) -> None:
    engine = await make(World())
    with pytest.raises(EngineRequestError) as e:
        engine.submit(EngineRequest("a", PROMPT, SamplingParams(**sampling)),  # type: ignore[arg-type]
                      Recorder(engine))
    assert e.value.param == param and param in str(e.value)
    assert engine.load().running == 0
    await engine.shutdown()


async def test_seed_is_passed_when_deterministic_inference_is_on() -> None:
    world = World()
    engine = await make(world, engine_args=("--enable-deterministic-inference",))
    run = await finished(Recorder(engine).submit(engine, "a", PROMPT,
                                                 SamplingParams(max_tokens=2, seed=7, top_k=0)))
    assert run.ids == expected(2)
    await engine.shutdown()


async def test_fixed_length_rids_make_prefix_aborts_safe() -> None:
    world = World(step_s=0.001)
    engine = await make(world)
    fake = world.engines[0]
    rec = Recorder(engine)
    rids = ["r1", "r10", "r100", "r1000", "r2", "r20"]  # tandem rids that prefix each other
    runs = [rec.submit(engine, rid, PROMPT, SamplingParams(max_tokens=30)) for rid in rids]
    while len(fake.reqs) < len(rids):
        await asyncio.sleep(0.001)
    srids = list(fake.reqs)
    assert all(len(r) == 32 and int(r, 16) >= 0 for r in srids), srids  # 32 hex: one length
    assert not any(a != b and b.startswith(a) for a in srids for b in srids)
    runs[0].handle.cancel()  # type: ignore[union-attr]  # "r1": would abort r10, r100, r1000
    for run in runs[1:]:
        assert (await finished(run)).ids == expected(30)
    assert world.aborts == [srids[0]] and runs[0].finish is None
    await engine.shutdown()


async def test_the_fake_matches_abort_rids_by_prefix_like_sglang() -> None:
    world = World(step_s=0.001)
    engine = await make(world)
    fake = world.engines[0]
    gens = [await fake.async_generate(input_ids=PROMPT, sampling_params={}, stream=True, rid=r)
            for r in ("req-1", "req-10")]
    firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
    await asyncio.gather(*firsts)
    fake.tokenizer_manager.abort_request(rid="req-1")
    for g in gens:
        items = [item async for item in g]
        assert items[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    await engine.shutdown()


@pytest.mark.parametrize("mode", MODES)
async def test_pd_pair_streams_what_agg_streams(mode: str) -> None:
    world = World()
    prefill = await make(world, "prefill", mode, bootstrap_port=9123, advertise_host="10.0.0.7")
    decode = await make(world, "decode", mode)
    assert prefill.bootstrap_addr == "10.0.0.7:9123" and decode.bootstrap_addr == ""
    boot = Bootstrap("10.0.0.7", 9123, 42)
    sp = SamplingParams(max_tokens=8)
    d = Recorder(decode).submit(decode, "a", PROMPT, sp, boot)
    p = Recorder(prefill).submit(prefill, "a", PROMPT, sp, boot)
    assert (await finished(p)).finish == "length" and len(p.outputs) == 1
    assert (await finished(d)).ids == expected(8)  # the decode stream starts with the first token
    await prefill.shutdown()
    await decode.shutdown()


async def test_prefill_failure_fails_the_decode_side_cleanly() -> None:
    world = World(fail_rooms={7})
    prefill = await make(world, "prefill", bootstrap_port=9124)
    decode = await make(world, "decode")
    boot = Bootstrap("127.0.0.1", 9124, 7)
    d = Recorder(decode).submit(decode, "a", PROMPT, SamplingParams(), boot)
    p = Recorder(prefill).submit(prefill, "a", PROMPT, SamplingParams(), boot)
    for run in (await finished(p), await finished(d)):
        assert run.finish == "error" and type(run.error) is EngineError and run.ids == []
        assert "KV transfer failed" in str(run.error)
    await idle(prefill)
    await idle(decode)
    with pytest.raises(EngineRequestError):  # a PD request needs its room
        decode.submit(EngineRequest("b", PROMPT, SamplingParams()), Recorder(decode))
    await prefill.shutdown()
    await decode.shutdown()


async def test_scheduler_crash_fails_every_request_and_stops_the_worker() -> None:
    world = World(step_s=0.002)
    fatal: list[str] = []
    engine = await make(world, fatal=fatal)
    rec = Recorder(engine)
    runs = [rec.submit(engine, f"r{i}", PROMPT, SamplingParams(max_tokens=3000))
            for i in range(5)]
    while not all(r.ids for r in runs):
        await asyncio.sleep(0.001)
    world.crash()
    for run in runs:
        await finished(run, timeout=1)
        assert run.finish == "error" and "scheduler" in str(run.error)
    assert fatal and "scheduler" in fatal[0]
    with pytest.raises(EngineError):
        engine.submit(EngineRequest("late", PROMPT, SamplingParams()), rec)
    await idle(engine)
    await engine.shutdown()


async def test_cancel_stops_outputs_and_leaves_no_task() -> None:
    world = World(step_s=0.001)
    engine = await make(world, mode="incremental")
    rec = Recorder(engine)
    runs = [rec.submit(engine, f"c{i}", PROMPT, SamplingParams(max_tokens=3000))
            for i in range(3)]  # e.g. the n=3 choices of one request, fanned out
    while not all(r.ids for r in runs):
        await asyncio.sleep(0.001)
    counts = []
    for run in runs:
        run.handle.cancel()  # type: ignore[union-attr]
        counts.append(len(run.outputs))
    await asyncio.sleep(0.02)
    assert [len(r.outputs) for r in runs] == counts and all(r.finish is None for r in runs)
    assert sorted(world.aborts) == sorted(set(world.aborts)) and len(world.aborts) == 3
    await idle(engine)
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("sglang:")]
    runs[0].handle.cancel()  # type: ignore[union-attr]  # again: nothing happens
    await engine.shutdown()


async def test_shutdown_twice_mid_stream_and_refuses_work_after() -> None:
    world = World(step_s=0.001)
    engine = await make(world)
    rec = Recorder(engine)
    run = rec.submit(engine, "a", PROMPT, SamplingParams(max_tokens=3000))
    while not run.ids:
        await asyncio.sleep(0.001)
    await engine.shutdown()
    n = len(run.outputs)
    await engine.shutdown()
    await asyncio.sleep(0.01)
    assert len(run.outputs) == n and engine.load().running == 0 and not engine.num_tasks
    with pytest.raises(EngineError):
        engine.submit(EngineRequest("b", PROMPT, SamplingParams()), rec)


async def test_failed_start_then_shutdown_twice() -> None:
    def broken(server_args: object) -> object:
        raise RuntimeError("CUDA out of memory")

    engine = SGLangEngine(SGLangOptions(model="/m"), engine_factory=broken,
                          server_args_builder=fake_server_args)
    with pytest.raises(EngineError, match="out of memory"):
        await engine.start()
    await engine.shutdown()
    await engine.shutdown()
    with pytest.raises(EngineError):
        engine.submit(EngineRequest("a", PROMPT, SamplingParams()), Recorder(engine))


async def test_sglang_not_installed_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", None)
    engine = SGLangEngine(SGLangOptions(model="/m"), engine_factory=World().factory)
    with pytest.raises(SGLangSetupError, match=r"pip install 'tandem\[sglang\]'.*CUDA"):
        await engine.start()
    await engine.shutdown()


async def test_shutdown_kills_only_what_sglang_started() -> None:
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        world = World(spawn_child=True)
        engine = await make(world)
        child = world.engines[0].child
        assert child is not None and child.poll() is None
        await engine.shutdown()
        assert child.wait(timeout=10) is not None
        assert mine.poll() is None, "shutdown killed a process SGLang did not start"
    finally:
        mine.kill()
        mine.wait()


async def test_sglang_sigterm_handler_hands_the_signal_to_tandems_drain() -> None:
    world = World()
    engine = await make(world)
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, got.set)
    try:
        world.engines[0].tokenizer_manager.handlers.sigterm_handler()
        await asyncio.wait_for(got.wait(), 2)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    assert os.getpid()  # still alive
    await engine.shutdown()

