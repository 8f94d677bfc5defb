"""Token-for-token: disaggregated output equals aggregated output (reference engine, KV pages
handed over with NIXL between real worker processes), greedy and seeded, for 200+ prompts whose
lengths cover 1 token, exact page multiples, page+1 and many pages, at concurrency 1 and 64, on
1P1D and 2P2D."""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("nixl")

from tandem.router.pool import WorkerPool  # noqa: E402
from tandem.runtime.wire import SamplingParams  # noqa: E402
from tests.cluster import Cluster, free_port  # noqa: E402
from tests.fakes import next_delta  # noqa: E402

PAGE = 16
LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, 100, 127, 128, 129, 200, 256, 257]
WORKER_ARGS = ["--page-size", str(PAGE), "--num-pages", "2048", "--max-batch", "64"]


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    out = []
    for i in range(220):
        n = LENGTHS[i % len(LENGTHS)]
        out.append([rng.randrange(10, 1000) for _ in range(n)])
    return out


def sampling(i: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, seed=1000 + i)
    return SamplingParams(max_tokens=6, temperature=0.0)


async def run_all(addresses: list[str], concurrency: int, seeded: bool) -> list[list[int]]:
    pool = WorkerPool(addresses)
    await pool.start(wait_s=60)
    assert pool.ready(), [c.address for c in pool.links]
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, ids: list[int]) -> list[int]:
        async with sem:
            got: list[int] = []
            async with pool.open(ids, sampling(i, seeded)) as handle:
                while True:
                    d = await next_delta(handle.collector)  # raises if the request failed
                    got += d.token_ids
                    if d.finish_reason is not None:
                        assert d.finish_reason != "error", d.error
                        break
            return got

    try:
        return await asyncio.wait_for(
            asyncio.gather(*(one(i, p) for i, p in enumerate(prompts()))), 300)
    finally:
        await pool.close()


def start(tmp_path, tiny_model, roles: list[str]) -> Cluster:
    c = Cluster(tiny_model, str(tmp_path))
    for role in roles:
        extra = ["--role", role, *WORKER_ARGS]
        if role == "prefill":
            extra += ["--bootstrap-port", str(free_port())]
        c.add_worker("reference", extra)
    return c


@pytest.fixture(scope="module")
def agg_outputs(tiny_model, tmp_path_factory):
    c = start(tmp_path_factory.mktemp("agg"), tiny_model, ["agg"])
    try:
        return {seeded: asyncio.run(run_all([w.address for w in c.workers], 64, seeded))
                for seeded in (False, True)}
    finally:
        c.stop()


@pytest.mark.parametrize("shape", ["1P1D", "2P2D"])
def test_disaggregated_equals_aggregated(shape, agg_outputs, tiny_model, tmp_path):
    n = int(shape[0])
    c = start(tmp_path, tiny_model, ["prefill"] * n + ["decode"] * n)
    try:
        addrs = [w.address for w in c.workers]
        for seeded in (False, True):
            for concurrency in (1, 64) if shape == "1P1D" else (64,):
                got = asyncio.run(run_all(addrs, concurrency, seeded))
                want = agg_outputs[seeded]
                bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
                assert not bad, (f"{shape} seeded={seeded} c={concurrency}: {len(bad)} differ, "
                                 f"first {bad[0]} len {len(prompts()[bad[0]])}: "
                                 f"{got[bad[0]]} != {want[bad[0]]}")
                assert all(len(g) == 6 for g in got) or seeded is False
        c.start_frontend()
        c.assert_idle()
        states = c.worker_states()
        assert sorted(w["role"] for w in states) == sorted(["prefill"] * n + ["decode"] * n)
    finally:
        c.stop()


def test_pd_over_http_matches_agg_text(tiny_model, tmp_path):
    openai = pytest.importorskip("openai")
    texts = {}
    for shape, roles in (("agg", ["agg"]), ("pd", ["prefill", "decode"])):
        (tmp_path / shape).mkdir()
        c = start(tmp_path / shape, tiny_model, roles)
        try:
            c.start_frontend()
            with openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0,
                               timeout=60) as client:
                model = client.models.list().data[0].id
                kw = dict(model=model, messages=[{"role": "user", "content": "The sea is"}],
                          max_tokens=24, temperature=0)
                full = client.chat.completions.create(**kw).choices[0].message.content
                streamed = "".join(ch.choices[0].delta.content or "" for ch in
                                   client.chat.completions.create(**kw, stream=True)
                                   if ch.choices)
                assert streamed == full
                texts[shape] = full
            c.assert_idle()
        finally:
            c.stop()
    assert texts["pd"] == texts["agg"]
