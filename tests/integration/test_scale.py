"""Scale: 2048 streamed requests at once through a frontend over 1P1D mock workers. Every stream
ends with [DONE], carries no error, reports usage equal to what was asked, and has the same text
as a lone reference stream; the frontend's memory stays bounded; every page is free afterwards.
Uses the sweep's load client (perf.common.client / perf.streaming.load). Not a speed test: no timing asserted."""

from __future__ import annotations

import asyncio
import collections
import resource

import psutil

from perf.streaming.load import LoadSpec, check, run_level
from tests.cluster import Cluster, free_port

CONCURRENCY = 2048
MAX_TOKENS = 8
RSS_GROWTH_BOUND = 300 * 2**20


def test_2048_concurrent_streams_through_1p1d(tiny_model, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2 * CONCURRENCY + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    c = Cluster(tiny_model, str(tmp_path))
    try:
        c.add_worker("mock", ["--role", "prefill", "--bootstrap-port", str(free_port()),
                              "--max-batch", "512"])
        c.add_worker("mock", ["--role", "decode", "--max-batch", "512"])
        c.start_frontend()
        assert c.frontend is not None
        host, port = c.url.removeprefix("http://").split(":")
        spec = LoadSpec(host, int(port), model="tiny", max_tokens=MAX_TOKENS, timeout_s=60.0)
        frontend = psutil.Process(c.frontend.pid)

        warm = asyncio.run(run_level(spec, 4, requests=8))
        assert [check(r, spec, None) for r in warm.results] == [""] * 8
        expected = warm.results[0].text
        rss_before = frontend.memory_info().rss

        level = asyncio.run(run_level(spec, CONCURRENCY, requests=CONCURRENCY))
        rss_after = frontend.memory_info().rss

        why = collections.Counter(check(r, spec, expected) for r in level.results)
        assert len(level.results) == CONCURRENCY
        assert why == {"": CONCURRENCY}, why.most_common(5)
        assert all(r.completion_tokens == MAX_TOKENS for r in level.results)
        assert rss_after - rss_before < RSS_GROWTH_BOUND, (rss_before, rss_after)
        c.assert_idle(timeout=20)
    finally:
        c.stop()
