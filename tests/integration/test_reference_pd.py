"""Disaggregated prefill/decode with the reference engine, in one process: a prefill engine and a
decode engine, each with its own KV and its handoff built by the engine (HandoffConfig: a real
PrefillSide on a loopback port, a real DecodeSide, both over NixlMover: two NIXL agents in this
process, UCX tcp+cma), plus an aggregated engine for reference. The proof: P+D output ids equal the
aggregated ones, token for token, greedy and seeded, alone and 8 at a time; every page comes back
on every engine, failures and cancels included, and pages a transfer may still write into come
back only when the fetch releases them.
"""

from __future__ import annotations

import os

for _k, _v in {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}.items():
    os.environ.setdefault(_k, _v)  # before nixl is imported (by NixlMover)

import asyncio  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncIterator, Awaitable, Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("nixl")

from tandem import launcher  # noqa: E402
from tandem.engines.base import Engine  # noqa: E402
from tandem.engines.handoff import HandoffConfig  # noqa: E402
from tandem.engines.reference import ReferenceEngine, write_tiny_model  # noqa: E402
from tandem.engines.reference.engine import Compute, ComputeHook  # noqa: E402
from tandem.engines.scheduler import Batch  # noqa: E402
from tandem.kv.bootstrap.decode import QUARANTINE_GRACE_S  # noqa: E402
from tandem.kv.transfer.movers import KvMover, NixlMover  # noqa: E402
from tandem.runtime.errors import KvHandoffError  # noqa: E402
from tandem.runtime.wire import Bootstrap, ErrorKind, SamplingParams  # noqa: E402
from tests.conformance.harness import Recorder, Run, finished, wait_idle  # noqa: E402

HOST = "127.0.0.1"
PAGE = 4
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path, seed=0)
    return path


def free_port() -> int:
    return launcher.free_port(HOST)


def nixl(name: str) -> Any:
    def make(kv: Any, page_bytes: int, num_pages: int) -> KvMover:
        return NixlMover(name, kv, page_bytes, num_pages)

    return make


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
        port = free_port()
        tag = f"{os.getpid()}-{len(made)}"
        timeouts = {"room_timeout_s": room_timeout_s, "done_timeout_s": done_timeout_s,
                    "transfer_timeout_s": transfer_timeout_s}
        p = ReferenceEngine(model_dir, **kw, handoff=HandoffConfig(
            "prefill", f"p-{tag}", nixl(f"p-{tag}"), host=HOST, port=port, **timeouts))
        d = ReferenceEngine(model_dir, **kw, handoff=HandoffConfig(
            "decode", f"d-{tag}", nixl(f"d-{tag}"), **timeouts))
        await p.start()
        await d.start()
        assert p.bootstrap_addr == f"{HOST}:{port}"
        c = Cluster(p, d, port)
        made.append(c)
        return c

    yield make
    for c in made:
        for e in (c.d, c.p):
            await wait_idle(e)
            await e.shutdown()


def submit(engine: Engine, rid: str, prompt: list[int], sp: SamplingParams,
           b: Bootstrap | None = None) -> Run:
    return Recorder(engine).submit(engine, rid, list(prompt), sp, b)


async def collect(engine: Engine, rid: str, prompt: list[int], sp: SamplingParams,
                  b: Bootstrap | None = None) -> Run:
    return await finished(submit(engine, rid, prompt, sp, b))


async def pd_tokens(c: Cluster, rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Send the same request to P and D at once, as the frontend does; D's tokens."""
    b = c.bootstrap()
    p_run, d_run = await asyncio.gather(collect(c.p, rid, prompt, sp, b),
                                        collect(c.d, rid, prompt, sp, b))
    assert len(p_run.outputs) == 1 and p_run.error is None and d_run.error is None
    ids, finish, n = p_run.outputs[0]
    assert (finish, n, len(ids)) == ("length", 1, 1)
    assert d_run.outputs[0][0] == ids  # the first token goes out on its own at once
    assert d_run.outputs[0][2] == 1 and d_run.finish in ("stop", "length")
    assert d_run.outputs[-1][2] == len(d_run.ids)
    return d_run.ids


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
            return (await collect(agg, rid, prompt, sp)).ids

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
    want = (await collect(agg, "a", prompt, sp)).ids
    await agg.shutdown()
    b = c.bootstrap()
    _, d_run = await asyncio.gather(collect(c.p, "r", prompt, sp, b),
                                    collect(c.d, "r", prompt, sp, b))
    joined: list[int] = []
    for ids, _, n in d_run.outputs:
        assert n == len(joined) + len(ids)
        joined += ids
    assert joined == want and len(d_run.outputs[0][0]) == 1


async def idle_at(engine: Engine, timeout: float) -> float:
    """When the engine got every page back (monotonic time)."""
    await wait_idle(engine, timeout)
    return time.monotonic()


async def test_room_that_never_gets_kv_fails_and_pages_wait_for_release(
        make_cluster: MakeCluster) -> None:
    # No prefill request for the room: D's fetch times out, its pages sit in quarantine (P might
    # still write) and come back only when the fetch releases them.
    c = await make_cluster(room_timeout_s=30.0, done_timeout_s=0.3, transfer_timeout_s=0.2)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    t0 = time.monotonic()
    run = await collect(c.d, "lonely", [5, 6, 7, 8, 9], sp, c.bootstrap())
    assert isinstance(run.error, KvHandoffError) and run.error.kind is ErrorKind.KV_TRANSFER
    # D's 0.3 s done deadline ended it (without one, D would wait until `finished` gives up at
    # 30 s); the bound only has to tell those apart, with seconds to spare on a loaded machine.
    assert time.monotonic() - t0 < 15
    assert c.d.load().pages_reserved == c.d.pool.pages_for(5)  # the prompt's: quarantined
    c.d.pool.check()
    t_free = await idle_at(c.d, timeout=0.2 + QUARANTINE_GRACE_S + 10.0)  # (a hang bound)
    assert t_free - t0 >= 0.2 + QUARANTINE_GRACE_S
    # The engine still serves PD requests afterwards.
    assert len(await pd_tokens(c, "after", [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))) == 4


async def test_cancel_decode_while_fetch_pending(make_cluster: MakeCluster) -> None:
    c = await make_cluster(room_timeout_s=30.0, done_timeout_s=30.0, transfer_timeout_s=0.2)
    run = submit(c.d, "r", [1, 2, 3], SamplingParams(max_tokens=30), c.bootstrap())
    deadline = time.monotonic() + 5
    while c.d.load().pages_reserved == 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # the fetch is under way
    t0 = time.monotonic()
    assert run.handle is not None
    run.handle.cancel()
    assert c.d.load().pages_reserved > 0  # quarantined, not freed early (the bound below says
    t_free = await idle_at(c.d, timeout=0.2 + QUARANTINE_GRACE_S + 10.0)  # for how long)
    assert t_free - t0 >= 0.2 + QUARANTINE_GRACE_S - 0.1
    assert run.outputs == []


def held(entered: threading.Event, gate: threading.Event) -> ComputeHook:
    def hook(batch: Batch, compute: Compute) -> list[int]:
        entered.set()
        gate.wait(5)
        return compute(batch)

    return hook


async def test_prefill_cancelled_before_send_fails_the_room(make_cluster: MakeCluster) -> None:
    # D asks first; P's prefill is held in its step and cancelled there: the room must fail at
    # once, so D learns (long before its 30 s deadline) and gets its pages back without waiting
    # for a quarantine (P said it will not write).
    c = await make_cluster(done_timeout_s=30.0, transfer_timeout_s=30.0)
    gate, entered = threading.Event(), threading.Event()
    c.p.compute_hook = held(entered, gate)
    b = c.bootstrap()
    sp = SamplingParams(max_tokens=8, **GREEDY)
    d_run = submit(c.d, "r", [4, 5, 6, 7, 8], sp, b)
    while c.d.load().pages_reserved == 0:
        await asyncio.sleep(0.005)
    p_run = submit(c.p, "r", [4, 5, 6, 7, 8], sp, b)
    await asyncio.to_thread(entered.wait, 5)
    assert p_run.handle is not None
    p_run.handle.cancel()
    gate.set()
    c.p.compute_hook = None
    # At once: the bounds below only have to stay under D's 30 s done deadline and the 32 s
    # quarantine (30 s transfer deadline + grace) that waiting would mean.
    await asyncio.wait_for(d_run.done.wait(), 10)
    assert d_run.error is not None and "aborted" in str(d_run.error)
    assert p_run.outputs == []
    await wait_idle(c.d, timeout=10)  # released at once
    await wait_idle(c.p, timeout=10)


async def test_prefill_without_decode_times_out(make_cluster: MakeCluster) -> None:
    c = await make_cluster(room_timeout_s=0.3)
    run = await collect(c.p, "r", [4, 5, 6], SamplingParams(max_tokens=4), c.bootstrap())
    assert isinstance(run.error, KvHandoffError) and "room" in str(run.error)
    await wait_idle(c.p)


async def test_decode_waits_for_pages_then_serves(make_cluster: MakeCluster) -> None:
    # Pages for one request at a time on D: the second waits (no reservation), then runs.
    c = await make_cluster(num_pages=24)
    sp = SamplingParams(max_tokens=60, ignore_eos=True, **GREEDY)  # 16 pages each
    got = await asyncio.gather(pd_tokens(c, "a", [3, 4, 5], sp), pd_tokens(c, "b", [6, 7], sp))
    assert [len(g) for g in got] == [60, 60]


async def test_shutdown_during_handoffs(make_cluster: MakeCluster) -> None:
    # D waits for a room P never serves; P waits for a room D never asks for. Shutdown ends both
    # with "abort" and, closing the handoff (no write can land any more), frees every page.
    c = await make_cluster(done_timeout_s=30.0, transfer_timeout_s=30.0)
    sp = SamplingParams(max_tokens=5, **GREEDY)
    d_run = submit(c.d, "d", [1, 2, 3], sp, c.bootstrap())
    p_run = submit(c.p, "p", [1, 2, 3], sp, c.bootstrap())
    while c.d.load().pages_reserved == 0 or c.p.load().running == 0:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # P's prefill step is done: it waits for its room
    await c.d.shutdown()  # (D first: P going away would fail D's fetch with a KV error)
    await c.p.shutdown()
    assert p_run.finish == "abort" and d_run.finish == "abort"
    for e in (c.p, c.d):
        assert e.load().pages_free == e.num_pages
        e.pool.check()
