"""Channel: a message pipe to one peer, the seam between protocol code and sockets.

A `Channel[S, R]` sends messages of type S without awaiting (`send_nowait`; past its bound it
raises `ChannelFull` rather than grow), yields the messages it receives (async iteration, each
already decoded against the receiver's schema), says whether received messages are waiting unread
(`unread()`: the reader is behind, the peer is not silent), and reports each time the connection to
the peer drops (`disconnects()`: "", or why its security handshake failed).

- `ZmqChannel`: a frontend's DEALER socket to one worker (tandem.runtime.transport: high-water
  marks, fair receive, bad frames dropped and counted).
- `MemoryChannel`: one end of an in-memory pair (`memory_pair()`), for tests: optionally through
  the wire encoding, with a bound, and a `disconnect()` to simulate a dropped connection (or a
  failed handshake).

Protocol code (the router's WorkerLink) is written against `Channel` only, so it is tested without
sockets (ARCHITECTURE.md, "Contracts").
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Generic, Protocol, TypeVar

import zmq

from tandem.runtime import transport, wire

S = TypeVar("S", contravariant=True)
R = TypeVar("R", covariant=True)
T = TypeVar("T")
U = TypeVar("U")


class ChannelFull(Exception):
    """The peer is not reading: the channel's bound is reached."""


class Channel(Protocol[S, R]):
    @property
    def closed(self) -> bool: ...

    def send_nowait(self, msg: S) -> None: ...

    def __aiter__(self) -> AsyncIterator[R]: ...

    def unread(self) -> bool: ...

    def disconnects(self) -> AsyncIterator[str]: ...

    def close(self) -> None: ...


class ZmqChannel(Generic[T, U]):
    """A DEALER socket to `address`, receiving with `decoder`."""

    def __init__(self, address: str, identity: bytes, decoder: wire.Decoder[U],
                 log: logging.Logger) -> None:
        self.address = address
        self._sock = transport.dealer(address, identity, watch=transport.DISCONNECTS)
        self._decoder = decoder
        self._log = log

    @classmethod
    def to_worker(cls, address: str, identity: bytes,
                  log: logging.Logger) -> ZmqChannel[wire.Message, wire.ToFrontend]:
        """A frontend's channel to one worker."""
        return ZmqChannel(address, identity, wire.TO_FRONTEND, log)

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def send_nowait(self, msg: T) -> None:
        try:
            transport.send_nowait(self._sock, msg)  # type: ignore[arg-type]
        except zmq.Again:
            raise ChannelFull(self.address) from None

    def __aiter__(self) -> AsyncIterator[U]:
        return transport.dealer_messages(self._sock, self._decoder, self._log)

    def unread(self) -> bool:
        return transport.readable(self._sock)

    def disconnects(self) -> AsyncIterator[str]:
        return transport.disconnects(self._sock)

    def close(self) -> None:
        transport.close(self._sock)


class MemoryChannel(Generic[T, U]):
    """One end of an in-memory pair. What one end sends the other receives, in order."""

    def __init__(self, bound: int, through_wire: wire.Decoder[Any] | None) -> None:
        self.peer: MemoryChannel[U, T] | None = None
        self.bound = bound
        self._wire = through_wire  # the PEER's decoder: messages cross the real encoding
        self._inbox: deque[U] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._drops: asyncio.Queue[str] = asyncio.Queue()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def send_nowait(self, msg: T) -> None:
        peer = self.peer
        assert peer is not None
        if self._closed:
            raise ChannelFull("closed")
        if len(peer._inbox) >= self.bound:
            raise ChannelFull("memory channel full")
        if self._wire is not None:
            msg = self._wire.decode(wire.encode(msg))  # type: ignore[arg-type]
        peer._deliver(msg)

    def _deliver(self, msg: U) -> None:
        self._inbox.append(msg)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def received(self) -> list[U]:
        """Take every message waiting unread (for a test that plays the peer)."""
        out = list(self._inbox)
        self._inbox.clear()
        return out

    def unread(self) -> bool:
        return bool(self._inbox)

    async def __aiter__(self) -> AsyncIterator[U]:
        while not self._closed:
            if self._inbox:
                yield self._inbox.popleft()
                continue
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def disconnects(self) -> AsyncIterator[str]:
        while True:
            yield await self._drops.get()

    def disconnect(self, why: str = "") -> None:
        """Simulate a dropped connection (`why`: a failed handshake's reason): both ends report
        it."""
        self._drops.put_nowait(why)
        if self.peer is not None:
            self.peer._drops.put_nowait(why)

    def close(self) -> None:
        self._closed = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


def memory_pair(bound: int = 100_000, decoders: tuple[wire.Decoder[Any], wire.Decoder[Any]]
                | None = None) -> tuple[MemoryChannel[Any, Any], MemoryChannel[Any, Any]]:
    """Two connected ends (a, b). With `decoders` = (a's, b's), every message crosses the wire
    encoding and is decoded against its receiver's schema."""
    a: MemoryChannel[Any, Any] = MemoryChannel(bound, decoders[1] if decoders else None)
    b: MemoryChannel[Any, Any] = MemoryChannel(bound, decoders[0] if decoders else None)
    a.peer, b.peer = b, a
    return a, b
