"""The decode side of the KV bootstrap (tandem.kv.bootstrap.decode.DecodeSide) sends what one loop pass
asks of one prefill worker as one message, in order, and takes a KvDones for many rooms: seen
from a raw ROUTER playing the prefill worker."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from tandem.kv.bootstrap.decode import DecodeSide
from tandem.kv.transfer.movers import SimulatedMover
from tandem.runtime import wire
from tandem.runtime.errors import KvHandoffError
from tandem.runtime.wire import Bootstrap, KvCancel, KvDone, KvHello, KvHelloReply, KvRoom
from tests.cluster import free_port


class Prefill:
    """A raw ROUTER on the prefill side of the bootstrap protocol."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")

    async def recv(self, timeout: float = 5.0) -> tuple[bytes, wire.ToPrefill]:
        ident, payload = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        return ident, wire.TO_PREFILL.decode(payload)

    async def send(self, ident: bytes, msg: wire.Message) -> None:
        await self.sock.send_multipart([ident, wire.encode(msg)])

    async def accept(self) -> bytes:
        ident, hello = await self.recv()
        assert isinstance(hello, KvHello)
        await self.send(ident, KvHelloReply(True, f"127.0.0.1:{self.port}"))
        return ident


@pytest.fixture
async def sides():
    prefill = Prefill()
    decode = DecodeSide(SimulatedMover("decode", 4096, 64), "decode", done_timeout_s=5.0,
                        transfer_timeout_s=1.0)
    yield prefill, decode
    await decode.close()
    prefill.sock.close(0)


async def test_a_pass_of_rooms_leaves_as_one_message_and_one_kvdones_answers_them(sides) -> None:
    prefill, decode = sides
    released: list[int] = []

    def fetch(room: int) -> asyncio.Task[object]:
        return asyncio.create_task(decode.fetch(Bootstrap("127.0.0.1", prefill.port, room),
                                                [room], lambda: released.append(room)))

    first = fetch(1)  # connects, says hello
    ident = await prefill.accept()
    assert await prefill.recv() == (ident, KvRoom(1, [1]))
    more = [fetch(r) for r in (2, 3, 4)]  # one loop pass: one message, in order
    _, msg = await prefill.recv()
    assert msg == wire.KvRooms([KvRoom(2, [2]), KvRoom(3, [3]), KvRoom(4, [4])])
    await prefill.send(ident, wire.KvDones([KvDone(r, True, 100 + r) for r in (1, 2, 3)]))
    await prefill.send(ident, KvDone(4, False, error="prefill failed"))
    got = await asyncio.wait_for(asyncio.gather(first, *more, return_exceptions=True), 5)
    assert got[:3] == [(101, None), (102, None), (103, None)]
    assert isinstance(got[3], KvHandoffError) and "prefill failed" in str(got[3])
    assert released == [4]  # the failed one's pages, at once (a KvDone: nothing more lands)


async def test_a_cancel_in_the_same_pass_follows_its_room(sides) -> None:
    prefill, decode = sides
    boot = Bootstrap("127.0.0.1", prefill.port, 0)
    warm = asyncio.create_task(decode.fetch(boot, [0], lambda: None))
    ident = await prefill.accept()
    await prefill.recv()
    await prefill.send(ident, KvDone(0, True, 7))
    assert await warm == (7, None)
    task = asyncio.create_task(decode.fetch(Bootstrap("127.0.0.1", prefill.port, 9), [9],
                                            lambda: None))
    await asyncio.sleep(0)  # its KvRoom waits for the end of this pass...
    task.cancel()  # ...and its cancel, made in the same pass, goes after it
    _, msg = await prefill.recv()
    assert msg == KvRoom(9, [9])
    _, msg = await prefill.recv()
    assert msg == KvCancel(9)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_long_run_of_rooms_is_cut_at_the_batch_cap(sides, monkeypatch) -> None:
    from tandem.kv.bootstrap import prefill as prefill_side
    monkeypatch.setattr(prefill_side, "MAX_BATCH", 2)
    prefill, decode = sides

    def fetch(room: int) -> asyncio.Task[object]:
        return asyncio.create_task(decode.fetch(Bootstrap("127.0.0.1", prefill.port, room),
                                                [room], lambda: None))

    first = fetch(1)
    ident = await prefill.accept()
    assert await prefill.recv() == (ident, KvRoom(1, [1]))
    more = [fetch(r) for r in (2, 3, 4, 5, 6)]
    got = [(await prefill.recv())[1] for _ in range(3)]
    assert got == [wire.KvRooms([KvRoom(2, [2]), KvRoom(3, [3])]),
                   wire.KvRooms([KvRoom(4, [4]), KvRoom(5, [5])]), KvRoom(6, [6])]
    await prefill.send(ident, wire.KvDones([KvDone(r, True, r) for r in range(1, 7)]))
    assert await asyncio.wait_for(asyncio.gather(first, *more), 5) == [(r, None)
                                                                       for r in range(1, 7)]
