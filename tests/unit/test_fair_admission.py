"""Priorities and fair admission across tenants: the frontend's admission queue (priority first,
then tenants in turn, a per-tenant share with 503 `tenant_over_share`), the engine's waiting
queue (priority, then the tenant with the fewest admitted, a place of the batch kept for a newcomer
while tenants share), the cache's eviction order (pages nobody reused go first: N7), and the
frontend handing each request's tenant and priority on.

Every ordering is observed at a deterministic point: a place frees when the test says so, and an
engine's first step is read from the outputs it delivers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.config import FrontendConfig
from tandem.engines.base import EngineOutput, EngineRequest
from tandem.engines.mock import MockEngine
from tandem.engines.pages import PagePool
from tandem.frontend.app import FrontendApp
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.tenants import parse_sources, tenant_of
from tandem.router.admission import AdmissionQueue
from tandem.runtime import errors
from tandem.runtime.wire import SamplingParams
from tests.fakes import FakePool


class Places:
    """A pool with `free` places: placing takes one; the test frees them."""

    def __init__(self) -> None:
        self.free = 0
        self.placed: list[str] = []

    def place(self, req: tuple[str, str, int]) -> str | None:
        if not self.free:
            return None
        self.free -= 1
        self.placed.append(req[0])
        return req[0]


def queue(places: Places, max_size: int = 16) -> AdmissionQueue[Any, Any]:
    return AdmissionQueue(places.place, lambda p: None, max_size, 30.0, 1.0,
                          who=lambda r: (r[1], r[2]))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_lower_priority_values_are_placed_first() -> None:
    p = Places()
    q = queue(p)
    tasks = [asyncio.create_task(q.admit((name, "t", prio)))
             for name, prio in [("p5", 5), ("p-1", -1), ("p0", 0), ("p0b", 0)]]
    await settle()
    p.free = 4
    q.wake()
    await asyncio.gather(*tasks)
    assert p.placed == ["p-1", "p0", "p0b", "p5"]


async def test_freed_places_go_to_tenants_in_turn() -> None:
    """A tenant that queued many requests first does not hold every freed place: a quiet one's
    request goes next (FIFO placed a1, a2, a3, then b1)."""
    p = Places()
    q = queue(p)
    tasks = [asyncio.create_task(q.admit((name, name[0], 0))) for name in ("a1", "a2", "a3")]
    await settle()
    tasks.append(asyncio.create_task(q.admit(("b1", "b", 0))))
    await settle()
    for _ in range(4):
        p.free = 1
        q.wake()
        await settle()
    await asyncio.gather(*tasks)
    assert p.placed == ["a1", "b1", "a2", "a3"]


async def test_a_tenant_over_its_share_gets_503_and_gives_way() -> None:
    p = Places()
    q = queue(p, max_size=4)
    a = [asyncio.create_task(q.admit((f"a{i}", "a", 0))) for i in range(4)]  # alone: all of it
    await settle()
    assert len(q) == 4
    b = asyncio.create_task(q.admit(("b1", "b", 0)))  # full, but b is under its share (2 of 4)
    await settle()
    with pytest.raises(errors.Unavailable, match="more than its share of the queue") as e:
        await a[3]  # a's last waiter made room
    assert e.value.status == 503 and e.value.retry_after
    with pytest.raises(errors.Unavailable, match="this client has 3 requests waiting, its share"):
        await q.admit(("a5", "a", 0))
    assert q.rejected.labels("tenant_over_share").value == 2
    p.free = 4
    q.wake()
    await asyncio.gather(b, *a[:3])
    assert p.placed == ["a0", "b1", "a1", "a2"]


async def test_a_worker_s_last_in_flight_place_waits_for_a_tenant_with_nothing_in_flight() -> None:
    """While tenants share the router, a's third request would take the worker's last in-flight
    place (of 3): it waits. b's request, arriving behind it, goes first (b has nothing in flight,
    although it was placed after a last) and is sent at once, with no place freed. A place is
    kept for a third tenant while b's request runs; a gets its second place back when b's ends.
    A router that serves one tenant gives it every place."""
    from tandem.runtime.wire import Delta, Deltas, Usage
    from tests.fakes import memory_pool

    sp = SamplingParams(max_tokens=4)
    pool, _ = memory_pool(["agg"], max_inflight_per_worker=3, queue_timeout_s=30)
    (w,) = pool.links

    async def enter(rid_tenant: str) -> Any:
        h = pool.open([1, 2, 3], sp, tenant=rid_tenant)
        await h.__aenter__()
        return h

    def end(h: Any) -> None:
        w.on_deltas(Deltas([Delta(h.rid, 0, [7], "length", Usage(3, 1))]))

    a1, a2 = await enter("a"), await enter("a")
    b0 = await enter("b")  # b was here (the router is shared), placed after a
    end(b0)
    a3 = asyncio.create_task(enter("a"))
    await settle()
    assert not a3.done() and pool.num_queued == 1 and w.num_in_flight == 2
    b1 = await asyncio.wait_for(enter("b"), 1)  # at once: no place freed in between
    assert b1.placed and not a3.done() and w.num_in_flight == 3
    end(a1)
    await settle()
    assert not a3.done() and w.num_in_flight == 2  # a's 1 and b's 1: the last is still kept
    end(b1)
    a3_h = await asyncio.wait_for(a3, 1)  # b has nothing in flight: a's second place is free
    a4 = asyncio.create_task(enter("a"))
    await settle()
    assert not a4.done() and w.num_in_flight == 2  # a has 2 of 3: the last is kept
    a4.cancel()
    for h in (a2, a3_h, b0, b1):
        h.release()
    assert w.num_in_flight == 0

    alone, _ = memory_pool(["agg"], max_inflight_per_worker=3, queue_timeout_s=30)
    held = [alone.open([1, 2, 3], sp, tenant="a") for _ in range(3)]
    assert all(h.enter_now() for h in held)  # all three places, at once
    assert alone.links[0].num_in_flight == 3


async def test_a_newcomer_s_prompt_does_not_wait_for_other_tenants_pending_prompts() -> None:
    """The page gate counts the prompts this router sent a worker whose prefill has not come back
    (router.accounting.has_pages). The engine admits a tenant with nothing there before them, into
    pages kept for it, so that tenant's request reads the report's free pages alone: b's 2-page
    prompt is sent at once while a's 4-page prompt is pending against a report of 6 free pages
    and a's next waits. One newcomer at a time: c, arriving while b's prompt is pending, waits
    too, and goes first (before a) when b's prefill comes back."""
    from tandem.runtime.wire import Delta, Deltas, Load, LoadReport, Usage
    from tests.fakes import memory_pool

    page = 4
    sp = SamplingParams(max_tokens=4)
    pool, _ = memory_pool(["agg"], pages=10, page_size=page, queue_timeout_s=30)
    (w,) = pool.links

    async def enter(tenant: str, pages: int) -> Any:
        h = pool.open(list(range(1, pages * page + 1)), sp, tenant=tenant)
        await h.__aenter__()
        return h

    def first_token(h: Any, finish: str | None = None) -> None:
        w.on_deltas(Deltas([Delta(h.rid, 0, [7], finish, Usage(1, 1) if finish else None)]))

    b0 = await enter("b", 1)  # b was here (tenants share), and left
    first_token(b0, "length")
    a1 = await enter("a", 4)
    first_token(a1)  # a1 decodes on
    w.on_load(LoadReport(1, Load(pages_free=6, pages_total=10)))
    a2 = await enter("a", 4)  # pending: 6 - 4 pages left as far as the router knows
    a3 = asyncio.create_task(enter("a", 4))
    await settle()
    assert not a3.done()
    b1 = await asyncio.wait_for(enter("b", 2), 1)  # at once
    c1 = asyncio.create_task(enter("c", 2))
    await settle()
    assert not c1.done() and not a3.done()  # b1's prompt is pending: c counts every prompt
    first_token(b1)
    c1_h = await asyncio.wait_for(c1, 1)
    assert not a3.done()  # a2's prompt still pending
    a3.cancel()
    for h in (a1, a2, b0, b1, c1_h):
        h.release()
    assert w.num_in_flight == 0 and w.pending_prefill_tokens == 0
    assert w.account.fresh_prefill_tokens == 0


# --- the engine's waiting queue -------------------------------------------------------------------

@pytest.fixture
def mock_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 500, "max_position_embeddings": 256, "eos_token_id": 2}))
    return str(tmp_path)


class FirstStep:
    def __init__(self) -> None:
        self.steps: list[list[str]] = []
        self.left: set[str] = set()
        self.done = asyncio.Event()

    def on_step(self, outputs: list[EngineOutput]) -> None:
        self.steps.append([o.rid for o in outputs])
        for o in outputs:
            if o.finish_reason is not None:
                self.left.discard(o.rid)
        if not self.left:
            self.done.set()


async def test_the_engine_admits_by_priority_then_tenants_in_turn(mock_dir: str) -> None:
    """Batch of 2: tenant a's four requests arrived first, then b's one, then a's urgent one
    (priority -1). The first step runs a's urgent one and b's; FIFO ran a1 and a2."""
    engine = MockEngine(mock_dir, page_size=4, num_pages=64, max_batch=2)
    await engine.start()
    sink = FirstStep()
    try:
        sp = SamplingParams(max_tokens=3, ignore_eos=True)
        for rid, tenant, prio in [("a1", "a", 0), ("a2", "a", 0), ("a3", "a", 0), ("a4", "a", 0),
                                  ("b1", "b", 0), ("urgent", "a", -1)]:
            sink.left.add(rid)
            engine.submit(EngineRequest(rid, [5, 6, 7], sp, tenant=tenant, priority=prio), sink)
        await asyncio.wait_for(sink.done.wait(), 30)
        assert sorted(sink.steps[0]) == ["b1", "urgent"]
        firsts: list[str] = []
        for step in sink.steps:
            firsts += [r for r in step if r not in firsts]
        assert firsts == ["urgent", "b1", "a1", "a2", "a3", "a4"]
    finally:
        await engine.shutdown()


async def test_one_tenant_alone_keeps_the_whole_batch(mock_dir: str) -> None:
    engine = MockEngine(mock_dir, page_size=4, num_pages=64, max_batch=2)
    await engine.start()
    sink = FirstStep()
    try:
        for rid in ("x1", "x2", "x3"):
            sink.left.add(rid)
            engine.submit(EngineRequest(rid, [5, 6, 7], SamplingParams(
                max_tokens=3, ignore_eos=True), tenant="solo"), sink)
        await asyncio.wait_for(sink.done.wait(), 30)
        assert sorted(sink.steps[0]) == ["x1", "x2"]
    finally:
        await engine.shutdown()


def _tenants_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sharing window's clock stands still: every tenant counts as seen within it."""
    from tandem.runtime import sharing

    monkeypatch.setattr(sharing, "time", type("Clock", (), {"monotonic": staticmethod(
        lambda: 1000.0)}))


def _seq(rid: str, tenant: str, n_prompt: int, max_tokens: int) -> Any:
    from tandem.engines.scheduler import Sequence

    return Sequence(rid=rid, prompt_ids=list(range(1, n_prompt + 1)), stop_ids=frozenset(),
                    max_total=n_prompt + max_tokens, tenant=tenant,
                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _step(s: Any, *seqs: Any) -> list[tuple[str, int]]:
    """Queue `seqs`, run one step's schedule and compute it (a chunk advances its prompt); the
    prefill rows it ran, (rid, prompt tokens computed)."""
    from tandem.engines.scheduler import Scheduler

    for q in seqs:
        s.add(q)
    batch = s.schedule()
    out = [(q.rid, q.prefill_end - q.num_cached) for q in batch.prefill]
    for q in batch.all():
        q.in_flight = False
        q.num_cached = len(q.prompt_ids) + len(q.output_ids) if Scheduler.samples(q) \
            else q.prefill_end
    return out


def test_the_pool_s_last_pages_wait_for_a_tenant_with_nothing_admitted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One tenant cannot fill the KV pool while another shares the worker: a's ninth request
    would leave 1 of 64 pages, under the 1/16 kept (4), so it waits; b's request, arriving
    while a's eight run, is admitted at the next step instead of waiting for one of a's to end.
    A worker that serves one tenant gives it the whole pool (nine admitted)."""
    from tandem.engines.scheduler import Scheduler

    _tenants_share(monkeypatch)

    def admit(s: Scheduler, *seqs: Any) -> list[str]:
        return [rid for rid, _ in _step(s, *seqs)]

    shared = Scheduler(PagePool(64, 4), max_batch=16, max_prefill_tokens=4096)
    b0 = _seq("b0", "b", 4, 4)
    assert admit(shared, b0) == ["b0"]
    shared.finish(b0, "length")  # b was here and left: nothing of b's admitted
    flood = [_seq(f"a{i}", "a", 24, 4) for i in range(9)]  # 7 pages each (prompt 6, 1 promised)
    assert admit(shared, *flood) == [f"a{i}" for i in range(8)]  # 56 pages; the 9th would leave 1
    assert admit(shared, _seq("b1", "b", 4, 4)) == ["b1"]  # 2 pages of the 8 left: at once
    assert shared.num_waiting == 1  # (a8)
    for q in flood[:8]:
        shared.finish(q, "length")
    assert admit(shared) == ["a8"]  # (a has nothing admitted now: a newcomer, before b's step)

    alone = Scheduler(PagePool(64, 4), max_batch=16, max_prefill_tokens=4096)
    assert len(admit(alone, *[_seq(f"a{i}", "a", 24, 4) for i in range(9)])) == 9


def test_a_newcomer_tenant_goes_before_another_s_prompt_prefilled_in_chunks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefill (a budget of 8 prompt tokens a step): tenant a's 40-token prompt is
    computed 8 tokens a step, the chunk in progress first; tenant b's 4-token request, arriving
    mid-way, is admitted first in the next step and a's chunk gets the rest of the budget; a's
    own next request waits for its chunks. Alone, a tenant's chunks go first as ever."""
    from tandem.engines.scheduler import Scheduler

    _tenants_share(monkeypatch)
    shared = Scheduler(PagePool(64, 4), max_batch=16, max_prefill_tokens=8)
    b0 = _seq("b0", "b", 4, 2)
    assert _step(shared, b0) == [("b0", 4)]
    shared.finish(b0, "length")  # b was here and left: nothing of b's admitted
    assert _step(shared, _seq("a0", "a", 40, 2)) == [("a0", 8)]
    assert _step(shared, _seq("a1", "a", 4, 2), _seq("b1", "b", 4, 2)) == [("b1", 4), ("a0", 4)]
    # (b1's second step, but the two steps before were kept for newcomers, a's first and b1's, and
    # a third in a row is not: see the next test)
    assert _step(shared) == [("a0", 8)]  # (a1 waits for a's chunks: the budget is spent)

    alone = Scheduler(PagePool(64, 4), max_batch=16, max_prefill_tokens=8)
    assert _step(alone, _seq("a0", "a", 40, 2)) == [("a0", 8)]
    assert _step(alone, _seq("a1", "a", 4, 2)) == [("a0", 8)]


def test_a_newcomer_s_first_steps_compute_no_other_tenant_s_prompt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While tenants share, the step that computes a newcomer's prompt and the step of its next
    token (its first text may need both: a byte-level token can be part of a character) compute
    no other tenant's prompt, so they take a decode step's time; the newcomer's own tenant's
    prompts still go. The others' prompts wait at most two steps in a row: a stream of newcomers
    takes at most two steps of three from a chunk in progress."""
    from tandem.engines.scheduler import NEWCOMER_STEPS, Scheduler

    assert NEWCOMER_STEPS == 2
    _tenants_share(monkeypatch)
    s = Scheduler(PagePool(128, 4), max_batch=16, max_prefill_tokens=8)
    a0 = _seq("a0", "a", 80, 2)
    # a alone (no other tenant seen yet): its chunks, a step each
    assert [_step(s, a0), _step(s), _step(s)] == [[("a0", 8)]] * 3
    # b arrives with two requests: both are b's, so both go; a's chunk waits two steps
    assert _step(s, _seq("b1", "b", 4, 2), _seq("b2", "b", 4, 2)) == [("b1", 4), ("b2", 4)]
    assert _step(s, _seq("a1", "a", 4, 2)) == []  # b's second step: a's chunk and a1 wait
    assert _step(s) == [("a0", 8)]
    # newcomers every step (c, d, e, f): a's chunk still advances every third step at least
    rows = [_step(s, _seq(f"{t}1", t, 4, 2)) for t in "cdef"]
    assert rows == [[("c1", 4)], [("d1", 4)], [("e1", 4), ("a0", 4)], [("f1", 4)]]

    alone = Scheduler(PagePool(128, 4), max_batch=16, max_prefill_tokens=8)
    assert _step(alone, _seq("a0", "a", 80, 2)) == [("a0", 8)]
    assert _step(alone, _seq("a1", "a", 4, 2)) == [("a0", 8)]  # one tenant: no newcomers

    # A newcomer that ends in its first step keeps no step for itself: the next computes a's chunk
    # (a step kept for nobody would be empty, and an engine with an empty step waits for work)
    ended = Scheduler(PagePool(128, 4), max_batch=16, max_prefill_tokens=8)
    a0 = _seq("a0", "a", 80, 2)
    assert _step(ended, a0) == [("a0", 8)]
    b1 = _seq("b1", "b", 4, 1)
    assert _step(ended, b1) == [("b1", 4)]
    ended.finish(b1, "length")
    assert _step(ended) == [("a0", 8)]

    # A PD prefill worker's newcomer has one step there, its prompt's (the decode side samples on)
    pd = Scheduler(PagePool(128, 4), max_batch=16, max_prefill_tokens=8)
    a0, b1 = _seq("a0", "a", 80, 2), _seq("b1", "b", 4, 2)
    a0.pd = b1.pd = "prefill"
    assert _step(pd, a0) == [("a0", 8)]
    assert _step(pd, b1) == [("b1", 4)]
    assert _step(pd) == [("a0", 8)]


# --- eviction: a prefix others reuse outlives one tenant's unique prompts (N7) --------------------

def test_unique_prompts_do_not_evict_a_reused_prefix() -> None:
    """N7: one tenant's long unique prompts evicted another's cached system prompt (hits 1/12).
    The system prompt's pages, taken as hits by a second request, are evicted only after every
    page nobody reused, however many unique prompts come through."""
    pool = PagePool(num_pages=8, page_size=4, caching=True)
    system = [101, 102]  # the keys of the system prompt's two full pages

    def run(owner: str, keys: list[int]) -> None:
        hits = pool.match(keys, len(keys))
        pages = pool.take(owner, hits, len(keys) - len(hits))
        pool.publish(pages, keys, len(hits), len(keys), lambda a, b: [0] * (b - a))
        pool.free(owner)

    run("first", system + [1])
    run("second", system + [2])  # a hit: the system prompt is reused
    for i in range(20):  # one tenant's unique prompts, 3 pages each, over and over
        run(f"noisy{i}", [1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i])
    assert len(pool.match(system, 2)) == 2
    pool.check()


# --- the frontend hands tenant and priority on ----------------------------------------------------

def test_tenant_sources_and_digests() -> None:
    assert parse_sources("key, user,header:X-Team") == ("key", "user", "header:x-team")
    with pytest.raises(ValueError, match="not a tenant source"):
        parse_sources("cookie")
    scope = {"headers": [(b"authorization", b"Bearer sk-abc"), (b"x-team", b"blue")],
             "client": ("10.0.0.1", 1)}
    by_key = tenant_of(scope, "alice", ("key", "user"))
    assert len(by_key) == 32 and "sk-abc" not in by_key
    assert tenant_of(scope, "alice", ("user", "key")) != by_key
    assert tenant_of({"headers": [], "client": None}, "", ("key", "user")) == ""
    assert tenant_of(scope, "", ("header:x-team",)) == tenant_of(
        {"headers": [(b"x-team", b"blue")]}, "", ("header:x-team",))


async def test_the_frontend_passes_tenant_and_priority(tiny_model: str) -> None:
    pool = FakePool()
    app = FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny"), pool,
                      Preprocessor(tiny_model, "tiny"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                   "priority": -5},
                         headers={"Authorization": "Bearer k1"})
        assert r.status_code == 200
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                         headers={"Authorization": "Bearer k2"})
        assert r.status_code == 200
    (t1, p1), (t2, p2) = pool.tenants
    assert (p1, p2) == (-5, 0) and t1 and t2 and t1 != t2


async def test_tenant_and_salt_digests_are_keyed_by_the_cluster_secret(
        tiny_model: str, tmp_path: Path) -> None:
    """A frontend with cluster keys keys its identity digests with a key derived from the secret
    (tandem.runtime.auth.digest_key): the digest a worker, a KV event or a metric carries cannot
    be recomputed from a guessed user name without the secret; the same secret gives the same
    digests (every frontend of a cluster agrees), another cluster's different ones."""
    from tandem.frontend.salt import Salter
    from tandem.runtime.auth import digest_key, write_keys

    write_keys(tmp_path / "a")
    write_keys(tmp_path / "b")
    ka, kb = digest_key(str(tmp_path / "a")), digest_key(str(tmp_path / "b"))
    assert len(ka) == 32 and ka != kb and digest_key("") == b""
    assert digest_key(str(tmp_path / "a")) == ka
    scope = {"headers": [(b"authorization", b"Bearer sk-abc")], "client": None}
    plain = tenant_of(scope, "", ("key",))
    keyed = tenant_of(scope, "", ("key",), ka)
    assert keyed not in (plain, tenant_of(scope, "", ("key",), kb))
    assert Salter("user", ka)([], "alice", None) not in (
        Salter("user")([], "alice", None), Salter("user", kb)([], "alice", None))

    pool = FakePool()
    cfg = FrontendConfig(model="/models/tiny", served_model_name="tiny", cache_salt_by="user",
                         auth_keys=str(tmp_path / "a"))
    app = FrontendApp(cfg, pool, Preprocessor(tiny_model, "tiny"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                   "user": "alice"},
                         headers={"Authorization": "Bearer sk-abc"})
        assert r.status_code == 200
    ((tenant, _),) = pool.tenants
    assert tenant == keyed
    assert pool.salts == [Salter("user", ka)([], "alice", None)]
