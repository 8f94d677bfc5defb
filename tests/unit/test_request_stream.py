"""A request handle and its worker links over in-memory channels: offsets checked (a gap or an
overlap fails loudly and aborts), a worker's error reaches the reader with its kind, leaving early
aborts, a lost worker fails its requests, a PD request fails cleanly when either leg fails; and the
link's own protocol: handshake, heartbeat deadline (injected clock), dropped connection, credit."""

from __future__ import annotations

import asyncio

import pytest

from tandem.router.pool import WorkerPool
from tandem.router.request import RequestHandle
from tandem.runtime import errors, wire
from tandem.runtime.wire import (Abort, Credit, Delta, Deltas, ErrorKind, Generates, Hello,
                                 LoadQuery, SamplingParams, Usage)
from tests.fakes import MemoryWorkers, deltas_of, memory_pool, next_delta

SP = SamplingParams(max_tokens=4)


async def placed(pool: WorkerPool, ids: list[int] | None = None) -> RequestHandle:
    h = pool.open(ids or [1, 2, 3], SP)
    await h.__aenter__()
    await asyncio.sleep(0)  # its Generates leave
    return h


async def aborts(workers: MemoryWorkers, address: str) -> list[str]:
    """The rids aborted on a worker (Aborts leave at the end of a loop pass: this ends it)."""
    await asyncio.sleep(0)
    return [rid for m in workers.sent(address) if isinstance(m, Abort) for rid in m.rids]


async def test_in_order_deltas_pass_merge_while_unread_and_finish_ends_iteration() -> None:
    pool, workers = memory_pool(["agg"])
    link = pool.links[0]
    async with await placed(pool) as h:
        link.on_deltas(Deltas([Delta(h.rid, 0, [1, 2])]))
        assert [d.token_ids for d in [await next_delta(h.collector)]] == [[1, 2]]
        link.on_deltas(Deltas([Delta(h.rid, 2, [3])]))
        link.on_deltas(Deltas([Delta(h.rid, 3, [4], "length", Usage(1, 4))]))
        got = [(d.token_ids, d.finish_reason) async for d in deltas_of(h)]
    assert got == [([3, 4], "length")]  # the reader lagged: one merged delta
    assert await aborts(workers, link.address) == [] and link.num_in_flight == 0


@pytest.mark.parametrize("second_offset", [1, 3])  # overlap, gap
async def test_gap_or_overlap_fails_loudly_and_aborts(second_offset: int) -> None:
    pool, workers = memory_pool(["agg"])
    link = pool.links[0]
    with pytest.raises(errors.StreamProtocolError):
        async with await placed(pool) as h:
            link.on_deltas(Deltas([Delta(h.rid, 0, [1, 2]), Delta(h.rid, second_offset, [3])]))
            assert (await next_delta(h.collector)).token_ids == [1, 2]  # what came before is kept
            await next_delta(h.collector)
    assert link.protocol_errors == 1
    assert await aborts(workers, link.address) == [h.rid]


@pytest.mark.parametrize("kind", [k for k in ErrorKind
                                  if k not in (ErrorKind.DRAINING, ErrorKind.KV_TRANSFER)])
async def test_error_delta_reaches_the_reader_with_its_kind(kind: ErrorKind) -> None:
    """(A worker shutting down, or a KV handoff that failed: those requests move instead,
    tests/unit/test_migration.py.)"""
    pool, workers = memory_pool(["agg"])
    link = pool.links[0]
    async with await placed(pool) as h:
        link.on_deltas(Deltas([Delta(h.rid, 0, [], "error", error="nope", error_kind=kind)]))
        got = [d async for d in deltas_of(h)]
    assert [(d.finish_reason, d.error_kind, d.error) for d in got] == [("error", kind, "nope")]
    assert await aborts(workers, link.address) == []  # the worker ended it itself


async def test_leaving_early_aborts_and_worker_loss_raises() -> None:
    pool, workers = memory_pool(["agg"])
    link = pool.links[0]
    async with await placed(pool) as h:
        link.on_deltas(Deltas([Delta(h.rid, 0, [1])]))
        async for _ in deltas_of(h):
            break
    assert await aborts(workers, link.address) == [h.rid] and link.num_in_flight == 0
    with pytest.raises(errors.WorkerLost):
        async with await placed(pool) as h2:
            link.on_disconnected()
            await next_delta(h2.collector)
    assert await aborts(workers, link.address) == [h.rid]  # nothing to abort on a lost worker


async def test_pd_prefill_error_fails_the_request_and_aborts_decode() -> None:
    pool, workers = memory_pool(["prefill", "decode"])
    p, d = pool.links
    async with await placed(pool) as h:
        assert h.workers == (d.address, p.address)
        d.on_deltas(Deltas([Delta(h.rid, 0, [5])]))
        p.on_deltas(Deltas([Delta(h.rid, 0, [], "error", error="engine broke",
                                  error_kind=ErrorKind.ENGINE)]))
        got = [x async for x in deltas_of(h)]
    assert [(x.token_ids, x.finish_reason, x.error_kind) for x in got] == [
        ([5], "error", ErrorKind.ENGINE)]  # the text before the failure is kept
    assert "prefill failed: engine broke" in got[0].error
    assert await aborts(workers, d.address) == [h.rid] and await aborts(workers, p.address) == []
    assert p.num_in_flight == d.num_in_flight == 0


async def test_pd_lost_prefill_worker_fails_the_request_and_aborts_decode() -> None:
    pool, workers = memory_pool(["prefill", "decode"])
    p, d = pool.links
    with pytest.raises(errors.WorkerLost, match="prefill failed"):
        async with await placed(pool) as h:
            p.on_disconnected()
            await next_delta(h.collector)
    assert await aborts(workers, d.address) == [h.rid] and d.num_in_flight == 0


async def test_pd_decode_failure_aborts_prefill() -> None:
    pool, workers = memory_pool(["prefill", "decode"])
    p, d = pool.links
    with pytest.raises(errors.WorkerLost):
        async with await placed(pool) as h:
            d.on_disconnected()
            await next_delta(h.collector)
    assert await aborts(workers, p.address) == [h.rid] and p.num_in_flight == 0


async def test_pd_prefill_finishing_lets_decode_go_on() -> None:
    pool, workers = memory_pool(["prefill", "decode"])
    p, d = pool.links
    async with await placed(pool) as h:
        p.on_deltas(Deltas([Delta(h.rid, 0, [5], "length", Usage(3, 1))]))
        d.on_deltas(Deltas([Delta(h.rid, 0, [5, 6], "length", Usage(3, 2))]))
        got = [x.token_ids async for x in deltas_of(h)]
    assert got == [[5, 6]]
    assert await aborts(workers, p.address) == await aborts(workers, d.address) == []


# --- the link's own protocol ---------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_handshake_heartbeat_deadline_and_coming_back() -> None:
    clock = Clock()
    workers = MemoryWorkers()
    pool = WorkerPool(["tcp://w0"], "fe-1", connect=workers.connect, clock=clock,
                      heartbeat_deadline_s=3.0)
    link = pool.links[0]
    link.tick()
    assert workers.sent(link.address) == [Hello(wire.PROTOCOL_VERSION, "fe-1")]
    assert not pool.ready()
    link.on_message(wire.HelloReply(wire.PROTOCOL_VERSION, True, wire.WorkerInfo(
        "w0", "agg", "mock", "m", 4, 10, 100)))
    assert pool.ready() and link.state == "up"
    h = await placed(pool)
    clock.now += 2.0
    link.tick()  # within the deadline: a load query
    assert isinstance(workers.sent(link.address)[-1], LoadQuery)
    clock.now += 2.0
    link.tick()  # silent for 4s: down, its requests fail
    assert link.state == "down" and not pool.ready()
    with pytest.raises(errors.WorkerLost):
        await next_delta(h.collector)
    link.tick()
    assert isinstance(workers.sent(link.address)[-1], Hello)  # says hello again
    link.on_message(wire.HelloReply(wire.PROTOCOL_VERSION, True, link.info))
    assert link.state == "up"


async def test_a_refused_handshake_makes_the_link_incompatible() -> None:
    workers = MemoryWorkers()
    pool = WorkerPool(["tcp://w0"], "fe-1", connect=workers.connect)
    link = pool.links[0]
    link.on_message(wire.HelloReply(wire.PROTOCOL_VERSION + 1, False, error="version"))
    assert link.state == "incompatible" and link.error == "version"
    link.tick()
    assert workers.sent(link.address) == []  # no more hellos


async def test_credit_once_per_loop_pass_and_generates_batched() -> None:
    pool, workers = memory_pool(["agg"])
    link = pool.links[0]
    hs = [pool.open([i], SP) for i in range(3)]
    for h in hs:
        await h.__aenter__()
    await asyncio.sleep(0)
    sent = workers.sent(link.address)
    assert [[g.rid for g in m.items] for m in sent if isinstance(m, Generates)] == \
        [[h.rid for h in hs]]  # one message for the pass
    for h in hs:
        link.on_deltas(Deltas([Delta(h.rid, 0, [1])]))
    await asyncio.sleep(0)
    assert [m for m in workers.sent(link.address) if isinstance(m, Credit)] == [Credit(3)]
    for h in hs:
        await h.__aexit__(None, None, None)


async def test_a_full_channel_fails_the_requests_placed_on_it() -> None:
    pool, workers = memory_pool(["agg"])
    link = pool.links[0]
    link.channel.bound = 0  # type: ignore[attr-defined]  # the worker stopped reading
    h = pool.open([1], SP)
    await h.__aenter__()
    await asyncio.sleep(0)
    with pytest.raises(errors.Unavailable):
        await next_delta(h.collector)
    assert link.num_in_flight == 0


async def test_the_links_tasks_feed_it_from_the_channel() -> None:
    pool, workers = memory_pool(["agg"])
    link = pool.links[0]
    await pool.start()
    try:
        h = await placed(pool)
        end = workers.ends[link.address]
        end.send_nowait(Deltas([Delta(h.rid, 0, [9], "length", Usage(1, 1))]))
        got = [d.token_ids async for d in deltas_of(h)]
        assert got == [[9]]
        end.disconnect()  # the connection drops: down at once
        for _ in range(5):
            await asyncio.sleep(0)
        assert link.state == "down"
    finally:
        await pool.close()
