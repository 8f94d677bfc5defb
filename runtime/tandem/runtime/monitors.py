"""ZMQ socket monitors: who watches a socket's connections (tandem.runtime.transport makes the
sockets). A bound socket counts the peers whose security handshake failed
(`count_refused_handshakes`: `protocol_errors`, tandem.runtime.refusals); a connecting one says
each time its connection drops (`disconnects`: "", or why its handshake failed). Monitors are rare
and stay on pyzmq's asyncio layer, over the libzmq context of the socket they watch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator

import zmq
import zmq.asyncio
import zmq.utils.monitor

from tandem.runtime import auth
from tandem.runtime.refusals import refused

__all__ = ["DISCONNECTS", "REFUSALS", "Monitor", "count_refused_handshakes", "disconnects",
           "take_watcher"]

REFUSALS = auth.HANDSHAKE_FAILED  # what `count_refused_handshakes` reads
DISCONNECTS = zmq.EVENT_DISCONNECTED | auth.HANDSHAKE_FAILED  # what `disconnects` reads
_monitors = itertools.count()


def take_watcher(sock: zmq.Socket) -> Monitor | None:
    """The monitor `sock` was made with and nobody reads yet (it is the taker's to close now)."""
    mon: Monitor | None = getattr(sock, "watcher", None)
    if mon is not None:
        sock.watcher = None
    return mon


class Monitor:
    """A ZMQ monitor on a socket, on from the moment it is made: made before the socket connects
    or binds, it misses no event (a failed handshake is often the only one: libzmq does not
    reconnect after it). One reader at a time (`_monitor`). The monitor is always turned off
    BEFORE its reader is closed: libzmq's I/O thread sends monitor events with a blocking send, so
    a monitor whose reader is gone stops that thread at the next event, and with it every socket
    of the context (no new connection ever connects)."""

    def __init__(self, sock: zmq.Socket, events: int) -> None:
        address = f"inproc://tandem-monitor-{next(_monitors)}"
        sock.monitor(address, events)
        self.sock, self.events = sock, events
        # (an asyncio view of the libzmq context that made `sock`: inproc needs the same one)
        self.pair = zmq.asyncio.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self.pair.connect(address)

    def close(self) -> None:
        """Off (on a socket still open), then its reader's end closed."""
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.pair.close(linger=0)


async def _monitor(sock: zmq.Socket, events: int) -> AsyncGenerator[tuple[int, int], None]:
    """Each (event, value) of `events` on `sock`: from its own monitor when it was made with one
    (`watch=`), else from one turned on now."""
    mon = take_watcher(sock) or Monitor(sock, events)
    try:
        while True:
            event = zmq.utils.monitor.parse_monitor_message(await mon.pair.recv_multipart())
            if event["event"] & events:
                yield int(event["event"]), int(event["value"])
    finally:
        mon.close()


async def disconnects(sock: zmq.Socket) -> AsyncGenerator[str, None]:
    """One item each time `sock` loses a connection: "", or why its security handshake failed
    (auth.handshake_failure: the peer holds other keys, or none)."""
    why = ""
    async with contextlib.aclosing(_monitor(sock, DISCONNECTS)) as events:
        async for event, value in events:
            if event == zmq.EVENT_DISCONNECTED:
                yield why
                why = ""
            else:
                why = auth.handshake_failure(event, value)


async def count_refused_handshakes(sock: zmq.Socket, socket: str, log: logging.Logger) -> None:
    """Until cancelled: each peer whose security handshake with bound `sock` failed (no keys, or
    another cluster's) is counted in `protocol_errors` (socket, why) and logged, rate-limited."""
    async with contextlib.aclosing(_monitor(sock, REFUSALS)) as events:
        async for event, value in events:
            refused(socket, auth.handshake_failure(event, value), log)
