"""A finished request is freed when its last reference goes, not by the cyclic garbage collector:
with thousands of streams a second, objects left in reference cycles fill the young generation and
each collection walks them (at 1024 unpaced streams, six times as many young collections of ~15 ms).
Driven through the real FrontendApp, WorkerPool and request handles over an in-memory channel."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path

import pytest

from tandem.config import FrontendConfig
from tandem.frontend.app import FrontendApp
from tandem.frontend.choice import ChoiceState, RichChoiceState
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.respond import _Response
from tandem.router.request import Leg, RequestHandle
from tandem.runtime import wire
from tandem.runtime.collector import DeltaCollector
from tests.fakes import ServerCallsStub, asgi_post, memory_pool, write_model_dir

TOKENS = 4


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor(write_model_dir(tmp_path_factory.mktemp("lifetime") / "tiny"), "tiny")


def _live(*types: type) -> int:
    return sum(1 for o in gc.get_objects() if type(o) in types)  # (exact types: no __class__)


async def _request(app: FrontendApp, body: bytes, nowait: bool) -> list[bytes]:
    """One streamed completion through ASGI (the client stays: its `receive` waits); the bytes
    of the response body."""
    out: list[bytes] = []

    def body_nowait(data: bytes) -> bool:
        out.append(data)
        return True

    await asgi_post(app, "/v1/completions", body, out,
                    ServerCallsStub(body_nowait) if nowait else None)
    return out


@pytest.mark.parametrize("rich", [False, True], ids=["text", "logprobs"])
@pytest.mark.parametrize("nowait", [True, False], ids=["push", "task"])
async def test_a_finished_request_leaves_no_reference_cycle(pre: Preprocessor, nowait: bool,
                                                           rich: bool) -> None:
    pool, workers = memory_pool(["agg"], pages=1 << 12, page_size=16)
    app = FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny"), pool, pre)
    link = pool.links[0]
    body = json.dumps({"prompt": "the cat", "max_tokens": TOKENS, "stream": True,
                       "ignore_eos": True, **({"logprobs": 1} if rich else {})}).encode()
    gc.collect()
    kinds = (RequestHandle, Leg, DeltaCollector, ChoiceState, RichChoiceState)
    before = _live(*kinds)
    gc.disable()
    try:
        tasks = [asyncio.ensure_future(_request(app, body, nowait)) for _ in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        rids = [g.rid for m in workers.sent(link.address) if isinstance(m, wire.Generates)
                for g in m.items]
        assert len(rids) == 3
        for k in range(TOKENS):
            last = k == TOKENS - 1
            link.on_message(wire.Deltas([
                wire.Delta(rid, k, [7 + k], "length" if last else None,
                           wire.Usage(2, TOKENS) if last else None,
                           logprobs=[wire.TokenLogprobs(7 + k, -0.5, [(7 + k, -0.5)])]
                           if rich else None) for rid in rids]))
            for _ in range(3):
                await asyncio.sleep(0)
        bodies = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert all(b"".join(x).endswith(b"data: [DONE]\n\n") for x in bodies)
        del tasks
        await asyncio.sleep(0)
        # Every request object went with its last reference: none waits for the collector.
        assert _live(*kinds) == before
    finally:
        gc.enable()


async def test_a_refused_request_leaves_no_reference_cycle(pre: Preprocessor) -> None:
    """A request refused while it waits for a place (a 503: the queue is full) is freed when its
    last reference goes, as a served one is. Kept as the answer with its traceback, the error held
    the response's frame and so the whole request, down to its connection, for the collector: at
    45 refusals a second the frontend then stopped for 40-70 ms every ~17 s to collect them
    (perf/results/tenants.md)."""
    pool, workers = memory_pool(["agg"], pages=1 << 12, page_size=16,
                                max_inflight_per_worker=1, max_queue=1)
    app = FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny"), pool, pre)
    body = json.dumps({"prompt": "the cat", "max_tokens": TOKENS, "stream": True}).encode()
    gc.collect()
    kinds = (_Response, RequestHandle, DeltaCollector, ChoiceState)
    before = {k: _live(k) for k in kinds}
    gc.disable()
    waiting = [asyncio.ensure_future(_request(app, body, True)) for _ in range(2)]
    try:
        for _ in range(5):
            await asyncio.sleep(0)
        assert not any(t.done() for t in waiting)  # one placed, one in the queue
        for _ in range(3):
            out: list[bytes] = []
            starts: list[int] = []
            await asyncio.wait_for(asgi_post(app, "/v1/completions", body, out, None, starts), 5)
            assert starts == [503], (starts, out)
        await asyncio.sleep(0)
        # Alive: the two requests still in flight, and nothing of the three refused.
        assert {k: _live(k) - before[k] for k in kinds} == {k: 2 for k in kinds}
    finally:
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        gc.enable()
