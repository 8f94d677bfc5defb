"""The router's fault handling without sockets (WorkerLinks over in-memory channels): a request
whose worker is lost moves to a survivor (prompt + delivered tokens, offsets shifted, bounded
moves, counted), a worker's own error does not move it, the end-to-end deadline, liveness that
does not blame a worker for the frontend's blocked loop, draining workers skipped, random ids."""

from __future__ import annotations

import asyncio
import re

import msgspec
import pytest

from tandem.router.request import DeadlineExceeded, RequestHandle
from tandem.router.pool import WorkerPool
from tandem.runtime import errors, wire
from tandem.runtime.wire import (Abort, Delta, Deltas, ErrorKind, Generate, Generates, Load,
                                 LoadQuery, LoadReport, SamplingParams, Usage)
from tests.fakes import MemoryWorkers, deltas_of, memory_pool, next_delta

SP = SamplingParams(max_tokens=6, seed=7, min_tokens=3)
PROMPT = [1, 2, 3]


def generates(workers: MemoryWorkers, address: str) -> list[Generate]:
    return [g for m in workers.sent(address) if isinstance(m, Generates) for g in m.items]


def aborts(workers: MemoryWorkers, address: str) -> list[str]:
    return [r for m in workers.sent(address) if isinstance(m, Abort) for r in m.rids]


async def placed(pool: WorkerPool, sp: SamplingParams = SP) -> RequestHandle:
    h = pool.open(list(PROMPT), sp)
    await asyncio.wait_for(h.__aenter__(), 2)
    await asyncio.sleep(0)  # the Generates of this loop pass leave
    return h


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def metric(pool: WorkerPool, name: str) -> float:
    for line in pool.registry.render().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_agg_request_moves_to_a_survivor_with_no_gap_and_no_duplicate() -> None:
    pool, workers = memory_pool(["agg", "agg"])
    w0, w1 = pool.links
    h = await placed(pool)
    assert h.workers == (w0.address,)
    w0.on_deltas(Deltas([Delta(h.rid, 0, [10, 11])]))
    first = await next_delta(h.collector)
    assert (first.offset, first.token_ids) == (0, [10, 11])
    w0.on_disconnected()  # the worker died mid-stream
    await settle()
    [g] = generates(workers, w1.address)
    assert g.prompt_ids == PROMPT + [10, 11] and g.resume_offset == 2
    assert (g.sampling.max_tokens, g.sampling.min_tokens, g.sampling.seed) == (4, 1, 7)
    assert g.rid != h.rid and h.workers == (w1.address,)
    w1.on_deltas(Deltas([Delta(g.rid, 0, [12])]))
    w1.on_deltas(Deltas([Delta(g.rid, 1, [13, 14, 15], "length", Usage(5, 4))]))
    rest = [d async for d in deltas_of(h)]
    assert [(d.offset, d.token_ids) for d in rest] == [(2, [12, 13, 14, 15])]
    assert rest[-1].finish_reason == "length" and rest[-1].rid == h.rid
    assert rest[-1].usage == Usage(3, 6)  # as if one worker had served it all
    await h.__aexit__(None, None, None)
    await settle()  # (aborts leave at the end of the pass)
    assert w1.num_in_flight == 0 and aborts(workers, w1.address) == []
    assert metric(pool, "tandem_request_migrations_total") == 1


async def test_moves_are_bounded_then_the_request_fails_clearly() -> None:
    pool, workers = memory_pool(["agg"] * 3, max_migrations=1)
    w0, w1, _ = pool.links
    h = await placed(pool)
    w0.on_disconnected()
    await settle()
    assert len(h.workers) == 1 and h.workers[0] != w0.address
    pool.link(h.workers[0]).on_disconnected()  # type: ignore[union-attr]
    with pytest.raises(errors.WorkerLost, match="moved 1 time"):
        await asyncio.wait_for(next_delta(h.collector), 2)
    await h.__aexit__(None, None, None)


async def test_requests_failed_together_each_get_their_own_error() -> None:
    """One lost worker fails all its requests with one error: each request's own words are its
    own (seen before: 20 requests, each message with "already moved" 20 times)."""
    pool, workers = memory_pool(["agg"], max_migrations=0)
    hs = [await placed(pool) for _ in range(20)]
    pool.links[0].on_disconnected()
    messages = []
    for h in hs:
        with pytest.raises(errors.WorkerLost) as e:
            await asyncio.wait_for(next_delta(h.collector), 2)
        messages.append(str(e.value))
    assert all(m.count("already moved 0 time(s)") == 1 for m in messages), messages[-1]
    assert len(set(map(len, messages))) == 1


async def test_no_moves_when_max_migrations_is_zero() -> None:
    pool, workers = memory_pool(["agg", "agg"], max_migrations=0)
    h = await placed(pool)
    pool.links[0].on_disconnected()
    with pytest.raises(errors.WorkerLost):
        await asyncio.wait_for(next_delta(h.collector), 2)
    assert generates(workers, pool.links[1].address) == []


async def test_an_engine_error_is_not_moved() -> None:
    pool, workers = memory_pool(["agg", "agg"])
    w0, w1 = pool.links
    h = await placed(pool)
    w0.on_deltas(Deltas([Delta(h.rid, 0, [], "error", error="bad", error_kind=ErrorKind.ENGINE)]))
    d = await next_delta(h.collector)
    assert d.finish_reason == "error" and d.error_kind == ErrorKind.ENGINE
    await settle()
    assert generates(workers, w1.address) == []
    assert metric(pool, "tandem_request_migrations_total") == 0


async def test_pd_decode_lost_moves_to_a_new_pair_with_a_new_room() -> None:
    pool, workers = memory_pool(["prefill", "decode", "decode"])
    p, d0, d1 = pool.links
    h = await placed(pool)
    assert h.workers == (d0.address, p.address)
    [g0] = generates(workers, p.address)
    p.on_deltas(Deltas([Delta(h.rid, 0, [10], "length", Usage(3, 1))]))  # prefill done
    d0.on_deltas(Deltas([Delta(h.rid, 0, [10, 11, 12])]))
    assert (await next_delta(h.collector)).token_ids == [10, 11, 12]
    d0.on_disconnected()
    await settle()
    [g1] = generates(workers, d1.address)
    assert generates(workers, p.address)[1:] == [g1]  # the same Generate to the new pair
    assert g1.prompt_ids == PROMPT + [10, 11, 12] and g1.resume_offset == 3
    assert g1.bootstrap is not None and g0.bootstrap is not None
    assert g1.bootstrap.room != g0.bootstrap.room
    p.on_deltas(Deltas([Delta(g1.rid, 0, [13], "length", Usage(6, 1))]))
    d1.on_deltas(Deltas([Delta(g1.rid, 0, [13, 14, 15], "length", Usage(6, 3))]))
    rest = [x async for x in deltas_of(h)]
    assert [(x.offset, x.token_ids) for x in rest] == [(3, [13, 14, 15])]
    await h.__aexit__(None, None, None)
    assert p.num_in_flight == d1.num_in_flight == 0


async def test_pd_prefill_lost_before_any_token_moves_too() -> None:
    pool, workers = memory_pool(["prefill", "prefill", "decode"])
    p0, p1, d = pool.links
    h = await placed(pool)
    assert h.workers == (d.address, p0.address)
    p0.on_disconnected()
    await settle()
    assert aborts(workers, d.address) == [h.rid]  # the old decode leg is let go
    [g] = generates(workers, p1.address)
    assert g.prompt_ids == PROMPT and g.resume_offset == 0 and g.sampling.max_tokens == 6
    assert g.rid != h.rid and h.workers == (d.address, p1.address)
    await h.__aexit__(None, None, None)
    await settle()  # (aborts leave at the end of the pass)
    assert aborts(workers, p1.address) == [g.rid]


async def test_a_request_that_gets_nothing_fails_at_its_deadline_and_is_aborted() -> None:
    pool, workers = memory_pool(["agg"], request_timeout_s=0.05)
    h = await placed(pool)  # the worker never answers (a Generates lost on the way)
    with pytest.raises(DeadlineExceeded, match="did not finish within 0.05s"):
        await asyncio.wait_for(next_delta(h.collector), 2)
    assert aborts(workers, pool.links[0].address) == [h.rid]
    assert pool.links[0].num_in_flight == 0
    assert metric(pool, "tandem_request_deadline_exceeded_total") == 1
    await h.__aexit__(None, None, None)


async def test_a_finished_request_is_not_failed_by_its_deadline() -> None:
    pool, workers = memory_pool(["agg"], request_timeout_s=0.05)
    h = await placed(pool)
    pool.links[0].on_deltas(Deltas([Delta(h.rid, 0, [5], "length", Usage(3, 1))]))
    await asyncio.sleep(0.1)
    assert [d.token_ids async for d in deltas_of(h)] == [[5]]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def up_pool(clock: Clock) -> tuple[WorkerPool, MemoryWorkers]:
    workers = MemoryWorkers()
    pool = WorkerPool(["tcp://w0"], "fe-1", connect=workers.connect, clock=clock,
                      heartbeat_interval_s=0.5, heartbeat_deadline_s=3.0)
    pool.links[0].on_message(wire.HelloReply(wire.PROTOCOL_VERSION, True, wire.WorkerInfo(
        "w0", "agg", "mock", "m", 4, 10, 100)))
    return pool, workers


def test_a_blocked_frontend_loop_does_not_make_a_live_worker_dead() -> None:
    clock = Clock()
    pool, _ = up_pool(clock)
    link = pool.links[0]
    clock.now += 10.0  # the frontend's loop was blocked 10 s: the tick comes 9.5 s late
    link.tick(late=9.5)
    assert link.state == "up"
    clock.now += 0.5
    link.tick()
    assert link.state == "up"
    for _ in range(6):  # then really silent for 3+ s of running loop: down
        clock.now += 0.5
        link.tick()
    assert link.state == "down"


async def test_any_message_is_a_heartbeat() -> None:
    clock = Clock()
    pool, workers = up_pool(clock)
    link = pool.links[0]
    for _ in range(20):  # 10 s with deltas only (no load report): alive
        clock.now += 0.5
        link.on_message(Deltas([]))
        link.tick()
    assert link.state == "up"
    assert isinstance(workers.sent(link.address)[-1], LoadQuery)


async def test_a_draining_worker_gets_no_new_request() -> None:
    pool, workers = memory_pool(["agg", "agg"])
    w0, w1 = pool.links
    w0.on_message(LoadReport(0, Load(pages_free=100, pages_total=100, draining=True)))
    hs = [await placed(pool) for _ in range(4)]
    assert all(h.workers == (w1.address,) for h in hs)
    assert generates(workers, w0.address) == []
    for h in hs:
        await h.__aexit__(None, None, None)


async def test_request_ids_and_rooms_are_random() -> None:
    pool, workers = memory_pool(["prefill", "decode"])
    hs = [await placed(pool) for _ in range(3)]
    rids = [h.rid for h in hs]
    assert all(re.fullmatch(r"[0-9a-f]{24}", r) for r in rids) and len(set(rids)) == 3
    rooms = [g.bootstrap.room for g in generates(workers, pool.links[0].address)
             if g.bootstrap is not None]
    assert len(set(rooms)) == 3
    for h in hs:
        await h.__aexit__(None, None, None)


async def test_a_worker_that_fails_at_once_is_passed_over_until_it_serves_again() -> None:
    """Least-loaded would send every request to the worker that fails them fastest (it is always
    idle): a failure streak passes it over while another can take the request, tries it again
    after a backoff, and a request it serves ends the streak."""
    clock = Clock()
    workers = MemoryWorkers()
    pool = WorkerPool(["tcp://w0", "tcp://w1"], "fe-1", connect=workers.connect, clock=clock)
    for i, link in enumerate(pool.links):
        link.on_message(wire.HelloReply(wire.PROTOCOL_VERSION, True, wire.WorkerInfo(
            f"w{i}", "agg", "mock", "m", 4, 100, 4096)))
        link.on_message(LoadReport(0, Load(pages_free=100, pages_total=100)))
    w0, w1 = pool.links

    async def one(end_on_w0: Delta | None = None) -> str:
        h = await placed(pool)
        where = h.workers[0]
        link = pool.link(where)
        assert link is not None
        d = end_on_w0 if (end_on_w0 is not None and where == w0.address) else \
            Delta(h.rid, 0, [1], "length", Usage(3, 1))
        link.on_deltas(Deltas([msgspec.structs.replace(d, rid=h.rid)]))
        await h.__aexit__(None, None, None)
        return where

    broken = Delta("x", 0, [], "error", error="no KV", error_kind=ErrorKind.KV_TRANSFER)
    assert await one(broken) == w0.address  # (least loaded, first in order: w0)
    assert w0.streak.count == 1
    assert {await one(broken) for _ in range(5)} == {w1.address}  # passed over while it waits
    clock.now += 0.6  # its first backoff (0.5 s) is over: tried again, fails again
    assert await one(broken) == w0.address and w0.streak.count == 2
    assert {await one(broken) for _ in range(5)} == {w1.address}  # now for 1 s
    clock.now += 1.1
    assert await one() == w0.address and w0.streak.count == 0  # it served: back in the rotation
    assert (await pool.snapshot())[0]["failed_in_a_row"] == 0


@pytest.mark.parametrize("with_tokens", [False, True])
async def test_a_request_a_draining_worker_ends_moves_like_one_it_lost(with_tokens: bool) -> None:
    """A worker that shuts down ends what did not finish within its drain deadline with a
    DRAINING error (or refuses a request with it as it starts draining): the request moves to
    another worker with what was delivered, as if the worker had crashed, instead of failing.
    (Seen before: a graceful restart failed long streams that a crash would have moved.)"""
    pool, workers = memory_pool(["agg", "agg"])
    w0, w1 = pool.links
    h = await placed(pool)
    w0.on_deltas(Deltas([Delta(h.rid, 0, [10, 11])]))
    assert (await next_delta(h.collector)).token_ids == [10, 11]
    last = [12] if with_tokens else []  # (the outbox may merge tokens into the last delta)
    w0.on_deltas(Deltas([Delta(h.rid, 2, last, "error", error="the worker shut down: not "
                               "finished within its 10s drain", error_kind=ErrorKind.DRAINING)],
                        load=Load(pages_free=100, pages_total=100, draining=True)))
    await settle()
    [g] = generates(workers, w1.address)
    done = 2 + len(last)
    assert g.prompt_ids == PROMPT + [10, 11] + last and g.resume_offset == done
    w1.on_deltas(Deltas([Delta(g.rid, 0, [20] * (6 - done), "length", Usage(3 + done, 6 - done))]))
    rest = [d async for d in deltas_of(h)]
    tokens = [t for d in rest for t in d.token_ids]
    assert tokens == last + [20] * (6 - done)
    assert rest[-1].finish_reason == "length" and rest[-1].usage == Usage(3, 6)
    assert aborts(workers, w0.address) == []  # the worker ended it itself
    assert w0.streak.count == 0  # a drain is not a failure of the worker
    await h.__aexit__(None, None, None)
    assert metric(pool, "tandem_request_migrations_total") == 1


async def test_pd_a_kv_handoff_that_fails_moves_to_a_new_pair() -> None:
    """The decode worker's KV did not come (here the prefill worker died, and the decode side's
    connection saw it before this frontend's link to that worker did): the request moves to a new
    pair, as it does when the prefill worker's loss is seen first. (Seen before: that race turned
    two requests of a prefill death into 502s instead of moves.)"""
    pool, workers = memory_pool(["prefill", "prefill", "decode"])
    p0, p1, d = pool.links
    h = await placed(pool)
    assert h.workers == (d.address, p0.address)
    [g0] = generates(workers, d.address)
    d.on_deltas(Deltas([Delta(g0.rid, 0, [], "error", error="room 7: prefill failed: prefill "
                              "worker at 127.0.0.1:9 disconnected",
                              error_kind=ErrorKind.KV_TRANSFER)]))
    p0.on_disconnected()  # (its link sees the loss later)
    await settle()
    [g1] = generates(workers, p1.address)
    assert generates(workers, d.address)[1:] == [g1] and g1.rid != g0.rid
    assert g1.bootstrap is not None and g0.bootstrap is not None
    assert g1.bootstrap.room != g0.bootstrap.room
    p1.on_deltas(Deltas([Delta(g1.rid, 0, [10], "length", Usage(3, 1))]))
    d.on_deltas(Deltas([Delta(g1.rid, 0, [10, 11, 12, 13, 14, 15], "length", Usage(3, 6))]))
    rest = [x async for x in deltas_of(h)]
    assert [t for x in rest for t in x.token_ids] == [10, 11, 12, 13, 14, 15]
    assert rest[-1].finish_reason == "length"
    await h.__aexit__(None, None, None)
    assert metric(pool, "tandem_request_migrations_total") == 1
