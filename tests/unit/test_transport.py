"""tandem.runtime.transport drives ZMQ sockets without pyzmq's asyncio layer. ZMQ's descriptor is
edge-triggered: any call on the socket may take the one signal that says a message came. These
tests make each such call while a receive loop waits, and check the loop still gets its message;
and that a closed socket ends its loop, and that malformed messages are dropped and counted."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
import zmq

from tandem.runtime import transport, wire
from tests.cluster import free_port

log = logging.getLogger("test")


@pytest.fixture
def pair():
    port = free_port()
    router = transport.router(f"tcp://127.0.0.1:{port}")
    dealer = transport.dealer(f"tcp://127.0.0.1:{port}", b"d")
    yield router, dealer
    transport.close(dealer)
    transport.close(router)


async def _connected(router: transport.Socket, dealer: transport.Socket) -> None:
    """The dealer's connection is up (its first message reached the router)."""
    transport.send_nowait(dealer, wire.LoadQuery(0))
    got = transport.router_messages(router, wire.TO_WORKER, log)
    async with asyncio.timeout(5):
        ident, msg = await got.__anext__()
    await got.aclose()
    assert (ident, msg) == (b"d", wire.LoadQuery(0))


async def _waiting(loop_of: asyncio.Future[object]) -> None:
    """Let a receive loop that was just started reach its wait."""
    for _ in range(3):
        await asyncio.sleep(0)
    assert not loop_of.done()


async def _reply_lands_while_the_loop_waits(router: transport.Socket, dealer: transport.Socket,
                                           seq: int) -> tuple[Any, asyncio.Future[Any]]:
    """The dealer's receive loop waits; a reply reaches its pipe and its descriptor signals, but
    the event loop does not run (a blocking sleep), so nothing has read the signal yet."""
    await _connected(router, dealer)
    messages = transport.dealer_messages(dealer, wire.TO_FRONTEND, log)
    first = asyncio.ensure_future(messages.__anext__())
    await _waiting(first)
    transport.send_nowait(router, wire.LoadReport(seq, wire.Load(0, 0, 0, 0)), b"d")
    time.sleep(0.2)
    return messages, first


async def test_a_send_that_takes_the_signal_does_not_strand_a_waiting_receive(pair) -> None:
    messages, first = await _reply_lands_while_the_loop_waits(*pair, 1)
    transport.send_nowait(pair[1], wire.LoadQuery(2))  # libzmq's send takes the signal
    async with asyncio.timeout(2):  # without the re-check after the send, it never wakes
        assert await first == wire.LoadReport(1, wire.Load(0, 0, 0, 0))
    await messages.aclose()


async def test_asking_whether_a_message_waits_wakes_a_waiting_receive(pair) -> None:
    messages, first = await _reply_lands_while_the_loop_waits(*pair, 3)
    assert transport.readable(pair[1])  # (the query takes the signal)
    async with asyncio.timeout(2):
        assert (await first).seq == 3
    await messages.aclose()
    assert not transport.readable(pair[1])


async def test_closing_a_socket_ends_its_waiting_receive(pair) -> None:
    _, dealer = pair
    messages = transport.dealer_messages(dealer, wire.TO_FRONTEND, log)
    first = asyncio.ensure_future(messages.__anext__())
    await _waiting(first)
    transport.close(dealer)
    async with asyncio.timeout(2):
        with pytest.raises(StopAsyncIteration):  # the receive loop ends
            await first
    with pytest.raises(zmq.ZMQError):
        transport.send_nowait(dealer, wire.LoadQuery(1))


async def test_bad_messages_are_dropped_and_counted_and_the_next_one_arrives(pair) -> None:
    router, dealer = pair
    await _connected(router, dealer)
    before = transport.bad_messages["worker"]
    raw = zmq.Socket.shadow(dealer.underlying)  # a peer that sends anything
    raw.send(b"one frame")
    raw.send_multipart([b"x"] * 50)  # more frames than any message has
    raw.send_multipart([b"\xff", b"not a message"])
    transport.send_nowait(dealer, wire.LoadQuery(9))
    got = transport.router_messages(router, wire.TO_WORKER, log)
    async with asyncio.timeout(5):
        assert await got.__anext__() == (b"d", wire.LoadQuery(9))
    await got.aclose()
    assert transport.bad_messages["worker"] == before + 3


async def test_a_socket_has_one_receive_loop(pair) -> None:
    _, dealer = pair
    a = transport.dealer_messages(dealer, wire.TO_FRONTEND, log)
    first = asyncio.ensure_future(a.__anext__())
    await _waiting(first)
    b = transport.dealer_messages(dealer, wire.TO_FRONTEND, log)
    with pytest.raises(RuntimeError, match="one receive loop"):
        await b.__anext__()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await a.aclose()


async def test_many_round_trips_on_both_sockets_never_stall(pair) -> None:
    """Both ends send while their own loops wait: each send may take its socket's signal."""
    router, dealer = pair
    await _connected(router, dealer)
    n = 3000

    async def serve() -> None:
        async for ident, msg in transport.router_messages(router, wire.TO_WORKER, log):
            assert isinstance(msg, wire.LoadQuery)
            transport.send_nowait(router, wire.LoadReport(msg.seq, wire.Load(0, 0, 0, 0)), ident)

    server = asyncio.ensure_future(serve())
    try:
        replies = transport.dealer_messages(dealer, wire.TO_FRONTEND, log)
        async with asyncio.timeout(30):
            for i in range(n):
                transport.send_nowait(dealer, wire.LoadQuery(i))
                if i % 3 == 0:  # sometimes two in flight
                    transport.send_nowait(dealer, wire.LoadQuery(n + i))
                assert (await replies.__anext__()).seq == i  # type: ignore[union-attr]
                if i % 3 == 0:
                    assert (await replies.__anext__()).seq == n + i  # type: ignore[union-attr]
        await replies.aclose()
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
