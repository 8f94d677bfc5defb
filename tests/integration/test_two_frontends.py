"""Two frontend processes against one 1P1D cluster (reference engine, KV handed over with NIXL):
both stream the same greedy requests at once, each with its own credit window on each worker, and
every answer equals what one frontend alone gave; afterwards every page is free on both workers as
each frontend sees them."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

pytest.importorskip("nixl")

from tandem.launcher import stop_all, wait_ready  # noqa: E402
from tests.cluster import Cluster, free_port, spawn  # noqa: E402
from tests.integration.streaming import Outcome, idle, stream, until, workers  # noqa: E402

PAGE = 16
WORKER_ARGS = ["--page-size", str(PAGE), "--num-pages", "1024", "--max-batch", "32"]
LENGTHS = [1, 15, 16, 17, 33, 64, 100]


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(10, 1000) for _ in range(LENGTHS[i % len(LENGTHS)])]
            for i in range(28)]


async def run_all(url: str, concurrency: int = 8) -> list[Outcome]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(ids: list[int]) -> Outcome:
            async with sem:
                return await stream(client, url, ids, max_tokens=12, timeout=60)
        return list(await asyncio.gather(*(one(p) for p in prompts())))


def answers(outcomes: list[Outcome]) -> list[tuple[str, int, str | None]]:
    for o in outcomes:
        assert o.ok, o
    return [(o.text, o.completion_tokens, o.finish) for o in outcomes]


async def test_two_frontends_stream_at_once_exactly(tiny_model: str, tmp_path: Path) -> None:
    c = Cluster(tiny_model, str(tmp_path))
    c.add_worker("reference", ["--role", "prefill", "--bootstrap-port", str(free_port()),
                               *WORKER_ARGS])
    c.add_worker("reference", ["--role", "decode", *WORKER_ARGS])
    addrs = ",".join(w.address for w in c.workers)
    fronts, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            fronts.append(spawn(f"frontend{i}", [
                "frontend", "--model", tiny_model, "--workers", addrs, "--port", str(port),
                "--log-level", "WARNING"], str(tmp_path)))
        for url in urls:
            await asyncio.to_thread(wait_ready, url, [*fronts, *c.workers], 90.0)

        alone = answers(await run_all(urls[0]))
        both = await asyncio.wait_for(asyncio.gather(run_all(urls[0]), run_all(urls[1])), 180)
        assert answers(both[0]) == alone
        assert answers(both[1]) == alone
        for url in urls:  # each frontend sees both workers, every page free
            rows = await until(f"{url}: every page free", lambda: _idle(url), 15)
            assert len(rows) == 2 and all(r["state"] == "up" for r in rows.values())
    finally:
        await asyncio.to_thread(stop_all, [*fronts, *c.workers], 15.0)


async def _idle(url: str) -> dict | None:
    rows = await workers(url)
    return rows if idle(rows) else None
