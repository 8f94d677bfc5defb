"""The prefix cache (tandem.engines.pages, tandem.engines.prefix): the pool's verbs and its
invariant, KV events, and the engines reusing cached pages: the mock engine's prefill cost counts
only uncached tokens; the reference engine is token-exact against itself with the cache off
(greedy and seeded, across page boundaries, n > 1, after a cancel) and under PD, where the decode
side's cached pages are not written again. Every engine here checks its pool after every step
(TANDEM_CHECK_KV, tests/conftest.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tandem.config import MockTiming
from tandem.engines.base import Engine
from tandem.engines.mock import MockEngine
from tandem.engines.pages import PagePool, PagePoolError
from tandem.engines.prefix import event_hash, page_keys
from tandem.runtime.kv_events import BlockRemoved, BlockStored
from tandem.runtime.wire import Bootstrap, SamplingParams
from tests.conformance.harness import Recorder, Run, finished, wait_idle
from tests.unit.test_logprobs_pd import Fabric, Spec


def tokens(a: int, b: int) -> list[int]:
    return list(range(a, b))


# --- the pool -------------------------------------------------------------------------------------


def test_keys_chain_and_differ_by_parent_and_tokens() -> None:
    k = page_keys(tokens(0, 12), 4)
    assert len(k) == 3 and len(set(k)) == 3
    assert page_keys(tokens(0, 13), 4) == k  # only full pages
    assert page_keys(tokens(0, 12), 4, k[0], 1) == k[1:]  # a chain continues from its parent
    assert page_keys([9] + tokens(1, 12), 4)[1] != k[1]  # a page's key depends on its prefix
    assert all(-(1 << 63) <= event_hash(x) < 1 << 63 for x in k)


def test_shared_pages_count_once_and_are_cached_when_released() -> None:
    pool = PagePool(8, 4, caching=True)
    a = pool.take("a", [], 3)
    keys = page_keys(tokens(0, 12), 4)
    pool.publish(a, keys, 0, 2, lambda x, y: tokens(x, y))
    assert pool.take_events() == [BlockStored(block_hashes=[event_hash(keys[0]), event_hash(keys[1])],
                                       parent_block_hash=None, token_ids=tokens(0, 8),
                                       block_size=4)]
    hits = pool.match(keys, 3)
    assert hits == a[:2]  # the third page was never published
    b = pool.take("b", hits, 2)
    assert b[:2] == a[:2]
    assert (pool.num_held, pool.num_free, pool.num_cached) == (5, 3, 0)  # shared ones once
    pool.check()
    pool.free("a")
    assert (pool.num_held, pool.num_free) == (4, 4)  # a's unpublished page is free again
    pool.free("b")
    assert (pool.num_held, pool.num_free, pool.num_cached) == (0, 6, 2)
    assert pool.idle() and pool.num_available == 8
    pool.check()


def test_eviction_takes_the_deepest_least_recently_released_page_first() -> None:
    pool = PagePool(4, 4, caching=True)
    keys = page_keys(tokens(0, 16), 4)
    a = pool.take("a", [], 3)
    pool.publish(a, keys, 0, 3, lambda x, y: tokens(x, y))
    pool.free("a")
    pool.take_events()
    assert pool.num_cached == 3 and pool.can_allocate(4) and not pool.can_allocate(5)
    pool.allocate("b", 2)  # one free page, then one evicted: the deepest
    assert pool.take_events() == [BlockRemoved(block_hashes=[event_hash(keys[2])])]
    assert pool.match(keys, 4) == a[:2]
    pool.check()


def test_a_cached_page_a_request_takes_is_not_available_twice() -> None:
    pool = PagePool(3, 4, caching=True)
    keys = page_keys(tokens(0, 8), 4)
    a = pool.take("a", [], 2)
    pool.publish(a, keys, 0, 2, lambda x, y: tokens(x, y))
    pool.free("a")  # 1 free, 2 cached
    hits = pool.match(keys, 2)
    assert pool.can_take(hits, 1) and not pool.can_take(hits, 2)
    with pytest.raises(PagePoolError):
        pool.take("b", hits, 2)
    pool.check()


def test_the_same_prefix_computed_twice_is_cached_once() -> None:
    pool = PagePool(8, 4, caching=True)
    keys = page_keys(tokens(0, 8), 4)
    a, b = pool.take("a", [], 2), pool.take("b", [], 2)
    pool.publish(a, keys, 0, 2, lambda x, y: tokens(x, y))
    pool.publish(b, keys, 0, 2, lambda x, y: tokens(x, y))  # b's pages stay private
    assert len(pool.take_events()) == 1 and pool.match(keys, 2) == a
    pool.free("b")
    pool.free("a")
    assert (pool.num_free, pool.num_cached) == (6, 2)
    pool.check()


def test_reserve_after_shared_pages_then_commit() -> None:
    pool = PagePool(8, 4, caching=True)
    keys = page_keys(tokens(0, 8), 4)
    a = pool.take("a", [], 2)
    pool.publish(a, keys, 0, 2, lambda x, y: tokens(x, y))
    pool.free("a")
    hits = pool.match(keys, 2)
    r = pool.reserve("d", 3, hits)
    assert (pool.num_reserved, pool.num_held, pool.num_cached) == (3, 2, 0)
    pool.check()
    assert pool.commit("d") == [*hits, *r]
    pool.free("d")
    assert pool.idle() and pool.num_cached == 2
    pool.check()


def test_a_promised_page_evicts_nothing_until_it_is_written() -> None:
    """A request's completion pages are promised at admission and taken one at a time: cached
    pages stay cached until a decode step needs the room, and the promise is counted as taken."""
    pool = PagePool(4, 4, caching=True)
    keys = page_keys(tokens(0, 8), 4)
    a = pool.take("a", [], 2)
    pool.publish(a, keys, 0, 2, lambda x, y: tokens(x, y))
    pool.free("a")
    pool.take_events()  # 2 free, 2 cached
    b = pool.take("b", [], 1, later=2)  # one page now, two promised
    assert (pool.num_free, pool.num_cached, pool.num_promised, pool.num_available) == (1, 2, 2, 1)
    assert not pool.can_take([], 2) and pool.can_take([], 1)  # the promise is not offered again
    pool.check()
    assert pool.grow("b") not in b and pool.take_events() == []  # a free page: the cache keeps both
    assert pool.match(keys, 2) == a[:2]
    pool.grow("b")  # no page free: the deepest cached page goes, now that it must
    assert pool.take_events() == [BlockRemoved(block_hashes=[event_hash(keys[1])])]
    assert pool.match(keys, 2) == a[:1] and pool.num_promised == 0
    with pytest.raises(PagePoolError):  # the promise is spent
        pool.grow("b")
    pool.check()
    assert pool.free("b") == 3 and pool.idle() and pool.num_available == 4
    c = pool.reserve("c", 1, later=1)  # PD decode: the transfer's pages, then a promise ...
    with pytest.raises(PagePoolError):  # ... kept once the transfer is in
        pool.grow("c")
    assert pool.commit("c") == c
    pool.grow("c")
    pool.free("c")
    pool.check()
    assert pool.num_promised == 0 and pool.num_available == 4


# --- engines --------------------------------------------------------------------------------------


@pytest.fixture
def mock_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 500, "max_position_embeddings": 256, "eos_token_id": 2}))
    return str(tmp_path)


class CountingTiming(MockTiming):
    """The mock's timing model, recording the prompt tokens each step computes."""

    def step_cost(self, num_prompt_tokens: int, num_decoding: int) -> float:
        PREFILLED.append(num_prompt_tokens)
        return 0.0


PREFILLED: list[int] = []


async def serve(engine: Engine, prompts: list[list[int]], **sampling: Any) -> list[Run]:
    """Each prompt after the previous one finished (so the earlier ones' pages are cached)."""
    rec, runs = Recorder(engine), []
    for i, prompt in enumerate(prompts):
        runs.append(await finished(rec.submit(engine, f"r{i}", prompt,
                                              SamplingParams(**sampling))))
    return runs


async def test_mock_prefill_cost_counts_only_uncached_tokens(mock_dir: str) -> None:
    PREFILLED.clear()
    eng = MockEngine(mock_dir, page_size=4, num_pages=64, timing=CountingTiming())
    await eng.start()
    try:
        system = tokens(10, 50)  # 40 tokens: 10 full pages
        runs = await serve(eng, [system + [1, 2, 3], system + [4, 5], system], max_tokens=2)
        prefilled = [n for n in PREFILLED if n]
        assert prefilled == [43, 2, 4]  # the last: its final page is recomputed (a step must
        # compute at least one token), the first 9 pages come from the cache
        assert [r.cached for r in runs] == [0, 40, 36]
        assert eng.pool.queries == 43 + 42 + 40 and eng.pool.hits == 76
        await wait_idle(eng)
    finally:
        await eng.shutdown()


async def test_mock_without_cache_recomputes_every_prompt(mock_dir: str) -> None:
    PREFILLED.clear()
    eng = MockEngine(mock_dir, page_size=4, num_pages=64, timing=CountingTiming(),
                     prefix_cache=False)
    await eng.start()
    try:
        system = tokens(10, 50)
        runs = await serve(eng, [system + [1], system + [2]], max_tokens=2)
        assert [n for n in PREFILLED if n] == [41, 41] and [r.cached for r in runs] == [0, 0]
        assert eng.pool.num_cached == 0
        await wait_idle(eng)
    finally:
        await eng.shutdown()


async def test_mock_evicts_under_pressure_and_stays_exact(mock_dir: str) -> None:
    """A pool too small to keep every prefix: pages are evicted, never lost, and the tokens are
    the cache-off engine's."""
    on = MockEngine(mock_dir, page_size=4, num_pages=12, max_batch=2)
    off = MockEngine(mock_dir, page_size=4, num_pages=12, max_batch=2, prefix_cache=False)
    await on.start()
    await off.start()
    try:
        prompts = [tokens(g * 20, g * 20 + 9) + [q] for g in range(4) for q in range(3)]
        prompts = prompts + prompts[::-1]
        got = await serve(on, prompts, max_tokens=6)
        want = await serve(off, prompts, max_tokens=6)
        assert [r.ids for r in got] == [r.ids for r in want]
        assert any(r.cached for r in got) and on.pool.num_available == 12
        await wait_idle(on)
        await wait_idle(off)
    finally:
        await on.shutdown()
        await off.shutdown()


async def test_mock_keeps_cached_pages_until_decode_writes_past_the_free_ones(
        mock_dir: str) -> None:
    """A request's completion pages are promised, not taken, at admission: a long max_tokens
    evicts no cached prefix until its decode needs the room, and the promise is kept."""
    eng = MockEngine(mock_dir, page_size=4, num_pages=8)
    await eng.start()
    try:
        system = tokens(10, 26)  # 16 tokens: 4 pages, cached once served
        await serve(eng, [system + [1]], max_tokens=1)
        assert (eng.pool.num_cached, eng.pool.num_free) == (4, 4)
        seen: list[tuple[int, int, int]] = []
        rec = Recorder(eng)
        run = rec.submit(eng, "long", [3, 4, 5], SamplingParams(max_tokens=16))  # 5 pages at most
        run.on_output = lambda _: seen.append(
            (len(run.ids), eng.pool.num_cached, eng.pool.num_promised))
        await finished(run)
        assert run.finish == "length" and len(run.ids) == 16
        assert seen[0] == (1, 4, 4)  # admitted with 1 page and 4 promised; nothing evicted
        assert min(c for _, c, _ in seen) == 3  # its 5th page, once written, took a cached one
        await wait_idle(eng)
        assert eng.pool.num_promised == 0 and eng.pool.num_available == 8
    finally:
        await eng.shutdown()


@pytest.fixture
async def ref_pair(tiny_model: str) -> Any:
    from tandem.engines.reference import ReferenceEngine

    on = ReferenceEngine(Path(tiny_model), page_size=4, num_pages=96, max_batch=8)
    off = ReferenceEngine(Path(tiny_model), page_size=4, num_pages=96, max_batch=8,
                          prefix_cache=False)
    await on.start()
    await off.start()
    yield on, off
    for e in (on, off):
        await wait_idle(e)
        await e.shutdown()


SAMPLINGS = [{"temperature": 0.0}, {"temperature": 0.9, "seed": 5, "top_p": 0.9}]


@pytest.mark.parametrize("case", range(len(SAMPLINGS)))
async def test_reference_is_token_exact_with_the_cache(ref_pair: Any, case: int) -> None:
    """Prompts sharing a prefix, ending before, at and after page boundaries, one after another:
    the later ones reuse cached pages, and every token equals the cache-off engine's."""
    on, off = ref_pair
    system = [(7 * i + 3) % 250 + 5 for i in range(13)]
    prompts = [system + [40, 41], system[:12], system[:8], system + [40, 41, 42, 43, 44],
               system[:9], system + [40, 41, 50]]
    sp = dict(max_tokens=9, ignore_eos=True, **SAMPLINGS[case])
    got = await serve(on, prompts, **sp)
    want = await serve(off, prompts, **sp)
    assert [r.ids for r in got] == [r.ids for r in want]
    assert [r.cached for r in got] == [0, 8, 4, 12, 8, 12]
    # a follow-up turn: the whole earlier exchange (prompt and completion) is its prefix
    turn = prompts[0] + got[0].ids + [60, 61]
    [g], [w] = await serve(on, [turn], **sp), await serve(off, [turn], **sp)
    # (the K/V of 15 + 8 tokens was computed, the last token's never: 5 full pages published)
    assert g.ids == w.ids and g.cached == 20


async def test_reference_n_concurrent_and_after_cancel(ref_pair: Any) -> None:
    """Several requests with one prompt at once (none cached yet), one cancelled mid-decode, then
    more: token-exact, and the cancelled request's published pages serve the later ones."""
    on, off = ref_pair
    prompt = [(5 * i + 1) % 200 + 3 for i in range(18)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=3)
    want = await serve(off, [prompt], max_tokens=8, ignore_eos=True, temperature=0.8, seed=3)
    rec = Recorder(on)
    cancelled = asyncio.Event()

    def cancel_at_second(run: Run) -> None:
        if len(run.ids) == 2 and run.handle is not None:
            run.handle.cancel()
            cancelled.set()

    runs = [rec.submit(on, f"n{i}", prompt, sp) for i in range(3)]
    victim = rec.expect("victim")
    victim.on_output = cancel_at_second
    from tandem.engines.base import EngineRequest

    victim.handle = on.submit(EngineRequest("victim", list(prompt), sp), rec)
    for r in runs:
        await finished(r)
        assert r.ids == want[0].ids
    await asyncio.wait_for(cancelled.wait(), 30)
    assert victim.ids == want[0].ids[:2] and victim.finish is None
    again = await serve(on, [prompt, prompt], max_tokens=8, ignore_eos=True, temperature=0.8,
                        seed=3)
    assert [r.ids for r in again] == [want[0].ids] * 2 and again[0].cached == 16


@pytest.mark.parametrize("kind", ["reference", "mock"])
async def test_pd_uses_both_caches_and_moves_only_missing_pages(tiny_model: str,
                                                                kind: str) -> None:
    """PD with the cache on both sides: the prefill computes only its uncached suffix and reports
    it; the decode side keeps a conversation's pages, so a follow-up turn has only the pages it
    lacks written; every token equals an aggregated cache-off run's."""
    fabric = Fabric()

    def build(handoff: Spec | None, cache: bool = True) -> Engine:
        if kind == "reference":
            from tandem.engines.reference import ReferenceEngine

            return ReferenceEngine(Path(tiny_model), page_size=4, num_pages=64, handoff=handoff,
                                   prefix_cache=cache)
        return MockEngine(tiny_model, page_size=4, num_pages=64, handoff=handoff,
                          prefix_cache=cache)

    agg, prefill, decode = build(None, False), build(Spec(fabric, "prefill")), \
        build(Spec(fabric, "decode"))
    for e in (agg, prefill, decode):
        await e.start()
    try:
        sp = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, seed=9)
        first = [(3 * i + 2) % 150 + 4 for i in range(10)]
        pd_runs = []
        prompt = first
        for turn in range(3):
            [want] = await serve(agg, [prompt], max_tokens=6, ignore_eos=True, temperature=0.7,
                                 seed=9)
            b = Bootstrap("memory", 0, turn + 1)
            p_run = Recorder(prefill).submit(prefill, f"t{turn}", prompt, sp, b)
            d_run = Recorder(decode).submit(decode, f"t{turn}", prompt, sp, b)
            await finished(p_run)
            await finished(d_run)
            assert d_run.ids == want.ids
            pd_runs.append((p_run, d_run, len(prompt)))
            prompt = prompt + d_run.ids + [turn + 20, turn + 21, turn + 22]
        # Turn 0: 10 prompt tokens, nothing cached, 3 pages written. The prefill side then has
        # its prompt's 2 full pages, the decode side the 3 full pages of the 15 tokens whose K/V
        # it holds (10 + 5 completion tokens: the last one's K/V is never computed).
        # Turn 1 (19 tokens, 5 pages): the prefill computes from 8; the decode side has 3 pages,
        # so 2 are written. Turn 2 (28 tokens, 7 pages): the prefill has turn 1's 4 full pages
        # (16 tokens); the decode side 6 (24 tokens computed), so 1 page is written.
        assert [d.cached for _, d, _ in pd_runs] == [p.cached for p, _, _ in pd_runs] == \
            [0, 8, 16]  # the usage the client sees is the prefill side's
        assert fabric.written == [3, 2, 1]
        for e in (agg, prefill, decode):
            await wait_idle(e)
    finally:
        for e in (agg, prefill, decode):
            await e.shutdown()


async def test_reference_migrated_request_is_exact_on_a_caching_worker(ref_pair: Any) -> None:
    """A request moved mid-stream (its prompt plus the completion tokens already delivered,
    `resume_offset` of them) to a worker that has its prompt cached continues exactly as the
    unmoved request did, seeded, with the cache and without."""
    from tandem.engines.base import EngineRequest

    on, off = ref_pair
    prompt = [(11 * i + 7) % 300 + 3 for i in range(21)]
    sp = dict(max_tokens=10, ignore_eos=True, temperature=0.9, seed=21)
    [whole] = await serve(on, [prompt], **sp)  # (its pages are cached on `on` now)
    done = 4
    moved = SamplingParams(max_tokens=10 - done, ignore_eos=True, temperature=0.9, seed=21)
    for engine in (on, off):
        rec = Recorder(engine)
        run = rec.expect("moved")
        run.handle = engine.submit(EngineRequest("moved", prompt + whole.ids[:done], moved,
                                                 resume_offset=done), rec)
        await finished(run)
        assert run.ids == whole.ids[done:]
        # (25 prompt tokens: the 6 full pages before the last one were cached by `whole`)
        assert run.cached == (24 if engine is on else 0)


def test_a_room_with_a_bad_skip_is_refused() -> None:
    from tandem.kv.bootstrap.checks import MAX_ROOM_PAGES, check_room
    from tandem.runtime.wire import KvLayout, KvRoom

    layout = KvLayout(0, 4096, 64)
    assert check_room(KvRoom(1, [0, 1], 3), layout) is None
    assert "skip" in (check_room(KvRoom(1, [0], -1), layout) or "")
    assert "skip" in (check_room(KvRoom(1, [0], MAX_ROOM_PAGES + 1), layout) or "")
