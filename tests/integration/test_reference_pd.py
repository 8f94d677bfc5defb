"""Disaggregated prefill/decode with the reference engine, in one process: a prefill engine and a
decode engine, each with its own KV, a real PrefillSide on a loopback port and a real DecodeSide,
both over NixlMover (two NIXL agents in this process, UCX tcp+cma), plus an aggregated engine for
reference. The proof: P+D output ids equal the aggregated ones, token for token, greedy and
seeded, alone and 8 at a time; every page comes back on every engine, failures and aborts
included, and pages a transfer may still write into come back only when the fetch releases them.
"""

from __future__ import annotations

import os

for _k, _v in {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}.items():
    os.environ.setdefault(_k, _v)  # before nixl is imported (by NixlMover)

import asyncio  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncIterator, Awaitable, Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("nixl")

from tandem.engines.base import EngineError, EngineOutput, EngineRequest  # noqa: E402
from tandem.engines.reference import ReferenceEngine, write_tiny_model  # noqa: E402
from tandem.kv.handoff import QUARANTINE_GRACE_S, DecodeSide, PrefillSide  # noqa: E402
from tandem.kv.movers import NixlMover  # noqa: E402
from tandem.runtime.wire import Bootstrap, SamplingParams  # noqa: E402

HOST = "127.0.0.1"
PAGE = 4
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path, seed=0)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


async def wait_idle(engine: ReferenceEngine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        load = engine.load()
        if load.running == load.waiting == 0 and load.pages_free == load.pages_total:
            break
        assert time.monotonic() < deadline, f"engine not idle: {load}"
        await asyncio.sleep(0.005)
    assert load.pages_reserved == 0
    engine.pool.check()
    assert engine.pool.owners() == []


@dataclass
class Cluster:
    p: ReferenceEngine
    d: ReferenceEngine
    port: int
    rooms: int = 0

    def bootstrap(self) -> Bootstrap:
        self.rooms += 1
        return Bootstrap(HOST, self.port, self.rooms)


MakeCluster = Callable[..., Awaitable[Cluster]]


@pytest.fixture
async def make_cluster(model_dir: Path) -> AsyncIterator[MakeCluster]:
    made: list[Cluster] = []

    async def make(room_timeout_s: float = 5.0, done_timeout_s: float = 5.0,
                   transfer_timeout_s: float = 5.0, **kw: Any) -> Cluster:
        kw = {"page_size": PAGE, "num_pages": 512, "max_batch": 16, **kw}
        p, d = ReferenceEngine(model_dir, **kw), ReferenceEngine(model_dir, **kw)
        await p.start()
        await d.start()
        port = free_port()
        tag = f"{os.getpid()}-{len(made)}"
        p.prefill_side = PrefillSide(NixlMover(f"p-{tag}", p.kv, p.page_bytes, p.num_pages),
                                     HOST, port, room_timeout_s=room_timeout_s,
                                     transfer_timeout_s=transfer_timeout_s)
        await p.prefill_side.start()
        d.decode_side = DecodeSide(NixlMover(f"d-{tag}", d.kv, d.page_bytes, d.num_pages),
                                   f"d-{tag}", done_timeout_s=done_timeout_s,
                                   transfer_timeout_s=transfer_timeout_s)
        c = Cluster(p, d, port)
        made.append(c)
        return c

    yield make
    for c in made:
        for e in (c.d, c.p):
            await wait_idle(e)
            await e.shutdown()
        assert c.d.decode_side is not None and c.p.prefill_side is not None
        await c.d.decode_side.close()
        await c.p.prefill_side.close()


async def collect(engine: ReferenceEngine, req: EngineRequest) -> list[EngineOutput]:
    return [o async for o in engine.generate(req)]


async def pd_tokens(c: Cluster, rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Send the same request to P and D at once, as the frontend does; D's tokens."""
    b = c.bootstrap()
    p_outs, d_outs = await asyncio.gather(
        collect(c.p, EngineRequest(rid, list(prompt), sp, b)),
        collect(c.d, EngineRequest(rid, list(prompt), sp, b)),
    )
    assert len(p_outs) == 1
    first = p_outs[0]
    assert (first.finish_reason, first.completion_tokens, first.prompt_tokens) == (
        "length", 1, len(prompt))
    assert len(first.output_ids) == 1
    assert d_outs[0].output_ids == first.output_ids  # the first token goes out on its own at once
    assert d_outs[0].completion_tokens == 1 and d_outs[-1].finish_reason in ("stop", "length")
    assert d_outs[-1].completion_tokens == len(d_outs[-1].output_ids)
    return d_outs[-1].output_ids


def cases() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    lengths = [1, PAGE, PAGE + 1, 3 * PAGE, 3 * PAGE + 2, 7 * PAGE - 1, 10 * PAGE + 3, 2]
    out = []
    for i in range(32):
        n = lengths[i % len(lengths)]
        prompt = [rng.randrange(4, 1024) for _ in range(n)]
        kw: dict[str, Any] = {"max_tokens": rng.choice([1, 2, 9, 17]), "ignore_eos": i % 3 == 0}
        if i % 2:
            kw.update(temperature=0.8, seed=1000 + i, top_k=rng.choice([0, 50]))
        else:
            kw.update(GREEDY)
        if i % 5 == 4:
            kw["min_tokens"] = min(kw["max_tokens"], 3)
        out.append((prompt, SamplingParams(**kw)))
    return out


async def test_pd_output_equals_aggregated(make_cluster: MakeCluster, model_dir: Path) -> None:
    c = await make_cluster()
    agg = ReferenceEngine(model_dir, page_size=PAGE, num_pages=512, max_batch=16)
    await agg.start()
    try:
        todo = cases()

        async def agg_tokens(rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
            return (await collect(agg, EngineRequest(rid, prompt, sp)))[-1].output_ids

        want = await asyncio.gather(*(agg_tokens(f"a{i}", p, sp) for i, (p, sp) in enumerate(todo)))
        assert any(len(w) > 5 for w in want) and len({tuple(w) for w in want}) > 20
        # Concurrency 1: a third of the cases, one after the other.
        for i, (prompt, sp) in enumerate(todo[:12]):
            assert await pd_tokens(c, f"s{i}", prompt, sp) == want[i], f"case {i}"
        # Concurrency 8: every case, 8 in flight at a time.
        sem = asyncio.Semaphore(8)

        async def one(i: int) -> list[int]:
            async with sem:
                return await pd_tokens(c, f"c{i}", *todo[i])

        got = await asyncio.gather(*(one(i) for i in range(len(todo))))
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"case {i}: P+D {g} != agg {w}"
        await wait_idle(agg)
    finally:
        await agg.shutdown()


async def test_incremental_decode_engine(make_cluster: MakeCluster, model_dir: Path) -> None:
    c = await make_cluster(output_mode="incremental")
    prompt, sp = [9, 8, 7, 6, 5], SamplingParams(max_tokens=12, temperature=0.8, seed=3,
                                                 ignore_eos=True)
    agg = ReferenceEngine(model_dir, page_size=PAGE, num_pages=64)
    await agg.start()
    want = (await collect(agg, EngineRequest("a", prompt, sp)))[-1].output_ids
    await agg.shutdown()
    b = c.bootstrap()
    _, d_outs = await asyncio.gather(collect(c.p, EngineRequest("r", prompt, sp, b)),
                                     collect(c.d, EngineRequest("r", prompt, sp, b)))
    joined: list[int] = []
    for o in d_outs:
        assert o.completion_tokens == len(joined) + len(o.output_ids)
        joined += o.output_ids
    assert joined == want and len(d_outs[0].output_ids) == 1


def record_releases(engine: ReferenceEngine) -> list[float]:
    """Times at which the fetch released a request's pages."""
    times: list[float] = []
    release = engine._release_fetching

    def spy(seq: Any) -> None:
        times.append(time.monotonic())
        release(seq)

    engine._release_fetching = spy  # type: ignore[method-assign]
    return times


async def test_room_that_never_gets_kv_fails_and_pages_wait_for_release(
        make_cluster: MakeCluster) -> None:
    # No prefill request for the room: D's fetch times out, its pages sit in quarantine (P might
    # still write) and come back only when the fetch releases them.
    c = await make_cluster(room_timeout_s=30.0, done_timeout_s=0.3, transfer_timeout_s=0.2)
    released = record_releases(c.d)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="KV handoff failed"):
        await collect(c.d, EngineRequest("lonely", [5, 6, 7, 8, 9], sp, c.bootstrap()))
    assert time.monotonic() - t0 < 2.0
    assert released == [] and c.d.load().pages_reserved == c.d.pool.pages_for(5 + 8)
    c.d.pool.check()
    await wait_idle(c.d, timeout=0.2 + QUARANTINE_GRACE_S + 2.0)
    assert len(released) == 1 and released[0] - t0 >= 0.2 + QUARANTINE_GRACE_S
    # The engine still serves PD requests afterwards.
    assert len(await pd_tokens(c, "after", [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))) == 4


async def test_abort_decode_while_fetch_pending(make_cluster: MakeCluster) -> None:
    c = await make_cluster(room_timeout_s=30.0, done_timeout_s=30.0, transfer_timeout_s=0.2)
    released = record_releases(c.d)
    gen = c.d.generate(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=30),
                                     c.bootstrap()))
    first = asyncio.ensure_future(gen.__anext__())
    deadline = time.monotonic() + 5
    assert c.d.decode_side is not None
    while c.d.load().pages_reserved == 0 or c.d.decode_side.num_pending == 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    await c.d.abort("r")
    out = await first
    assert out.finish_reason == "abort" and out.output_ids == []
    assert [o async for o in gen] == []
    assert released == [] and c.d.load().pages_reserved > 0  # quarantined, not freed early
    await wait_idle(c.d, timeout=0.2 + QUARANTINE_GRACE_S + 2.0)
    assert len(released) == 1


async def test_aclose_decode_while_fetch_pending(make_cluster: MakeCluster) -> None:
    c = await make_cluster(done_timeout_s=30.0, transfer_timeout_s=0.1)
    released = record_releases(c.d)
    gen = c.d.generate(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=3), c.bootstrap()))
    task = asyncio.ensure_future(gen.__anext__())
    while c.d.decode_side.num_pending == 0:  # type: ignore[union-attr]
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gen.aclose()
    assert c.d.load().pages_reserved > 0
    await wait_idle(c.d, timeout=0.1 + QUARANTINE_GRACE_S + 2.0)
    assert len(released) == 1


async def test_prefill_aborted_before_send_fails_the_room(make_cluster: MakeCluster) -> None:
    # D asks first; P's prefill is held in its step, aborted there, and must call fail(): D then
    # learns at once (KvDone not ok) and gets its pages back without waiting for quarantine.
    c = await make_cluster(done_timeout_s=30.0, transfer_timeout_s=30.0)
    side = c.p.prefill_side
    assert side is not None
    fails: list[tuple[int, str]] = []
    fail = side.fail

    def spy(room: int, error: str) -> None:
        fails.append((room, error))
        fail(room, error)

    side.fail = spy  # type: ignore[method-assign]
    gate, entered = threading.Event(), threading.Event()
    compute = c.p._compute

    def held(batch: Any) -> list[int]:
        entered.set()
        gate.wait(5)
        return compute(batch)

    c.p._compute = held  # type: ignore[method-assign]
    b = c.bootstrap()
    sp = SamplingParams(max_tokens=8, **GREEDY)
    d_task = asyncio.ensure_future(collect(c.d, EngineRequest("r", [4, 5, 6, 7, 8], sp, b)))
    while c.d.decode_side.num_pending == 0:  # type: ignore[union-attr]
        await asyncio.sleep(0.005)
    p_gen = c.p.generate(EngineRequest("r", [4, 5, 6, 7, 8], sp, b))
    p_first = asyncio.ensure_future(p_gen.__anext__())
    await asyncio.to_thread(entered.wait, 5)
    await c.p.abort("r")
    gate.set()
    out = await p_first
    assert out.finish_reason == "abort" and out.output_ids == []
    assert fails == [(b.room, "the prefill request was aborted")]
    with pytest.raises(EngineError, match="aborted"):
        await asyncio.wait_for(d_task, 2.0)
    c.p._compute = compute  # type: ignore[method-assign]
    await wait_idle(c.d, timeout=0.5)  # released at once: P said it will not write
    await wait_idle(c.p, timeout=0.5)


async def test_prefill_without_decode_times_out(make_cluster: MakeCluster) -> None:
    c = await make_cluster(room_timeout_s=0.3)
    with pytest.raises(EngineError, match="KV handoff failed"):
        await collect(c.p, EngineRequest("r", [4, 5, 6], SamplingParams(max_tokens=4),
                                         c.bootstrap()))
    await wait_idle(c.p, timeout=0.5)


async def test_decode_waits_for_pages_then_serves(make_cluster: MakeCluster) -> None:
    # Pages for one request at a time on D: the second waits (no reservation), then runs.
    c = await make_cluster(num_pages=24)
    sp = SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY)  # 16 pages each
    got = await asyncio.gather(pd_tokens(c, "a", [3, 4, 5], sp), pd_tokens(c, "b", [6, 7], sp))
    assert [len(g) for g in got] == [60, 60]


async def test_shutdown_during_handoffs(make_cluster: MakeCluster) -> None:
    # D waits for a room P never serves; P waits for a room D never asks for. Shutdown ends both
    # with "abort"; D's quarantined pages come back when its DecodeSide closes.
    c = await make_cluster(done_timeout_s=30.0, transfer_timeout_s=30.0)
    sp = SamplingParams(max_tokens=5, **GREEDY)
    d_gen = c.d.generate(EngineRequest("d", [1, 2, 3], sp, c.bootstrap()))
    p_gen = c.p.generate(EngineRequest("p", [1, 2, 3], sp, c.bootstrap()))
    d_first, p_first = asyncio.ensure_future(d_gen.__anext__()), asyncio.ensure_future(
        p_gen.__anext__())
    while c.d.decode_side.num_pending == 0 or c.p.load().running == 0:  # type: ignore[union-attr]
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # P's prefill step is done: it waits for its room
    await c.p.shutdown()
    await c.d.shutdown()
    assert (await p_first).finish_reason == "abort" and (await d_first).finish_reason == "abort"
    await wait_idle(c.p, timeout=0.5)
    assert c.d.load().pages_reserved > 0  # P might still write: quarantined
    assert c.d.decode_side is not None
    await c.d.decode_side.close()
    await wait_idle(c.d, timeout=1.0)
