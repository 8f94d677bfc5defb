"""The router without sockets (WorkerLinks over in-memory channels): policies (round-robin order,
least-loaded, prefix affinity by block key), backpressure accounting, and the admission queue
(bounded, deadline, FIFO wake-up, a cancelled waiter leaves)."""

from __future__ import annotations

import asyncio
import time
import weakref

import pytest

from tandem.router.link import WorkerLink
from tandem.router.pool import WorkerPool
from tandem.router.request import RequestHandle
from tandem.runtime import errors
from tandem.runtime.wire import Abort, Delta, Deltas, Generates, Load, LoadReport, Usage
from tandem.runtime.wire import SamplingParams
from tests.fakes import deltas_of, memory_pool

PAGE = 4
SP = SamplingParams(max_tokens=4)
# What each worker end received so far, by the end itself (an id() could be reused by a later
# test's channel once this one is collected, and hand it this one's messages).
_log: weakref.WeakKeyDictionary[object, list[object]] = weakref.WeakKeyDictionary()


def make_pool(roles: list[str], pages: int = 100, **router: object) -> WorkerPool:
    """A pool of real WorkerLinks over in-memory channels, every worker up."""
    return memory_pool(roles, pages, PAGE, **router)[0]


def sent(c: WorkerLink) -> list[object]:
    """Everything the frontend sent the worker of `c` so far, decoded as the worker would."""
    worker_end = c.channel.peer  # type: ignore[attr-defined]  # a MemoryChannel
    log = _log.setdefault(worker_end, [])
    log += worker_end.received()
    return log


def generates(c: WorkerLink) -> list[list[int]]:
    """The prompts of the requests sent to `c` (Generates batch a loop pass's requests)."""
    return [g.prompt_ids for m in sent(c) if isinstance(m, Generates) for g in m.items]


def worker_of(s: RequestHandle) -> str:
    assert len(s.workers) == 1
    return s.workers[0]


def finish(c: WorkerLink, rid: str, offset: int = 0) -> None:
    c.on_deltas(Deltas([Delta(rid, offset, [7], "length", Usage(1, offset + 1))]))


async def reaches_queue(pool: WorkerPool) -> None:
    """Until a request entered in a task waits in the pool's admission queue (one loop pass at a
    time; at most 100), then that exactly one does."""
    for _ in range(100):
        if pool.num_queued:
            break
        await asyncio.sleep(0)
    assert pool.num_queued == 1


async def enter(pool: WorkerPool, ids: list[int]) -> RequestHandle:
    s = pool.open(ids, SP)
    await asyncio.wait_for(s.__aenter__(), 2)
    return s


# --- policies -------------------------------------------------------------------------------------
async def test_round_robin_cycles_in_worker_order():
    pool = make_pool(["agg"] * 3, policy="round-robin")
    got = [worker_of(await enter(pool, [1, 2, 3])) for _ in range(7)]
    assert got == ["tcp://w0", "tcp://w1", "tcp://w2"] * 2 + ["tcp://w0"]


async def test_round_robin_skips_a_full_worker():
    pool = make_pool(["agg"] * 3, policy="round-robin", max_inflight_per_worker=1)
    a = await enter(pool, [1])
    b = await enter(pool, [1])
    assert (worker_of(a), worker_of(b)) == ("tcp://w0", "tcp://w1")
    await a.__aexit__(None, None, None)  # w0 has room again; w2 is next in order
    assert worker_of(await enter(pool, [1])) == "tcp://w2"
    assert worker_of(await enter(pool, [1])) == "tcp://w0"


async def test_least_loaded_prefers_fewest_in_flight_then_fewest_tokens():
    pool = make_pool(["agg"] * 2)
    w0, w1 = pool.links
    a = await enter(pool, list(range(40)))
    assert worker_of(a) == "tcp://w0"
    assert worker_of(await enter(pool, [1])) == "tcp://w1"  # w0 has one in flight
    # one each now; w0 holds 40 prompt tokens, w1 one: w1 again
    assert worker_of(await enter(pool, [1])) == "tcp://w1"
    assert w0.pending_prefill_tokens == 40 and w1.pending_prefill_tokens == 2


async def test_prefix_prefers_the_worker_with_the_longest_shared_prefix():
    pool = make_pool(["agg"] * 3, policy="prefix")
    doc = list(range(100, 132))  # 8 pages
    first = await enter(pool, doc + [1, 2])
    assert worker_of(first) == "tcp://w0"
    other = await enter(pool, list(range(500, 520)))  # no match: least loaded
    assert worker_of(other) == "tcp://w1"
    # shares 8 pages with the first: goes to w0 though w0 is busier than w2
    assert worker_of(await enter(pool, doc + [3, 4, 5])) == "tcp://w0"
    # shares pages with `other` only: w1
    assert worker_of(await enter(pool, list(range(500, 512)) + [0] * 8)) == "tcp://w1"
    # no full page in common: least loaded (w2)
    assert worker_of(await enter(pool, [100, 101, 102])) == "tcp://w2"


async def test_prefix_falls_back_to_least_loaded_when_the_match_is_full():
    pool = make_pool(["agg"] * 2, policy="prefix", max_inflight_per_worker=1)
    doc = list(range(64))
    assert worker_of(await enter(pool, doc)) == "tcp://w0"
    assert worker_of(await enter(pool, doc)) == "tcp://w1"  # w0 is full


async def test_prefix_map_is_bounded():
    pool = make_pool(["agg"], policy="prefix", prefix_cache_blocks=5)
    docs = [list(range(i * 100, i * 100 + 16)) for i in range(4)]  # 4 blocks each
    for doc in docs:
        await enter(pool, doc)
    hits = pool.policy.hits  # type: ignore[attr-defined]
    await enter(pool, docs[0])  # its blocks were forgotten: the map keeps the last 5 only
    assert pool.policy.hits == hits  # type: ignore[attr-defined]
    await enter(pool, docs[3])
    assert pool.policy.hits == hits + 1  # type: ignore[attr-defined]


async def test_pd_picks_prefill_and_decode_each_within_its_role():
    pool = make_pool(["prefill", "prefill", "decode", "decode"], policy="round-robin")
    pairs = []
    for _ in range(3):
        s = await enter(pool, list(range(10)))
        decode, prefill = s.workers
        pairs.append((prefill, decode))
        await s.__aexit__(None, None, None)
    assert pairs == [("tcp://w0", "tcp://w2"), ("tcp://w1", "tcp://w3"), ("tcp://w0", "tcp://w2")]


async def test_pd_prefills_on_the_decode_worker_only_where_it_holds_more_of_the_prompt():
    """Decode-held reuse (`--pd-local-prefill-tokens`): a follow-up turn whose prefix the decode
    worker holds (its last turn's completion, which no prefill worker computed) is prefilled
    there, with no prefill worker, when it lacks few tokens and fewer than the prefill worker;
    a prefix both hold goes through the prefill worker as ever."""
    from tandem.runtime.kv_events import BlockStored

    pool = make_pool(["prefill", "decode"], policy="kv", pd_local_prefill_tokens=8)
    prompt = list(range(10, 34))  # 24 tokens: 6 pages of 4

    def holds(address: str, n_pages: int, first_hash: int) -> None:
        index = pool.policy.index(address, PAGE)  # type: ignore[attr-defined]
        index.events = True
        index.apply([BlockStored(block_hashes=list(range(first_hash, first_hash + n_pages)),
                                 parent_block_hash=None, token_ids=prompt[:n_pages * PAGE],
                                 block_size=PAGE)], 0.0)

    holds("tcp://w0", 2, 100)  # the prefill worker: the first turn's prompt
    holds("tcp://w1", 5, 200)  # the decode worker: that and the answer (lacks 4 tokens)
    s = await enter(pool, prompt)
    assert list(s.workers) == ["tcp://w1"]  # local: one worker
    await s.__aexit__(None, None, None)
    holds("tcp://w0", 5, 300)  # the prefill worker holds as much: no reason to go local
    s = await enter(pool, prompt)
    assert sorted(s.workers) == ["tcp://w0", "tcp://w1"]
    await s.__aexit__(None, None, None)
    longer = prompt + list(range(40, 56))  # the decode worker now lacks 20 > 8 tokens
    s = await enter(pool, longer)
    assert sorted(s.workers) == ["tcp://w0", "tcp://w1"]
    await s.__aexit__(None, None, None)


async def test_kv_policy_waits_at_the_full_worker_that_holds_the_prefix_when_the_rest_fits():
    """A worker short of free pages for the whole prompt still takes it from the kv policy when
    what it lacks fits (its cached prefix is its own): the next turn waits there rather than be
    computed again elsewhere. When what it lacks does not fit, the request goes to a worker with
    room; with none, it waits in the frontend's queue. A policy that does not predict is never
    offered the short worker."""
    from tandem.runtime.kv_events import BlockStored

    prompt = list(range(10, 26))  # 16 tokens: 4 pages of 4, of which 3 may be cached

    def holds(pool: WorkerPool, address: str, n_pages: int) -> None:
        index = pool.policy.index(address, PAGE)  # type: ignore[attr-defined]
        index.events = True
        index.apply([BlockStored(block_hashes=list(range(100, 100 + n_pages)),
                                 parent_block_hash=None, token_ids=prompt[:n_pages * PAGE],
                                 block_size=PAGE)], 0.0)

    pool = make_pool(["agg", "agg"], policy="kv", pages=10)
    w0, w1 = pool.links
    w0.on_load(LoadReport(0, Load(pages_free=2, pages_total=10)))  # 2 < 4, but it lacks 1
    w1.on_load(LoadReport(0, Load(pages_free=10, pages_total=10)))
    holds(pool, "tcp://w0", 3)
    s = await enter(pool, prompt)
    assert worker_of(s) == "tcp://w0" and w0.pending_prefill_tokens == PAGE
    await s.__aexit__(None, None, None)
    w0.on_load(LoadReport(1, Load(pages_free=0, pages_total=10)))  # now it lacks room for 1 too
    s = await enter(pool, prompt)
    assert worker_of(s) == "tcp://w1"
    await s.__aexit__(None, None, None)

    # one worker, short even of what it lacks: the request waits in the frontend's queue
    alone = make_pool(["agg"], policy="kv", pages=10)
    (only,) = alone.links
    only.on_load(LoadReport(0, Load(pages_free=0, pages_total=10)))
    holds(alone, "tcp://w0", 3)
    waiting = asyncio.create_task(enter(alone, prompt))
    await reaches_queue(alone)
    assert not waiting.done()
    only.on_load(LoadReport(1, Load(pages_free=1, pages_total=10)))
    s = await asyncio.wait_for(waiting, 1)
    assert worker_of(s) == "tcp://w0"
    await s.__aexit__(None, None, None)

    # least-loaded predicts nothing: the short worker is no candidate, however idle
    ll = make_pool(["agg", "agg"], policy="least-loaded", pages=10)
    a, b = ll.links
    a.on_load(LoadReport(0, Load(pages_free=0, pages_total=10)))
    busy = await enter(ll, [1])
    assert worker_of(busy) == "tcp://w1"  # b is now busier by one request, but has room
    s = await enter(ll, prompt)
    assert worker_of(s) == "tcp://w1"
    await s.__aexit__(None, None, None)
    await busy.__aexit__(None, None, None)


# --- accounting -----------------------------------------------------------------------------------
async def test_accounting_follows_a_request_from_start_to_end():
    pool = make_pool(["agg"])
    c = pool.links[0]
    s = await enter(pool, list(range(10)))
    assert (c.pending_prefill_tokens, c.active_decode_tokens, c.num_in_flight) == (10, 10, 1)
    c.on_deltas(Deltas([Delta(s.rid, 0, [1, 2])]))
    assert (c.pending_prefill_tokens, c.active_decode_tokens) == (0, 12)
    finish(c, s.rid, 2)
    # not read yet: the collector merged both deltas into one
    got = [d.token_ids async for d in deltas_of(s)]
    assert got == [[1, 2, 7]]
    await s.__aexit__(None, None, None)
    assert (c.pending_prefill_tokens, c.active_decode_tokens, c.num_in_flight) == (0, 0, 0)
    assert not any(isinstance(m, Abort) for m in sent(c))
    snap = (await pool.snapshot())[0]
    assert snap["pending_prefill_tokens"] == 0 and snap["active_decode_tokens"] == 0
    text = pool.registry.render()
    assert 'tandem_worker_active_decode_tokens{worker="tcp://w0"} 0.0' in text
    assert 'tandem_worker_pending_prefill_tokens{worker="tcp://w0"} 0.0' in text


async def test_pd_accounting_prefill_on_p_decode_on_d():
    pool = make_pool(["prefill", "decode"])
    p, d = pool.links
    s = await enter(pool, list(range(8)))
    assert (p.pending_prefill_tokens, p.active_decode_tokens) == (8, 0)
    assert (d.pending_prefill_tokens, d.active_decode_tokens) == (0, 8)
    await s.__aexit__(None, None, None)
    assert p.num_in_flight == d.num_in_flight == 0
    assert p.pending_prefill_tokens == d.active_decode_tokens == 0


async def test_pending_prefill_token_limit_queues_until_a_first_delta():
    pool = make_pool(["agg"], max_pending_prefill_tokens_per_worker=20)
    c = pool.links[0]
    a = await enter(pool, list(range(15)))
    waiting = asyncio.create_task(enter(pool, list(range(10))))
    await asyncio.sleep(0.01)
    assert not waiting.done() and pool.num_queued == 1
    c.on_deltas(Deltas([Delta(a.rid, 0, [1])]))  # a's prefill is done
    await asyncio.wait_for(waiting, 1)
    assert c.pending_prefill_tokens == 10


async def test_too_few_free_pages_queues_until_a_load_report_shows_room():
    pool = make_pool(["agg"], pages=10)
    c = pool.links[0]
    c.on_load(LoadReport(0, Load(pages_free=2, pages_total=10)))
    waiting = asyncio.create_task(enter(pool, list(range(4 * PAGE))))  # needs 4 pages
    await reaches_queue(pool)
    assert not waiting.done()
    c.on_load(LoadReport(0, Load(pages_free=6, pages_total=10)))
    await asyncio.wait_for(waiting, 1)
    # a prompt bigger than the whole worker is let through: the worker refuses it itself
    assert worker_of(await enter(pool, list(range(11 * PAGE)))) == "tcp://w0"


async def test_free_pages_count_the_prefills_this_router_sent_since_the_report():
    # one report says 6 pages are free; a 4-page prompt takes them as far as the router knows, so
    # a second waits in the frontend's queue instead of following the first onto that worker
    pool = make_pool(["agg"], pages=10)
    c = pool.links[0]
    c.on_load(LoadReport(0, Load(pages_free=6, pages_total=10)))
    a = await enter(pool, list(range(4 * PAGE)))
    assert c.pending_prefill_tokens == 4 * PAGE
    waiting = asyncio.create_task(enter(pool, list(range(100, 100 + 4 * PAGE))))
    await reaches_queue(pool)
    assert not waiting.done()
    c.on_deltas(Deltas([Delta(a.rid, 0, [1])]))  # a's prefill is done: its pages are the worker's
    await asyncio.wait_for(waiting, 1)


# --- admission queue ------------------------------------------------------------------------------
async def test_queue_is_bounded_and_wakes_in_fifo_order():
    pool = make_pool(["agg"], max_inflight_per_worker=1, max_queue=2, queue_timeout_s=5)
    c = pool.links[0]
    first = await enter(pool, [1])
    second = asyncio.create_task(enter(pool, [2]))
    await asyncio.sleep(0)
    third = asyncio.create_task(enter(pool, [3]))
    await asyncio.sleep(0.01)
    with pytest.raises(errors.Unavailable) as e:  # at once: had it waited in line, enter's 2 s
        await enter(pool, [4])  # limit would have ended it first (the queue's deadline is 5 s)
    assert e.value.retry_after and e.value.status == 503
    assert 'tandem_router_rejected_requests_total{reason="queue_full"} 1.0' in pool.registry.render()
    assert "tandem_router_queued_requests 2.0" in pool.registry.render()
    finish(c, first.rid)
    await first.__aexit__(None, None, None)
    s2 = await asyncio.wait_for(second, 1)
    await asyncio.sleep(0)  # the pass's Generates leave
    assert not third.done()
    assert generates(c) == [[1], [2]]
    await s2.__aexit__(None, None, None)  # left early: aborted, and the third goes on
    s3 = await asyncio.wait_for(third, 1)
    assert s3.placed and pool.num_queued == 0
    assert "tandem_router_queue_wait_seconds_count 3.0" in pool.registry.render()


async def test_queue_deadline_gives_503_and_leaves_the_queue():
    pool = make_pool(["agg"], max_inflight_per_worker=1, queue_timeout_s=0.1)
    await enter(pool, [1])
    t0 = time.monotonic()
    with pytest.raises(errors.Unavailable) as e:
        await pool.open([2], SP).__aenter__()  # (no time limit but the queue's own deadline)
    # Not before the deadline; the upper bound only tells the 0.1 s deadline from the default
    # 30 s one, so it is wide enough that a loaded machine's late timer cannot cross it.
    assert 0.09 < time.monotonic() - t0 < 10 and e.value.retry_after
    assert pool.num_queued == 0
    assert 'tandem_router_rejected_requests_total{reason="queue_timeout"} 1.0' in pool.registry.render()


async def test_cancelled_waiter_leaves_the_queue_and_the_next_is_woken():
    pool = make_pool(["agg"], max_inflight_per_worker=1, queue_timeout_s=5)
    c = pool.links[0]
    first = await enter(pool, [1])
    gone = asyncio.create_task(enter(pool, [2]))
    await asyncio.sleep(0)
    nxt = asyncio.create_task(enter(pool, [3]))
    await asyncio.sleep(0.01)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert pool.num_queued == 1
    await first.__aexit__(None, None, None)
    s = await asyncio.wait_for(nxt, 1)
    assert s.placed and c.num_in_flight == 1
    await asyncio.sleep(0)
    assert generates(c) == [[1], [3]]


async def test_waiter_cancelled_in_the_instant_it_was_placed_releases_the_worker():
    pool = make_pool(["agg"], max_inflight_per_worker=1, queue_timeout_s=5)
    c = pool.links[0]
    first = await enter(pool, [1])
    waiter = asyncio.create_task(pool.open([2], SP).__aenter__())
    await asyncio.sleep(0.01)
    await first.__aexit__(None, None, None)  # places the waiter (sends its Generate) ...
    waiter.cancel()  # ... and its client goes away before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert c.num_in_flight == 0 and c.active_decode_tokens == 0
    assert generates(c) == [[1], [2]]  # its Generate left before it was cancelled ...
    assert isinstance(sent(c)[-1], Abort)  # ... so it is aborted


async def test_a_request_placed_and_left_in_the_same_pass_never_reaches_the_worker():
    pool = make_pool(["agg"])
    c = pool.links[0]
    s = pool.open([1], SP)
    await s.__aenter__()  # placed at once (no queue): nothing here yields to the loop
    await s.__aexit__(None, None, None)  # before this loop pass ended: its Generate is still here
    await asyncio.sleep(0)
    assert generates(c) == [] and not sent(c)
    assert c.num_in_flight == 0 and c.active_decode_tokens == 0


async def test_enter_now_places_at_once_only_when_no_wait_is_needed():
    """`enter_now` is admission's no-wait path: placed in this pass when the line is empty and a
    worker has room (entering then only returns it); otherwise nothing is placed, and entering
    waits in line as before. A handle placed this way is left like an entered one."""
    pool = make_pool(["agg"], max_inflight_per_worker=1, queue_timeout_s=5)
    c = pool.links[0]
    first = pool.open([1], SP)
    assert first.enter_now() and first.placed and c.num_in_flight == 1
    assert await asyncio.wait_for(first.__aenter__(), 1) is first  # (no second placement)
    await asyncio.sleep(0)
    assert generates(c) == [[1]]
    second = pool.open([2], SP)
    assert not second.enter_now() and not second.placed  # the worker is full: it must wait
    waiting = asyncio.create_task(second.__aenter__())
    await asyncio.sleep(0.01)
    third = pool.open([3], SP)
    assert not third.enter_now()  # someone waits: no overtaking the line
    first.release()
    first.release()  # (safe twice)
    await asyncio.wait_for(waiting, 1)
    await asyncio.sleep(0)
    assert generates(c) == [[1], [2]] and isinstance(sent(c)[1], Abort)
    second.release()
    assert third.enter_now() and c.num_in_flight == 1
    third.release()
    await asyncio.sleep(0)
    assert c.num_in_flight == 0 and pool.num_queued == 0


async def test_enter_now_refused_places_nothing_and_entering_says_why():
    pool = make_pool(["agg"], queue_timeout_s=5)
    s = pool.open([1], SP)
    pool.links[0].on_disconnected()
    assert not s.enter_now() and not s.placed
    with pytest.raises(errors.Unavailable):
        await asyncio.wait_for(s.__aenter__(), 1)


async def test_waiters_fail_fast_when_the_last_worker_goes_down():
    pool = make_pool(["agg"], max_inflight_per_worker=1, queue_timeout_s=5)
    await enter(pool, [1])
    waiter = asyncio.create_task(enter(pool, [2]))
    await asyncio.sleep(0.01)
    pool.links[0].on_disconnected()
    with pytest.raises(errors.Unavailable):
        await asyncio.wait_for(waiter, 1)
    with pytest.raises(errors.Unavailable):
        pool.open([3], SP)


def test_an_unreachable_worker_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    from tandem.runtime.channel import memory_pair

    now = [100.0]
    frontend_end, _worker_end = memory_pair()
    link = WorkerLink("tcp://10.0.0.9:7100", "fe", frontend_end, clock=lambda: now[0],
                      heartbeat_deadline_s=3.0)
    with caplog.at_level("WARNING", logger="tandem.router"):
        for _ in range(20):  # 10 s of heartbeats with no answer to the handshake
            link.tick()
            now[0] += 0.5
    said = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(said) == 1 and "tcp://10.0.0.9:7100" in said[0], said


def test_a_worker_still_starting_is_reported_only_after_the_start_timeout(
        caplog: pytest.LogCaptureFixture) -> None:
    """A worker that never answered gets `start_timeout_s` (tandem up: its --ready-timeout) before
    the warning; once it has been up, a silent one is reported after the heartbeat deadline."""
    from tandem.runtime import wire
    from tandem.runtime.channel import memory_pair

    now = [100.0]
    frontend_end, _worker_end = memory_pair()
    link = WorkerLink("tcp://127.0.0.1:7100", "fe", frontend_end, clock=lambda: now[0],
                      heartbeat_deadline_s=3.0, start_timeout_s=30.0)

    def run(seconds: float) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="tandem.router"):
            for _ in range(int(seconds / 0.5)):
                link.tick()
                now[0] += 0.5
        return [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]

    assert run(29) == []  # starting: no alarm within the start timeout
    assert len(run(3)) == 1  # past it: said once
    link.on_message(wire.HelloReply(wire.PROTOCOL_VERSION, True, wire.WorkerInfo(
        "w", "agg", "mock", "m", 16, 64, 2048)))
    assert link.state == "up"
    link.tick()  # a heartbeat while up
    link.on_disconnected()  # it was up: now the heartbeat deadline applies
    said = run(5)
    assert len(said) == 1 and "for 3.5s" in said[0], said


async def test_the_aborts_of_one_pass_leave_as_one_message_after_its_generates():
    pool = make_pool(["agg"])
    c = pool.links[0]
    handles = [pool.open([i], SP) for i in (1, 2, 3)]
    for h in handles:
        await h.__aenter__()
    await asyncio.sleep(0)  # the pass's Generates leave: one message
    assert [type(m) for m in sent(c)] == [Generates]
    for h in handles[:2]:  # two leave in one pass: one Abort naming both
        await h.__aexit__(None, None, None)
    assert [type(m) for m in sent(c)] == [Generates]  # (not before the pass ends)
    await asyncio.sleep(0)
    assert sent(c)[1:] == [Abort([handles[0].rid, handles[1].rid])]
    await handles[2].__aexit__(None, None, None)
    await asyncio.sleep(0)
    assert sent(c)[2:] == [Abort([handles[2].rid])]


def test_decode_workers_learn_the_prefill_workers_this_frontend_uses() -> None:
    """On its handshake a decode worker is told the prefill workers' bootstrap addresses (it
    fetches KV only from those); a prefill worker that (re)joins, at a new address too, is
    announced to every decode worker that is up, before any request could name it."""
    from tandem.runtime import wire

    pool, workers = memory_pool(["prefill", "decode", "decode", "agg"])
    p, d0, d1, a = pool.links
    announced = lambda c: [m.addresses for m in sent(c) if isinstance(m, wire.Prefills)]  # noqa
    assert announced(d0) == announced(d1) == [["127.0.0.1:9"]]
    assert announced(p) == announced(a) == []
    p.on_message(wire.HelloReply(wire.PROTOCOL_VERSION, True, wire.WorkerInfo(
        "w0", "prefill", "mock", "m", PAGE, 100, 4096, bootstrap_addr="127.0.0.1:7201")))
    assert announced(d0)[-1] == announced(d1)[-1] == ["127.0.0.1:7201"]
