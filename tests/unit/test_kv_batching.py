"""The decode side of the KV bootstrap (tandem.kv.bootstrap.decode.DecodeSide) sends what one loop
pass asks of one prefill worker as one message, in order, and takes a KvDones for many rooms: seen
from a test playing the prefill worker on an in-memory ROUTER channel (every message through the
wire encoding)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.kv.bootstrap.checks import NO_HELLO
from tandem.kv.bootstrap.decode import DecodeSide
from tandem.kv.transfer.movers import SimulatedMover
from tandem.runtime import wire
from tandem.runtime.channel import MemoryRouter
from tandem.runtime.errors import KvHandoffError
from tandem.runtime.wire import (Bootstrap, KvCancel, KvDone, KvDones, KvHello, KvHelloReply,
                                 KvRoom, KvRooms)


class Prefill:
    """The prefill side of the bootstrap protocol, played by the test."""

    port = 7200

    def __init__(self) -> None:
        self.router: MemoryRouter[wire.Message, wire.ToPrefill] = MemoryRouter(
            decoders=(wire.TO_PREFILL, wire.TO_DECODE))
        self.connects: list[str] = []

    def connect(self, address: str, ident: bytes):  # DecodeSide's `connect`
        self.connects.append(address)
        return self.router.connect(ident)

    async def recv(self, timeout: float = 5.0) -> tuple[bytes, wire.ToPrefill]:
        return await asyncio.wait_for(anext(aiter(self.router)), timeout)

    def send(self, ident: bytes, msg: wire.Message) -> None:
        self.router.send_nowait(ident, msg)

    async def accept(self) -> bytes:
        ident, hello = await self.recv()
        assert isinstance(hello, KvHello)
        self.send(ident, KvHelloReply(True, f"127.0.0.1:{self.port}"))
        return ident


@pytest.fixture
async def sides():
    prefill = Prefill()
    decode = DecodeSide(SimulatedMover("decode", 4096, 64), "decode", done_timeout_s=5.0,
                        transfer_timeout_s=1.0, connect=prefill.connect)
    yield prefill, decode
    await decode.close()


def fetch(prefill: Prefill, decode: DecodeSide, room: int,
          released: list[int] | None = None) -> asyncio.Task[object]:
    return asyncio.create_task(decode.fetch(
        Bootstrap("127.0.0.1", prefill.port, room), [room],
        (lambda: released.append(room)) if released is not None else (lambda: None)))


async def test_a_pass_of_rooms_leaves_as_one_message_and_one_kvdones_answers_them(sides) -> None:
    prefill, decode = sides
    released: list[int] = []
    first = fetch(prefill, decode, 1, released)  # connects, says hello
    ident = await prefill.accept()
    assert await prefill.recv() == (ident, KvRooms([KvRoom(1, [1])]))
    more = [fetch(prefill, decode, r, released) for r in (2, 3, 4)]  # one pass: one message
    _, msg = await prefill.recv()
    assert msg == KvRooms([KvRoom(2, [2]), KvRoom(3, [3]), KvRoom(4, [4])])
    prefill.send(ident, KvDones([KvDone(r, True, 100 + r) for r in (1, 2, 3)]))
    prefill.send(ident, KvDones([KvDone(4, False, error="prefill failed")]))
    got = await asyncio.wait_for(asyncio.gather(first, *more, return_exceptions=True), 5)
    assert got[:3] == [(101, None, 0), (102, None, 0), (103, None, 0)]
    assert isinstance(got[3], KvHandoffError) and "prefill failed" in str(got[3])
    assert released == [4]  # the failed one's pages, at once (a KvDone: nothing more lands)
    assert prefill.connects == [f"127.0.0.1:{prefill.port}"]  # one connection for all


async def test_a_cancel_in_the_same_pass_follows_its_room(sides) -> None:
    prefill, decode = sides
    warm = fetch(prefill, decode, 0)
    ident = await prefill.accept()
    await prefill.recv()
    prefill.send(ident, KvDones([KvDone(0, True, 7)]))
    assert await warm == (7, None, 0)
    task = fetch(prefill, decode, 9)
    await asyncio.sleep(0)  # its KvRoom waits for the end of this pass...
    task.cancel()  # ...and its cancel, made in the same pass, goes after it
    _, msg = await prefill.recv()
    assert msg == KvRooms([KvRoom(9, [9])])
    _, msg = await prefill.recv()
    assert msg == KvCancel([9])
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancels_of_one_pass_leave_as_one_kvcancel(sides) -> None:
    prefill, decode = sides
    tasks = [fetch(prefill, decode, r) for r in (1, 2, 3)]
    ident = await prefill.accept()
    assert await prefill.recv() == (ident, KvRooms([KvRoom(r, [r]) for r in (1, 2, 3)]))
    for t in tasks:
        t.cancel()
    assert await prefill.recv() == (ident, KvCancel([1, 2, 3]))
    for t in tasks:
        with pytest.raises(asyncio.CancelledError):
            await t


async def test_a_long_run_of_rooms_is_cut_at_the_batch_cap(sides, monkeypatch) -> None:
    from tandem.kv.bootstrap import prefill as prefill_side
    monkeypatch.setattr(prefill_side, "MAX_BATCH", 2)
    prefill, decode = sides
    first = fetch(prefill, decode, 1)
    ident = await prefill.accept()
    assert await prefill.recv() == (ident, KvRooms([KvRoom(1, [1])]))
    more = [fetch(prefill, decode, r) for r in (2, 3, 4, 5, 6)]
    got = [(await prefill.recv())[1] for _ in range(3)]
    assert got == [KvRooms([KvRoom(2, [2]), KvRoom(3, [3])]),
                   KvRooms([KvRoom(4, [4]), KvRoom(5, [5])]), KvRooms([KvRoom(6, [6])])]
    prefill.send(ident, KvDones([KvDone(r, True, r) for r in range(1, 7)]))
    assert await asyncio.wait_for(asyncio.gather(first, *more), 5) == [(r, None, 0)
                                                                       for r in range(1, 7)]


async def test_a_prefill_side_that_forgot_our_hello_gets_it_again_on_a_new_connection(
        sides) -> None:
    prefill, decode = sides
    task = fetch(prefill, decode, 5)
    first = await prefill.accept()
    await prefill.recv()
    prefill.send(first, KvDones([KvDone(5, False, error=NO_HELLO)]))
    second = await prefill.accept()  # hello again, as a new peer
    assert second != first
    assert await prefill.recv() == (second, KvRooms([KvRoom(5, [5])]))
    prefill.send(second, KvDones([KvDone(5, True, 11)]))
    assert await asyncio.wait_for(task, 5) == (11, None, 0)
