"""The worker's KV event publisher (tandem.worker.kv_events) on real ZMQ sockets on 127.0.0.1, read
the way a router reads it: a SUB socket on the live stream (seq-numbered batches), a DEALER on the
replay socket when it sees a gap, both decoded by tandem.runtime.kv_events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
import zmq
import zmq.asyncio

from tandem.runtime import auth, transport
from tandem.runtime.kv_events import (
    BlockRemoved, BlockStored, KvEvent, decode_live, decode_replay, replay_request,
)
from tandem.worker.kv_events import KvEventPublisher, sglang_event_addrs
from tandem.worker.metrics import worker_registry
from tests.metrics_text import value

DEADLINE = 10.0


def actx() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.shadow(transport.context().underlying)


def events(i: int) -> list[KvEvent]:
    return [BlockStored(block_hashes=[i], parent_block_hash=i - 1 if i else None,
                        token_ids=[i] * 4, block_size=4), BlockRemoved(block_hashes=[i])]


async def publisher(**kw: object) -> AsyncIterator[KvEventPublisher]:
    p = KvEventPublisher("127.0.0.1", **kw)  # type: ignore[arg-type]
    await p.start()
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
async def pub() -> AsyncIterator[KvEventPublisher]:
    async for p in publisher():
        yield p


def subscriber(p: KvEventPublisher, keys: auth.ClusterKeys | None = None,
               rcvhwm: int = 1000) -> zmq.asyncio.Socket:
    sub = actx().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, rcvhwm)
    if keys is not None:
        auth.make_client(sub, keys)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(p.events_addr)
    return sub


async def joined(p: KvEventPublisher, sub: zmq.asyncio.Socket, n: int = 0) -> int:
    """Publish batches until one reaches `sub` (a subscription takes effect some time after
    connecting, ZMQ's "slow joiner"); returns the first seq it received."""
    async with asyncio.timeout(DEADLINE):
        while True:
            p.publish(events(n))
            n += 1
            try:
                frames = await asyncio.wait_for(sub.recv_multipart(), 0.05)
            except TimeoutError:
                continue
            return decode_live(frames).seq


async def replay(p: KvEventPublisher, start: int) -> list[int]:
    """What the replay socket answers from `start`: the seqs of its batches, until the end."""
    dealer = actx().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(p.replay_addr)
    try:
        await dealer.send_multipart(replay_request(start))
        seqs = []
        async with asyncio.timeout(DEADLINE):
            while (item := decode_replay(await dealer.recv_multipart())) is not None:
                assert item.batch.events == events(item.seq)
                seqs.append(item.seq)
        return seqs
    finally:
        dealer.close()


async def test_live_batches_are_seq_numbered_and_a_gap_is_repaired_by_replay(
        pub: KvEventPublisher) -> None:
    for i in range(3):  # nobody listens: the live stream loses these, the buffer keeps them
        pub.publish(events(i))
    sub = subscriber(pub)
    try:
        first = await joined(pub, sub, 3)
        for i in range(first + 1, first + 6):
            pub.publish(events(i))
        live = []
        async with asyncio.timeout(DEADLINE):
            for _ in range(5):
                batch = decode_live(await sub.recv_multipart())
                assert batch.topic == b"" and batch.batch.dp_rank == 0
                assert batch.batch.events == events(batch.seq)
                live.append(batch.seq)
    finally:
        sub.close()
    assert live == list(range(first + 1, first + 6))  # in order, none missing
    assert first >= 3  # a consumer that expected 0 sees the gap and replays from there
    assert await replay(pub, 0) == list(range(first + 6))
    assert await replay(pub, first + 4) == [first + 4, first + 5]
    assert await replay(pub, first + 6) == []  # nothing yet: only the end marker
    assert pub.counts.replay_requests == 3
    assert pub.counts.batches_replayed == first + 6 + 2


async def test_a_replay_from_a_batch_no_longer_buffered_starts_at_the_oldest() -> None:
    async for p in publisher(buffer_steps=4):
        for i in range(10):
            p.publish(events(i))
        got = await replay(p, 2)
        assert got == [6, 7, 8, 9]  # the consumer sees it starts after 2: its index is stale
        assert p.next_seq == 10


async def test_a_subscriber_that_stops_reading_misses_batches_alone_and_replay_recovers_them(
) -> None:
    async for p in publisher(hwm=4):
        slow, quick = subscriber(p, rcvhwm=1), subscriber(p)
        try:
            async with asyncio.timeout(DEADLINE):  # until both have joined, each batch read
                heard = {slow: -1, quick: -1}
                while min(heard.values()) < 0 or heard[slow] != heard[quick]:
                    first = p.next_seq
                    p.publish(events(first))
                    for sub in heard:
                        with contextlib.suppress(TimeoutError):
                            while True:  # (all it holds)
                                heard[sub] = decode_live(
                                    await asyncio.wait_for(sub.recv_multipart(), 0.05)).seq
            # The slow subscriber stops reading; 200 batches of ~250 KB (far more than its
            # queues and the TCP buffers hold): it misses some, the reading one none, and the
            # publisher neither blocks nor refuses.
            big = [BlockStored(block_hashes=[7], parent_block_hash=None,
                               token_ids=[70_000] * 50_000, block_size=50_000)]
            async with asyncio.timeout(DEADLINE * 3):
                for i in range(200):
                    p.publish(big)
                    while (seq := decode_live(await quick.recv_multipart()).seq) < first + 1 + i:
                        pass  # (a batch of the joining it had not read yet)
                    assert seq == first + 1 + i
            last = first + 200
            assert p.counts.batches_dropped == 0
            assert p.counts.batches_published == p.next_seq == last + 1
            async with asyncio.timeout(DEADLINE):  # it reads again: a gap, which replay fills
                seen = [-1]
                while seen[-1] <= last:  # (what it holds, then batches published from now on)
                    p.publish(events(p.next_seq))
                    with contextlib.suppress(TimeoutError):
                        while True:
                            seen.append(decode_live(
                                await asyncio.wait_for(slow.recv_multipart(), 0.05)).seq)
            seen = seen[1:]
        finally:
            slow.close()
            quick.close()
        missed = sorted(set(range(first + 1, seen[-1])) - set(seen))
        assert missed and seen == sorted(seen)
        d = actx().socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(p.replay_addr)
        try:
            await d.send_multipart(replay_request(missed[0]))
            got = []
            async with asyncio.timeout(DEADLINE):
                while (item := decode_replay(await d.recv_multipart())) is not None:
                    got.append(item.seq)
            assert got == list(range(missed[0], p.next_seq))
        finally:
            d.close()


async def test_publish_never_raises_and_counts(pub: KvEventPublisher) -> None:
    pub.publish([])  # nothing to say: no batch
    assert pub.next_seq == 0
    pub.publish([BlockStored(block_hashes=[1 << 70], parent_block_hash=None, token_ids=[1],
                             block_size=1)])  # not encodable: counted, no seq spent
    assert pub.next_seq == 0 and pub.counts.batches_dropped == 1
    pub.publish(events(0))  # no subscriber: taken (and dropped by ZMQ, as PUB does)
    assert (pub.counts.batches_published, pub.counts.events_published) == (1, 2)
    text = worker_registry(lambda: 0, lambda: False, kv_events=lambda: pub.counts).render()
    assert value(text, "tandem_worker_kv_events_published_total") == 2
    assert value(text, "tandem_worker_kv_event_batches_published_total") == 1
    assert value(text, "tandem_worker_kv_event_batches_dropped_total") == 1
    assert value(text, "tandem_worker_kv_event_replay_requests_total") == 0
    assert value(text, "tandem_worker_kv_event_batches_replayed_total") == 0
    off = worker_registry(lambda: 0, lambda: False).render()  # events off: no series
    assert value(off, "tandem_worker_kv_event_batches_published_total") is None


async def test_bad_replay_requests_are_counted_and_answered_by_nothing(
        pub: KvEventPublisher) -> None:
    before = transport.bad_messages["kv-replay"]
    d = actx().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(pub.replay_addr)
    try:
        await d.send_multipart([b"", b"\x01"])  # a seq of one byte
        await d.send_multipart([b"x", b"\x00" * 8])  # no delimiter
        await d.send_multipart(replay_request(0))  # then a good one: served, in order
        async with asyncio.timeout(DEADLINE):
            assert decode_replay(await d.recv_multipart()) is None
    finally:
        d.close()
    assert transport.bad_messages["kv-replay"] == before + 2  # (frames that do not decode)


async def test_close_is_safe_twice_and_publish_after_it_does_nothing() -> None:
    p = KvEventPublisher("127.0.0.1")
    await p.close()  # never started
    await p.start()
    events_addr, replay_addr = p.events_addr, p.replay_addr
    assert events_addr.startswith("tcp://127.0.0.1:") and replay_addr != events_addr
    await p.close()
    await p.close()
    p.publish(events(0))
    assert p.next_seq == 0 and p.events_addr == ""


async def test_a_replay_task_that_dies_takes_the_worker_down(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Supervised: the replay answers' task dying is fatal (outside `run`, as here, `crash`
    logs it), never a worker that publishes on with no replay; a normal close is not."""
    from tandem.runtime import lifecycle
    from tandem.worker.kv_replay import ReplayServer

    async for _ in publisher():  # (start and close, nothing wrong)
        pass
    assert "fatal" not in caplog.text

    async def boom(self: ReplayServer) -> None:
        raise RuntimeError("replay answers broke")

    monkeypatch.setattr(ReplayServer, "run", boom)
    monkeypatch.setattr(lifecycle._Process, "crashed", False)  # (restored after the test)
    async for _ in publisher():
        for _ in range(100):  # (the task runs, and dies, at the loop's next passes)
            if "fatal" in caplog.text:
                break
            await asyncio.sleep(0)
    assert "fatal: task kv-replay-answers died" in caplog.text


async def test_advertised_host_and_fixed_ports() -> None:
    from tandem.ports import free_port

    port, replay_port = free_port(), free_port()
    async for p in publisher(port=port, replay_port=replay_port, advertise_host="10.1.2.3"):
        assert (p.events_addr, p.replay_addr) == (f"tcp://10.1.2.3:{port}",
                                                  f"tcp://10.1.2.3:{replay_port}")


async def test_binding_beyond_loopback_needs_the_cluster_keys() -> None:
    p = KvEventPublisher("0.0.0.0")
    with pytest.raises(auth.AuthError):
        await p.start()
    await p.close()


async def test_with_the_cluster_keys_a_subscriber_needs_them(tmp_path: object) -> None:
    from pathlib import Path

    auth.write_keys(Path(str(tmp_path)) / "keys")
    keys = auth.load_keys(Path(str(tmp_path)) / "keys")

    def refused(socket: str) -> int:
        return sum(n for (s, what), n in transport.protocol_errors.items()
                   if s == socket and what.startswith("handshake"))

    transport.use_keys(keys)  # (the process's keys: every socket it binds uses them)
    try:
        async for p in publisher():
            transport.use_keys(None)
            await _keyless_peers_are_refused(p, keys, refused)
    finally:
        transport.use_keys(None)


async def _keyless_peers_are_refused(p: KvEventPublisher, keys: auth.ClusterKeys,
                                     refused: Callable[[str], int]) -> None:
    sub, plain, dealer = subscriber(p, keys), subscriber(p), actx().socket(zmq.DEALER)
    before = refused("kv-events"), refused("kv-replay")
    try:
        assert await joined(p, sub) >= 0  # CURVE on both sides: batches arrive
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(p.replay_addr)
        async with asyncio.timeout(DEADLINE):  # keyless peers: refused (so sent nothing)
            while refused("kv-events") == before[0] or refused("kv-replay") == before[1]:
                await asyncio.sleep(0.01)
    finally:
        for s in (sub, plain, dealer):
            s.close()


@pytest.mark.parametrize("args, want", [
    ([], ("", "")),
    (["--kv-events-config", '{"publisher": "zmq"}'], ("tcp://10.0.0.1:5557", "")),
    (['--kv-events-config={"publisher": "zmq", "endpoint": "tcp://*:6000", '
      '"replay_endpoint": "tcp://0.0.0.0:6001"}'], ("tcp://10.0.0.1:6000", "tcp://10.0.0.1:6001")),
    (["--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://router:6000"}'], ("", "")),
    (["--kv-events-config", '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:6000", '
      '"bind": true}'], ("tcp://127.0.0.1:6000", "")),
    (["--kv-events-config", '{"publisher": "null"}'], ("", "")),
    (["--kv-events-config", "not json"], ("", "")),
])
def test_sglang_event_addresses(args: Sequence[str], want: tuple[str, str]) -> None:
    assert sglang_event_addrs(["--tp-size", "1", *args], "10.0.0.1") == want


@pytest.mark.parametrize("argv, on, publishes", [
    ([], True, True),
    (["--kv-events"], True, True),
    (["--no-kv-events"], False, False),
    (["--engine", "reference"], True, True),
    (["--engine", "sglang"], True, False),  # SGLang publishes its own (--kv-events-config)
    (["--no-prefix-cache"], True, False),  # no cache, no events
])
def test_the_kv_events_flags(tmp_path: object, argv: list[str], on: bool,
                             publishes: bool) -> None:
    import json
    from pathlib import Path

    from tandem import flags, up
    from tandem.cli import parse
    from tandem.config import WorkerConfig

    model = Path(str(tmp_path)) / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 500}))
    cfg = parse(["worker", "--model", str(model), "--engine", "mock", *argv,
                 "--kv-events-port", "7001", "--kv-events-replay-port", "7002"]).config
    assert isinstance(cfg, WorkerConfig)
    assert (cfg.kv_events, cfg.publishes_kv_events) == (on, publishes)
    assert (cfg.kv_events_port, cfg.kv_events_replay_port) == (7001, 7002)
    flag = next(f for f in flags.flags_of(WorkerConfig) if f.flag == "--kv-events")
    assert flags.render(flag, False) == ["--no-kv-events"] and flags.render(flag, True) == []
    # `tandem up` forwards the switch, not the ports (each worker binds its own)
    offered = {f.flag for f in up.worker_flags()}
    assert "--kv-events" in offered and "--kv-events-port" not in offered


logging.getLogger("tandem.worker.kv_events").setLevel(logging.ERROR)  # (the drop warnings)
