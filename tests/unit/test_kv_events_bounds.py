"""The KV event path is bounded against hostile peers (issue 38, N5, N1, N6), on memory channels:
every malformed event is one KvEventsError, a counted drop that never ends a router's feed (N5:
invalid UTF-8 in a tag; the socket's receive loop, since memory ends decode as they send); a feed that dies is restarted, counted; replay requests queue per peer and are refused
past the bounds (N1: fifty requests at once), and the answers are sent a budget per event loop
pass; the replay buffer is bounded in bytes (N6)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from tandem.config import RouterConfig
from tandem.router.kv_feed import KvFeed, KvFeeds
from tandem.router.kv_policy import KvAware
from tandem.runtime import transport
from tandem.runtime.kv_events import (SUBSCRIBED, EventBatch, KvEventsError, decode_batch,
                                      encode_batch, live_frames)
from tandem.runtime.wire import MAX_MESSAGE_BYTES
from tandem.worker import kv_replay
from tests.unit.test_kv_events_channels import P, Worker, held, page, publishing
from tests.waits import until


def _tagged(tag: bytes) -> bytes:
    """A batch whose one event's "type" is the raw bytes `tag` (a msgpack str of them)."""
    good = msgspec.msgpack.encode([1.0, [{"type": "X" * len(tag)}], 0])
    return good.replace(b"X" * len(tag), tag)


BAD_PAYLOADS = {
    "invalid UTF-8 in the tag": _tagged(b"\xff\xfe"),
    "invalid UTF-8 in a medium": msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "YY"}], 0]
    ).replace(b"YY", b"\xc3\x28"),
    "a tag of the wrong type": msgspec.msgpack.encode([1.0, [{"type": 7}], 0]),
    "hashes of the wrong type": msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": "no"}], 0]),
    "a token id past a u32": msgspec.msgpack.encode(
        [1.0, [["BlockStored", [1], None, [1 << 40], 1]], 0]),
    "a block size of 0": msgspec.msgpack.encode(
        [1.0, [["BlockStored", [1], None, [], 0]], 0]),
    "oversize": b"\x93" + b"\x00" * (MAX_MESSAGE_BYTES + 1),
    "truncated": encode_batch(EventBatch(1.0, page(0)))[:-3],
    "not msgpack at all": b"\xc1\xc1",
}


@pytest.mark.parametrize("name", list(BAD_PAYLOADS))
def test_every_malformed_payload_is_one_kv_events_error(name: str) -> None:
    with pytest.raises(KvEventsError):
        decode_batch(BAD_PAYLOADS[name])


async def test_bad_frames_on_a_socket_are_dropped_and_the_feed_reads_on() -> None:
    """The receive loop on a real subscriber: a batch with invalid UTF-8 in its tag is one
    counted drop, and the next good batch reaches the index."""
    ctx = zmq.asyncio.Context.shadow(transport.context().underlying)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    kv = KvAware(RouterConfig(policy="kv"), auto=False)
    kv.index("w", P).events = True
    feed = KvFeed("w", f"tcp://127.0.0.1:{port}", "", kv.logs["w"])
    task = asyncio.create_task(feed.run())
    try:
        async with asyncio.timeout(10):
            seq = 0
            while feed.bad == 0:  # (until the subscription has joined: a bad batch counted)
                await pub.send_multipart(live_frames(b"", seq, BAD_PAYLOADS[
                    "invalid UTF-8 in the tag"]))
                await asyncio.sleep(0.01)
            seq = kv.logs["w"].next
            await pub.send_multipart(live_frames(b"", seq, encode_batch(
                EventBatch(1.0, page(0)))))
            await until(lambda: held(kv) == 1, timeout=5)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.wait((task,))
        pub.close()


async def test_a_feed_that_dies_is_restarted_with_a_fresh_index_and_counted() -> None:
    worker = Worker()
    async with publishing(worker) as pub:
        kv = KvAware(RouterConfig(policy="kv"), auto=False)
        feeds = KvFeeds(kv, subscribe=worker.subscribe, ask=worker.ask, backoff=(0.0, 0.0))
        feeds.up("w", "w", pub.events_addr, pub.replay_addr, P)
        try:
            pub.publish(page(0))
            await until(lambda: held(kv) == 1, timeout=5)
            first = feeds.feeds["w"][1]

            def broken(*a: Any, **k: Any) -> Any:
                raise RuntimeError("a bug in applying events")
            kv.logs["w"].live = broken  # type: ignore[method-assign]
            pub.publish(page(1))  # the feed dies on it...
            await until(lambda: feeds.restarts.get("w") == 1, timeout=5)
            # ...and starts again on a fresh index, which it fills by replay
            await until(lambda: feeds.feeds["w"][1] is not first and held(kv) == 2, timeout=5)
            assert feeds.row("w")["kv_feed_restarts"] == 1
            pub.publish(page(2))
            await until(lambda: held(kv) == 3, timeout=5)
        finally:
            await feeds.close()


async def _answers(asker: Any, ends: int) -> list[int | None]:
    got: list[int | None] = []
    async with asyncio.timeout(5):
        async for item in asker:
            got.append(None if item is None else item.seq)
            if got.count(None) == ends:
                return got
    return got


async def test_fifty_replay_requests_of_one_peer_one_answer_and_a_small_queue() -> None:
    worker = Worker()
    async with publishing(worker) as pub:
        n = 8 * kv_replay.BATCHES_PER_PASS  # (an answer takes 8 passes; the requests, 4)
        for i in range(n):
            pub.publish(page(i % 8))
        asker = worker.replay.connect(b"greedy")
        for _ in range(50):  # in one go: all are taken before the first answer is sent
            asker.send_nowait(0)
        got = await _answers(asker, 1 + kv_replay.PEER_QUEUE)
        assert got == [*range(n), None] * (1 + kv_replay.PEER_QUEUE)
        await until(lambda: pub.counts.replay_requests == 50, timeout=5)
        assert pub.counts.replay_refused == 50 - 1 - kv_replay.PEER_QUEUE
        assert pub.counts.batches_replayed == n * (1 + kv_replay.PEER_QUEUE)
        assert pub.replays is not None and not pub.replays.peers  # nothing left held


async def test_replay_answers_are_sent_a_budget_per_loop_pass() -> None:
    worker = Worker()
    async with publishing(worker) as pub:
        for i in range(3 * kv_replay.BATCHES_PER_PASS):
            pub.publish(page(i % 8))
        askers = [worker.replay.connect(f"a{i}".encode()) for i in range(3)]
        for a in askers:
            a.send_nowait(0)
        # Another task, one step per loop pass, sees at most a pass's budget sent in between.
        most, before = 0, 0

        def sent() -> int:
            return sum(len(a) for a in askers)
        async with asyncio.timeout(10):
            while pub.counts.batches_replayed < 9 * kv_replay.BATCHES_PER_PASS:
                await asyncio.sleep(0)
                now = sent()
                most, before = max(most, now - before), now
        assert 0 < most <= kv_replay.BATCHES_PER_PASS + len(askers)  # (+ their end markers)


async def test_more_peers_than_are_answered_at_once_are_refused() -> None:
    worker = Worker()
    async with publishing(worker) as pub:
        pub.publish(page(0))
        assert pub.replays is not None
        pub.replays.max_peers = 2
        askers = [worker.replay.connect(f"p{i}".encode()) for i in range(5)]
        for a in askers:
            a.send_nowait(0)
        await until(lambda: pub.counts.replay_requests == 5, timeout=5)  # (taken in one pass)
        assert pub.counts.replay_refused == 3
        await until(lambda: not pub.replays.peers, timeout=5)
        assert sorted(len(a) for a in askers) == [0, 0, 0, 2, 2]  # (batch 0, the end marker)


def test_the_replay_buffer_is_bounded_in_bytes_and_batches() -> None:
    buf = kv_replay.ReplayBuffer(steps=100, max_bytes=10_000)
    for seq in range(50):
        buf.append(seq, b"x" * 1_000)
    assert buf.bytes <= 10_000 and len(buf) == 10 and buf.oldest == 40
    for seq in range(50, 300):
        buf.append(seq, b"y")
    assert len(buf) == 100 and buf.oldest == 200 and buf.bytes == 100
    buf.append(300, b"z" * 20_000)  # one batch past the bound: only it is kept
    assert len(buf) == 1 and buf.oldest == 300
