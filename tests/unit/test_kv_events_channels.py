"""The KV event publisher (tandem.worker.kv_events) and a router's feed (tandem.router.kv_feed) on
memory channels (tandem.runtime.frames), no sockets: every message crosses the format's frames
both ways, as WorkerLink's tests run on memory channels. A worker's publisher into a frontend's
index, a gap the replay repairs, and a batch a full subscriber missed (alone)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tandem.config import RouterConfig
from tandem.router.blocks import block_keys
from tandem.router.kv_feed import KvFeed
from tandem.router.kv_policy import KvAware
from tandem.runtime.channel import Channel
from tandem.runtime.frames import FrameCodec, MemoryPublisher, memory_frame_router
from tandem.runtime.kv_events import (PUBLISHED, REPLAY_ASKED, REPLAY_SERVED, SUBSCRIBED,
                                      BlockStored, KvEvent, LiveBatch, ReplayBatch)
from tandem.worker.kv_events import KvEventPublisher
from tests.waits import until

P = 4
PROMPT = list(range(100, 100 + 8 * P))  # 8 full pages


def page(i: int) -> list[KvEvent]:
    """Page i of PROMPT stored, linked to page i - 1 (engine hashes: i + 1)."""
    return [BlockStored(block_hashes=[i + 1], parent_block_hash=i or None,
                        token_ids=PROMPT[i * P:(i + 1) * P], block_size=P)]


class Worker:
    """A worker's two event sockets in memory: its publisher binds them, a feed connects."""

    def __init__(self, bound: int = 100_000) -> None:
        self.live = MemoryPublisher(PUBLISHED, bound)
        self.replay = memory_frame_router(REPLAY_SERVED, REPLAY_ASKED)
        self.asked = 0

    def bind(self, host: str, port: int, replay_port: int, hwm: int, whole: int) -> Any:
        return self.live, self.replay, 7001, 7002

    def subscribe(self, address: str, codec: FrameCodec[Any, LiveBatch]
                  ) -> Channel[Any, LiveBatch]:
        assert address == "tcp://10.0.0.1:7001"
        return self.live.subscribe(codec)

    def ask(self, address: str, codec: FrameCodec[int, ReplayBatch | None]
            ) -> Channel[int, ReplayBatch | None]:
        assert address == "tcp://10.0.0.1:7002"
        self.asked += 1
        return self.replay.connect(f"asker-{self.asked}".encode())


@contextlib.asynccontextmanager
async def publishing(worker: Worker) -> AsyncIterator[KvEventPublisher]:
    pub = KvEventPublisher("127.0.0.1", advertise_host="10.0.0.1", bind=worker.bind)
    await pub.start()
    try:
        yield pub
    finally:
        await pub.close()


@contextlib.asynccontextmanager
async def feeding(worker: Worker, pub: KvEventPublisher) -> AsyncIterator[tuple[KvFeed, KvAware]]:
    kv = KvAware(RouterConfig(policy="kv"), auto=False)
    kv.index("w", P).events = True
    feed = KvFeed("w", pub.events_addr, pub.replay_addr, kv.logs["w"], subscribe=worker.subscribe,
                  ask=worker.ask)
    task = asyncio.create_task(feed.run())
    try:
        yield feed, kv
    finally:
        task.cancel()
        await asyncio.wait((task,))


def held(kv: KvAware) -> int:
    """How many leading pages of PROMPT the router's index says the worker holds."""
    return kv.indexes["w"].overlap(block_keys(PROMPT, P), 0.0)


async def test_a_workers_events_reach_a_routers_index_through_the_frames() -> None:
    worker = Worker()
    async with publishing(worker) as pub, feeding(worker, pub) as (feed, kv):
        assert (pub.events_addr, pub.replay_addr) == ("tcp://10.0.0.1:7001",
                                                      "tcp://10.0.0.1:7002")
        await until(lambda: worker.asked == 1, timeout=5)  # (it caught up first: nothing yet)
        for i in range(3):
            pub.publish(page(i))
        await until(lambda: held(kv) == 3, timeout=5)
        assert kv.logs["w"].next == 3 and kv.logs["w"].gaps == 0 and feed.bad == 0
        assert pub.counts.batches_published == 3 and pub.counts.replay_requests == 1


async def test_a_full_subscriber_misses_a_batch_alone_and_gets_it_by_replay() -> None:
    worker = Worker(bound=1)
    async with publishing(worker) as pub:
        slow = worker.live.subscribe(SUBSCRIBED)  # a subscriber that does not read (yet)
        quick = worker.live.subscribe(SUBSCRIBED)
        pub.publish(page(0))
        assert [b.seq for b in quick.received()] == [0]
        pub.publish(page(1))  # slow's queue is full: it misses batch 1, quick does not
        assert [b.seq for b in quick.received()] == [1]
        assert [b.seq for b in slow.received()] == [0]
        assert (pub.counts.batches_published, pub.counts.batches_dropped) == (2, 0)
        asker = worker.replay.connect(b"late")
        asker.send_nowait(1)
        got: list[ReplayBatch | None] = []
        async with asyncio.timeout(5):
            async for item in asker:
                got.append(item)
                if item is None:
                    break
        assert [g.seq if g else None for g in got] == [1, None]
        assert got[0] is not None and got[0].batch.events == page(1)
        assert pub.counts.batches_replayed == 1
        slow.close()
        quick.close()


async def test_a_gap_on_the_live_stream_is_filled_by_replay_into_the_index() -> None:
    worker = Worker()
    async with publishing(worker) as pub:
        pub.publish(page(0))  # before the feed subscribed: it catches up by replay
        async with feeding(worker, pub) as (feed, kv):
            await until(lambda: held(kv) == 1, timeout=5)
            sub = worker.live.subscribers[0]
            worker.live.subscribers.clear()  # the subscriber misses batches 1 and 2
            pub.publish(page(1))
            pub.publish(page(2))
            worker.live.subscribers.append(sub)
            pub.publish(page(3))  # seq 3 arrives after 0: the feed asks from 1
            await until(lambda: held(kv) == 4, timeout=5)
            assert kv.logs["w"].gaps == 1 and kv.logs["w"].resets == 0
            assert worker.asked == 2
