"""A socket's disconnect monitor is torn down in the one order that cannot stop libzmq's I/O
thread: the monitor off, then its reader closed (tandem.runtime.transport.disconnects). libzmq
sends monitor events with a blocking send; a monitor whose reader was closed first blocks that
thread at the next disconnect, and with it every socket of the context: no new connection ever
connects again. (This was the reference PD tests' intermittent hang: the decode side's watcher of
a bootstrap connection closed its reader, the prefill side went away, and the next test's
bootstrap connection never connected.)"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from tandem.runtime import transport


def _context() -> zmq.asyncio.Context:
    """An asyncio view of the process's one libzmq context (the one tandem's sockets use)."""
    return zmq.asyncio.Context.shadow(transport.context().underlying)


async def _connected(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket,
                                                        bytes]:
    """A ROUTER, a DEALER connected to it, and the message ("ping") the dealer sent through."""
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    await dealer.send(b"ping")
    _, data = await asyncio.wait_for(router.recv_multipart(), 2)
    return router, dealer, bytes(data)


async def _round_trip(ctx: zmq.asyncio.Context) -> bytes:
    """A new connection in `ctx` carries a message (times out when the context is wedged)."""
    router, dealer, data = await _connected(ctx)
    transport.close(dealer)
    transport.close(router)
    return data


async def test_a_watcher_that_stops_before_its_peer_leaves_does_not_wedge_the_context() -> None:
    ctx = _context()
    for _ in range(3):
        router, dealer, _ = await _connected(ctx)
        events = transport.disconnects(dealer)
        watcher = asyncio.ensure_future(events.__anext__())  # waits for a disconnect
        await asyncio.sleep(0.01)
        watcher.cancel()  # the watcher goes first (its task was cancelled)...
        await asyncio.gather(watcher, return_exceptions=True)
        await events.aclose()
        router.close(linger=0)  # ...then the peer: the dealer's connection drops
        await asyncio.sleep(0.05)
        # A new connection in the same context still connects and carries a message (wedged,
        # this times out: and closing `dealer` would block on the stuck monitor, so it waits).
        assert await _round_trip(ctx) == b"ping"
        transport.close(dealer)


async def test_a_disconnect_is_seen_and_closing_the_socket_first_is_safe() -> None:
    ctx = _context()
    router, dealer, _ = await _connected(ctx)
    events = transport.disconnects(dealer)
    watcher = asyncio.ensure_future(events.__anext__())
    await asyncio.sleep(0.01)
    router.close(linger=0)
    await asyncio.wait_for(watcher, 2)  # the peer left: one item
    transport.close(dealer)  # the socket first (monitor off), the reader after
    await events.aclose()
    assert await _round_trip(ctx) == b"ping"
