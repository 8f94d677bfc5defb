"""Channels: the seam between protocol code and sockets.

A `Channel[S, R]` is a message pipe to one peer (a DEALER's end). It sends messages of type S without awaiting (`send_nowait`; past its bound it
raises `ChannelFull` rather than grow), yields the messages it receives (async iteration, each
already decoded against the receiver's schema), says whether received messages are waiting unread
(`unread()`: the reader is behind, the peer is not silent), and reports each time the connection to
the peer drops (`disconnects()`: "", or why its security handshake failed).

A `RouterChannel[S, R]` is the other end, that many peers connect to (a ROUTER's): it yields
`(identity, message)` and sends `send_nowait(identity, msg)`; a peer that is gone or not reading
raises `ChannelFull` there.

- `ZmqChannel`: a DEALER socket to one peer; `ZmqRouterChannel`: a bound ROUTER socket
  (tandem.runtime.transport: high-water marks, fair receive, bad frames dropped and counted).
- `MemoryChannel`: one end of an in-memory pair (`memory_pair()`), and `MemoryRouter`, whose
  `connect(identity)` gives a peer's MemoryChannel: for tests, optionally through the wire
  encoding, with a bound, and a `disconnect()` to simulate a dropped connection (or a failed
  handshake).

`serve(messages, handle, socket, log)` is the one receive loop: each message goes to its handler;
a handler that fails on some input drops only that message (counted in
`transport.protocol_errors` as refused). All six protocol ends are written against channels: the
frontend's worker link (tandem.router.link), the worker's server (tandem.worker.server), the
prefill and decode sides of the KV bootstrap (tandem.kv.bootstrap), the worker's KV event
publisher (tandem.worker.kv_events) and the router's KV event feed (tandem.router.kv_feed), the
last two over a foreign frame format (tandem.runtime.frames); so each is tested without sockets
(ARCHITECTURE.md, "Contracts").
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any, Generic, Protocol, TypeVar

import zmq

from tandem.runtime import transport, wire

S = TypeVar("S", contravariant=True)
R = TypeVar("R", covariant=True)
T = TypeVar("T")
U = TypeVar("U")


class ChannelFull(Exception):
    """The peer is not reading (the channel's bound is reached), or it is gone (`gone`)."""

    def __init__(self, why: str = "", gone: bool = False) -> None:
        super().__init__(why)
        self.gone = gone


class Channel(Protocol[S, R]):
    @property
    def closed(self) -> bool: ...

    def send_nowait(self, msg: S) -> None: ...

    def __aiter__(self) -> AsyncIterator[R]: ...

    def unread(self) -> bool: ...

    def disconnects(self) -> AsyncIterator[str]: ...

    def close(self) -> None: ...


class RouterChannel(Protocol[S, R]):
    @property
    def closed(self) -> bool: ...

    def send_nowait(self, ident: bytes, msg: S) -> None: ...

    def __aiter__(self) -> AsyncIterator[tuple[bytes, R]]: ...

    def close(self, linger_s: float = 0.0) -> None: ...

    async def count_refused_handshakes(self, socket: str, log: logging.Logger) -> None: ...


async def serve(messages: AsyncIterable[T], handle: Callable[[T], None], socket: str,
                log: logging.Logger, per_pass: int = 0) -> None:
    """Hand each message to `handle` until the channel closes. Nothing a peer sends ends the
    loop: a handler that fails on some input drops that one message, counted and logged as
    refused (socket, "handler failed on <type>"). `per_pass`: yield to the event loop after this
    many messages (a handler whose work is large: the rest of the loop runs in between)."""
    n = 0
    async for msg in messages:
        try:
            handle(msg)
        except Exception as e:
            m: Any = msg[1] if isinstance(msg, tuple) else msg
            transport.refused(socket, f"handler failed on {type(m).__name__}", log, repr(e))
        n += 1
        if n == per_pass:
            n = 0
            await asyncio.sleep(0)


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


class ZmqRouterChannel(Generic[T, U]):
    """A ROUTER socket bound at `address`, receiving with `decoder`."""

    def __init__(self, address: str, decoder: wire.Decoder[U], log: logging.Logger) -> None:
        self.address = address
        self._sock = transport.router(address, watch=transport.REFUSALS)
        self._decoder = decoder
        self._log = log

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def send_nowait(self, ident: bytes, msg: T) -> None:
        """Gone (EHOSTUNREACH), not reading (EAGAIN past the high-water mark) or closed: all
        `ChannelFull`, with ZMQ's reason."""
        try:
            transport.send_nowait(self._sock, msg, ident)  # type: ignore[arg-type]
        except zmq.ZMQError as e:
            raise ChannelFull(str(e)) from None

    def __aiter__(self) -> AsyncIterator[tuple[bytes, U]]:
        return transport.router_messages(self._sock, self._decoder, self._log)

    async def count_refused_handshakes(self, socket: str, log: logging.Logger) -> None:
        """Until cancelled: each peer whose security handshake failed (no keys, or another
        cluster's: it never gets to send a message) counted in `transport.protocol_errors`
        (socket, why) and logged, rate-limited."""
        await transport.count_refused_handshakes(self._sock, socket, log)

    def close(self, linger_s: float = 0.0) -> None:
        """Close (its monitor off first); what is queued gets `linger_s` seconds to leave."""
        if not self._sock.closed:
            transport.close(self._sock, linger_s)


class MemoryChannel(Generic[T, U]):
    """One end of an in-memory pair. What one end sends the other receives, in order."""

    def __init__(self, bound: int, through_wire: wire.Decoder[Any] | None,
                 cross: Callable[[Any], Any] | None = None) -> None:
        """`through_wire`: the PEER's decoder, messages cross the real encoding; or `cross`: what
        a message becomes on its way (a frame codec's encode, then the peer's decode)."""
        self.peer: MemoryChannel[U, T] | None = None
        self.bound = bound
        self._cross = cross if through_wire is None else _through(through_wire)
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
        if len(peer) >= self.bound:
            raise ChannelFull("memory channel full")
        if self._cross is not None:
            msg = self._cross(msg)
        peer.deliver(msg)

    def __len__(self) -> int:
        """Messages received, not yet read."""
        return len(self._inbox)

    def deliver(self, msg: U) -> None:
        """Receive `msg` (what the peer's send does)."""
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
            self.peer.dropped(why)

    def dropped(self, why: str = "") -> None:
        """The connection dropped (what the peer's `disconnect` does here)."""
        self._drops.put_nowait(why)

    async def count_refused_handshakes(self, socket: str, log: logging.Logger) -> None:
        """(In memory there are no handshakes: this waits until cancelled.)"""
        await asyncio.get_running_loop().create_future()

    def close(self) -> None:
        self._closed = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class MemoryRouter(Generic[T, U]):
    """A ROUTER's end in memory: `connect(identity)` gives a peer's end (a MemoryChannel whose
    sends arrive here as (identity, message)). With `decoders` = (the router's, the peers'),
    every message crosses the wire encoding."""

    def __init__(self, bound: int = 100_000,
                 decoders: tuple[wire.Decoder[Any], wire.Decoder[Any]] | None = None,
                 crosses: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
                 ) -> None:
        """`crosses` (instead of `decoders`): what a message becomes on its way to the router,
        and on its way to a peer (tandem.runtime.frames)."""
        self.bound = bound
        self._crosses = crosses if decoders is None else (_through(decoders[0]),
                                                          _through(decoders[1]))
        self._inbox: MemoryChannel[Any, tuple[bytes, U]] = MemoryChannel(bound, None)
        self.peers: dict[bytes, _Peer[Any, Any]] = {}

    @property
    def closed(self) -> bool:
        return self._inbox.closed

    def connect(self, ident: bytes) -> MemoryChannel[U, T]:
        """A new peer known as `ident` (a reconnection replaces the old one)."""
        c = self._crosses
        peer: _Peer[U, T] = _Peer(self, ident, self.bound, c[0] if c else None,
                                  c[1] if c else None)
        self.peers[ident] = peer
        return peer

    def send_nowait(self, ident: bytes, msg: T) -> None:
        peer = self.peers.get(ident)
        if peer is None or peer.closed or self.closed:
            raise ChannelFull(f"peer {ident!r} is gone", gone=True)
        peer.receive(msg)

    def arrive(self, ident: bytes, msg: Any) -> None:
        """A message from peer `ident` (what its send does)."""
        if len(self._inbox) >= self.bound:
            raise ChannelFull("memory channel full")
        self._inbox.deliver((ident, msg))

    def __aiter__(self) -> AsyncIterator[tuple[bytes, U]]:
        return self._inbox.__aiter__()

    def close(self, linger_s: float = 0.0) -> None:
        self._inbox.close()

    async def count_refused_handshakes(self, socket: str, log: logging.Logger) -> None:
        """(In memory there are no handshakes: this waits until cancelled.)"""
        await asyncio.get_running_loop().create_future()


class _Peer(MemoryChannel[T, U]):
    """A peer's end of a MemoryRouter: what it sends arrives there with its identity."""

    def __init__(self, router: MemoryRouter[Any, Any], ident: bytes, bound: int,
                 to_router: Callable[[Any], Any] | None,
                 to_peer: Callable[[Any], Any] | None) -> None:
        super().__init__(bound, None, to_router)
        self._router, self._ident, self._to_peer = router, ident, to_peer

    def send_nowait(self, msg: T) -> None:
        if self._closed:
            raise ChannelFull("closed")
        if self._cross is not None:
            msg = self._cross(msg)
        self._router.arrive(self._ident, msg)

    def receive(self, msg: Any) -> None:
        """What the router sends this peer."""
        if len(self) >= self.bound:
            raise ChannelFull("memory channel full")
        if self._to_peer is not None:
            msg = self._to_peer(msg)
        self.deliver(msg)


def memory_pair(bound: int = 100_000, decoders: tuple[wire.Decoder[Any], wire.Decoder[Any]]
                | None = None) -> tuple[MemoryChannel[Any, Any], MemoryChannel[Any, Any]]:
    """Two connected ends (a, b). With `decoders` = (a's, b's), every message crosses the wire
    encoding and is decoded against its receiver's schema."""
    a: MemoryChannel[Any, Any] = MemoryChannel(bound, decoders[1] if decoders else None)
    b: MemoryChannel[Any, Any] = MemoryChannel(bound, decoders[0] if decoders else None)
    a.peer, b.peer = b, a
    return a, b


def _through(decoder: wire.Decoder[Any]) -> Callable[[Any], Any]:
    """A message's way across the wire encoding, decoded against its receiver's schema."""
    return lambda msg: decoder.decode(wire.encode(msg))
