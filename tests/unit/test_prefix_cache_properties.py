"""A hypothesis test of the prefix cache through everything that moves pages: random prompts that
share random prefixes, served at once by small mock engines (admission that waits for pages,
eviction, shared pages), some cancelled at a chosen output, some disaggregated (a prefill and a
decode engine, both caching, through the in-memory channel pair). Every engine checks its page
accounting after every step (TANDEM_CHECK_KV, tests/conftest.py: a failure fails the test), every
uncancelled request's tokens equal a cache-off engine's, and at the end every page is free or
cached."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem.engines.mock import MockEngine
from tandem.runtime.wire import Bootstrap, SamplingParams
from tests.conformance.harness import Recorder, Run, finished, wait_idle
from tests.unit.test_logprobs_pd import Fabric, Spec

Req = tuple[int, list[int], int, int | None, bool]  # group, suffix, max_tokens, cancel at, PD

requests = st.lists(st.tuples(
    st.integers(0, 2), st.lists(st.integers(3, 90), max_size=9), st.integers(1, 8),
    st.one_of(st.none(), st.integers(1, 4)), st.booleans()), min_size=3, max_size=14)
prefixes = st.lists(st.lists(st.integers(3, 90), min_size=5, max_size=26), min_size=3,
                    max_size=3)


def model_dir(tmp: Path) -> str:
    (tmp / "config.json").write_text(json.dumps(
        {"vocab_size": 97, "max_position_embeddings": 64, "eos_token_id": 2}))
    return str(tmp)


async def scenario(path: str, groups: list[list[int]], reqs: list[Req], host: int = 0) -> None:
    fabric = Fabric()
    kw: dict[str, Any] = {"page_size": 4, "num_pages": 16, "max_batch": 3}
    off = MockEngine(path, prefix_cache=False, **kw)
    if host:  # the caching engines get a host tier, and fewer device pages (more evictions)
        kw.update(host_pages=host, num_pages=12)
    on = MockEngine(path, **kw)
    prefill = MockEngine(path, handoff=Spec(fabric, "prefill"), **kw)
    decode = MockEngine(path, handoff=Spec(fabric, "decode"), **kw)
    engines = (on, off, prefill, decode)
    for e in engines:
        await e.start()
    evicted: list[Any] = []
    on.on_kv_events = evicted.extend
    try:
        runs: list[tuple[Run, Run, int | None]] = []
        rec_on, rec_off, rec_p, rec_d = (Recorder(e) for e in engines)
        for i, (group, suffix, max_tokens, cancel_at, pd) in enumerate(reqs):
            prompt = groups[group] + suffix or [5]
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            want = rec_off.submit(off, f"r{i}", prompt, sp)
            if pd:
                b = Bootstrap("memory", 0, i + 1)
                rec_p.submit(prefill, f"r{i}", prompt, sp, b)
                got = rec_d.submit(decode, f"r{i}", prompt, sp, b)
            else:
                got = rec_on.submit(on, f"r{i}", prompt, sp)
            if cancel_at is not None:
                def cancel(run: Run, at: int = cancel_at) -> None:
                    if len(run.ids) == at and run.handle is not None:
                        run.handle.cancel()
                        run.done.set()  # (it gets no more outputs)
                got.on_output = cancel
            runs.append((got, want, cancel_at))
        for got, want, cancel_at in runs:
            await finished(want)
            await finished(got)
            if cancel_at is None or cancel_at >= len(want.ids):
                assert got.ids == want.ids and got.finish == want.finish
            else:
                assert got.ids == want.ids[:cancel_at]
        for r in rec_p.runs.values():  # a prefill leg ends on its own, or once its KV is written
            await finished(r)
        for e in engines:
            await wait_idle(e)  # every page free or cached; the pool's check passes
        event(f"cache hits: {bool(on.pool.hits)}, decode-side hits: {bool(decode.pool.hits)}")
        event(f"evictions: {any(type(x).__name__ == 'BlockRemoved' for x in evicted)}")
        event(f"host tier hits: {bool(on.pool.host_hits or prefill.pool.host_hits or decode.pool.host_hits)}")
    finally:
        for e in engines:
            await e.shutdown()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups=prefixes, reqs=requests, host=st.sampled_from([0, 2, 8]))
def test_random_shared_prefixes_keep_the_invariant_and_the_tokens(tmp_path: Path,
                                                                  groups: list[list[int]],
                                                                  reqs: list[Req],
                                                                  host: int) -> None:
    """(`host`: the caching engines' host tier, in pages: none, tiny, or half the device's.)"""
    asyncio.run(asyncio.wait_for(scenario(model_dir(tmp_path), groups, reqs, host), 60))
