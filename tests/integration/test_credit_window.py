"""The worker's credit window: a WorkerServer (mock engine, in this process) on an in-memory router
(every message through the wire encoding) and the test playing the frontend. Without credit the worker sends no more than its window (first
tokens aside) and merges what it holds; credit releases it, exactly and in order; a frontend that
stays silent while owing credit gets its requests ended with an error and the pages come back."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tandem.engines.mock import MockEngine, mock_token
from tandem.runtime import wire
from tandem.runtime.channel import MemoryRouter
from tandem.config import MockTiming, WorkerConfig
from tandem.runtime.wire import Credit, Deltas, Generate, Hello, HelloReply, SamplingParams
from tandem.worker.server import WorkerServer

VOCAB = 500


@pytest.fixture
def mock_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": VOCAB, "max_position_embeddings": 4096, "eos_token_id": 2}))
    return str(tmp_path)


class Frontend:
    """A frontend that speaks the protocol and gives credit only when told to."""

    def __init__(self, router: MemoryRouter) -> None:
        self.end = router.connect(b"raw-frontend")

    async def send(self, msg: wire.Message | Generate) -> None:
        if isinstance(msg, Generate):  # one request: a Generates of one
            msg = wire.Generates([msg])
        self.end.send_nowait(msg)

    async def recv(self, timeout: float = 5.0) -> wire.ToFrontend:
        return await asyncio.wait_for(anext(aiter(self.end)), timeout)

    async def deltas(self, timeout: float) -> list[Deltas]:
        """Every Deltas message that arrives within `timeout` (other messages are skipped)."""
        out: list[Deltas] = []
        with contextlib.suppress(TimeoutError):
            while True:
                msg = await self.recv(timeout)
                if isinstance(msg, Deltas):
                    out.append(msg)
        return out


@contextlib.asynccontextmanager
async def worker(mock_dir: str, **cfg: object) -> AsyncIterator[tuple[WorkerServer, Frontend]]:
    config = WorkerConfig(engine="mock", model=mock_dir, **cfg)  # type: ignore[arg-type]
    engine = MockEngine(mock_dir, page_size=16, num_pages=1024, max_batch=64,
                        timing=MockTiming(step_delay_ms=2))
    await engine.start()
    from tandem.runtime.wire import WorkerInfo

    info = WorkerInfo("w", "agg", "mock", "m", 16, 1024, 4096)
    router: MemoryRouter = MemoryRouter(decoders=(wire.TO_WORKER, wire.TO_FRONTEND))
    server = WorkerServer(config, engine, info, channel=router)
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    fe = Frontend(router)
    try:
        await fe.send(Hello(wire.PROTOCOL_VERSION, "raw"))
        assert isinstance(await fe.recv(), HelloReply)
        yield server, fe
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        fe.end.close()
        await engine.shutdown()
        assert engine.pool.idle()  # every page came back (free or cached)
        engine.pool.check()


def expected(prompt: list[int], n: int) -> list[int]:
    return [mock_token(prompt, i, VOCAB, frozenset({2})) for i in range(n)]


async def test_without_credit_the_worker_holds_and_merges_then_credit_releases_all_exactly(
        mock_dir: str) -> None:
    async with worker(mock_dir, delta_window=2, delta_batch=0) as (_, fe):
        prompts = {f"r{i}": [7, i + 1, 3] for i in range(4)}
        for rid, prompt in prompts.items():
            await fe.send(Generate(rid, prompt, SamplingParams(max_tokens=200, ignore_eos=True)))
        # The window fills (a message past the first tokens comes, however slow the machine),
        # then ~400 engine steps of 2 ms run while we give no credit: nothing more arrives.
        held: list[Deltas] = []
        while not any(d.offset for m in held for d in m.items):
            if isinstance(msg := await fe.recv(10.0), Deltas):
                held.append(msg)
        held += await fe.deltas(timeout=0.8)
        # The window's worth of messages; past it only first tokens (one message at most each).
        assert 1 <= sum(1 for m in held if any(d.offset for d in m.items)) <= 2
        assert len(held) <= 2 + len(prompts)
        got: dict[str, list[int]] = {rid: [] for rid in prompts}
        finish: dict[str, str] = {}
        received = 0
        messages = held
        while len(finish) < len(prompts):
            for msg in messages:
                for d in msg.items:
                    assert d.offset == len(got[d.rid])  # in order, no gap, no overlap
                    got[d.rid].extend(d.token_ids)
                    if d.finish_reason:
                        finish[d.rid] = d.finish_reason
            received += len(messages)
            await fe.send(Credit(len(messages)))
            messages = await fe.deltas(timeout=0.3)
        assert all(f == "length" for f in finish.values())
        assert {rid: ids for rid, ids in got.items()} == {
            rid: expected(p, 200) for rid, p in prompts.items()}
        # Merged: far fewer messages than the 200 steps each request took.
        assert received < 60


async def test_a_batch_bounds_each_message_and_first_tokens_come_first(mock_dir: str) -> None:
    async with worker(mock_dir, delta_window=1, delta_batch=3) as (_, fe):
        for i in range(10):
            await fe.send(Generate(f"r{i}", [5, i + 1], SamplingParams(max_tokens=30,
                                                                       ignore_eos=True)))
        done: set[str] = set()
        while len(done) < 10:
            msgs = await fe.deltas(timeout=0.3)
            for msg in msgs:
                rest = [d for d in msg.items if d.offset > 0]
                assert len(rest) <= 3
                firsts = [d.offset == 0 for d in msg.items]
                assert firsts == sorted(firsts, reverse=True)  # first tokens lead
                done |= {d.rid for d in msg.items if d.finish_reason}
            if msgs:
                await fe.send(Credit(len(msgs)))


async def test_a_silent_frontend_owing_credit_loses_its_requests_with_an_error(
        mock_dir: str) -> None:
    async with worker(mock_dir, delta_window=1, frontend_silent_s=0.5) as (server, fe):
        await fe.send(Generate("long", [9, 9], SamplingParams(max_tokens=3000, ignore_eos=True)))
        msgs = await fe.deltas(timeout=2.0)  # no credit, no other message: silent
        items = [d for m in msgs for d in m.items]
        assert items[-1].finish_reason == "error"
        assert items[-1].error_kind == wire.ErrorKind.FRONTEND_SILENT
        assert "silent" in items[-1].error
        got = [t for d in items for t in d.token_ids]
        assert got == expected([9, 9], len(got))  # what it held came first, in order
        assert items[-1].offset == len(got) and 0 < len(got) < 3000
        assert server.num_requests == 0
