"""Channels (tandem.runtime.channel): the in-memory ROUTER end routes by identity and crosses the
wire encoding; a send to a peer that is gone is `ChannelFull`, as on ZMQ; `serve`, the one
receive loop, drops (and counts) a message its handler fails on and goes on."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tandem.runtime import transport, wire
from tandem.runtime.channel import ChannelFull, MemoryRouter, ZmqRouterChannel, serve
from tests.cluster import free_port

log = logging.getLogger("test")


async def test_a_memory_router_routes_by_identity_through_the_wire() -> None:
    router: MemoryRouter = MemoryRouter(decoders=(wire.TO_WORKER, wire.TO_FRONTEND))
    a, b = router.connect(b"a"), router.connect(b"b")
    a.send_nowait(wire.LoadQuery(1))
    b.send_nowait(wire.LoadQuery(2))
    got = [await asyncio.wait_for(anext(aiter(router)), 1) for _ in range(2)]
    assert got == [(b"a", wire.LoadQuery(1)), (b"b", wire.LoadQuery(2))]
    router.send_nowait(b"b", wire.LoadReport(2, wire.Load()))
    assert b.received() == [wire.LoadReport(2, wire.Load())] and a.received() == []
    with pytest.raises(wire.ProtocolError):  # a worker's message is not a frontend's to send
        router.send_nowait(b"a", wire.LoadQuery(3))
    a.close()
    with pytest.raises(ChannelFull):  # gone
        router.send_nowait(b"a", wire.LoadReport(1, wire.Load()))
    with pytest.raises(ChannelFull):  # never known
        router.send_nowait(b"zz", wire.LoadReport(1, wire.Load()))


async def test_serve_drops_what_its_handler_fails_on_and_goes_on() -> None:
    router: MemoryRouter = MemoryRouter()
    peer = router.connect(b"p")
    seen: list[int] = []

    def handle(item: tuple[bytes, wire.ToWorker]) -> None:
        _, msg = item
        assert isinstance(msg, wire.LoadQuery)
        if msg.seq == 2:
            raise ValueError("a handler bug on odd input")
        seen.append(msg.seq)

    before = transport.protocol_errors[("test", "handler failed on LoadQuery")]
    loop = asyncio.create_task(serve(router, handle, "test", log))
    for seq in (1, 2, 3):
        peer.send_nowait(wire.LoadQuery(seq))
    async with asyncio.timeout(5):
        while seen != [1, 3]:
            await asyncio.sleep(0)
    assert transport.protocol_errors[("test", "handler failed on LoadQuery")] == before + 1
    assert not loop.done()
    router.close()
    await asyncio.wait_for(loop, 5)  # a closed channel ends the loop


async def test_a_zmq_router_channel_says_channel_full_for_a_peer_it_cannot_reach() -> None:
    channel = ZmqRouterChannel(f"tcp://127.0.0.1:{free_port()}", wire.TO_WORKER, log)
    try:
        with pytest.raises(ChannelFull):
            channel.send_nowait(b"nobody", wire.LoadReport(1, wire.Load()))
    finally:
        channel.close()
    assert channel.closed
    with pytest.raises(ChannelFull):
        channel.send_nowait(b"nobody", wire.LoadReport(1, wire.Load()))
