"""Channels over a foreign frame format: the KV event pair (tandem.runtime.kv_events) through the
same transport and channel seam as every other protocol end (tandem.runtime.channel).

tandem's own messages are one msgpack frame each (tandem.runtime.wire); a foreign format has its
own frames (the KV events' live stream: `[topic, seq, payload]`). A `FrameCodec` says how a
message becomes frames (`encode`) and frames a message (`decode`, which raises
wire.ProtocolError, e.g. KvEventsError, on bytes it refuses: the receive loop drops that message
and counts it in `bad_messages[codec.name]`, tandem.runtime.refusals). One end's codec encodes
what the other end's decodes.

- `FrameChannel`: a Channel (tandem.runtime.channel) over a connected or publishing socket: a
  SUB or a DEALER (`subscriber`, `dealer`) receives, a PUB (`publisher`) sends.
- `FrameRouter`: a RouterChannel over a bound ROUTER: `(identity, message)` in, the identity's
  frame first out.
- In memory, for socket-free tests: `memory_frame_pair(a, b)` and `memory_frame_router(router,
  peer)` are tandem.runtime.channel's memory ends whose messages cross the codecs (encoded by the
  sender's, decoded by the receiver's), so the bytes are those a socket would carry;
  `MemoryPublisher` is a PUB's end (every subscriber gets each message, except one that is full:
  it misses it, as a PUB socket past its high-water mark drops it for that subscriber alone).

Sockets come from tandem.runtime.transport (`pub`, `sub`, `dealer`, `router`: the cluster's keys,
monitors, high-water marks) and are read by its one receive loop (`frame_messages`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import zmq

from tandem.runtime import transport, wire
from tandem.runtime.channel import ChannelFull, MemoryChannel, MemoryRouter

__all__ = ["FrameChannel", "FrameCodec", "FrameRouter", "MemoryPublisher", "Outlet",
           "memory_frame_pair",
           "memory_frame_router", "receive_only", "send_only"]

S = TypeVar("S")
R = TypeVar("R")
S_contra = TypeVar("S_contra", contravariant=True)


@dataclass(frozen=True, slots=True)
class FrameCodec(Generic[S, R]):
    """`name`: the socket kind its refused frames are counted under."""

    name: str
    encode: Callable[[S], list[bytes]]
    decode: Callable[[list[bytes]], R]


def send_only(name: str) -> Callable[[list[bytes]], NoReturn]:
    """The `decode` of an end that never receives (a publisher)."""
    def decode(frames: list[bytes]) -> NoReturn:
        raise wire.ProtocolError(f"{name}: this end receives nothing")
    return decode


def receive_only(name: str) -> Callable[[Any], NoReturn]:
    """The `encode` of an end that never sends (a subscriber)."""
    def encode(msg: Any) -> NoReturn:
        raise TypeError(f"{name}: this end sends nothing")
    return encode


class Outlet(Protocol[S_contra]):
    """What a sending end offers (a FrameChannel publisher, or a memory end)."""

    @property
    def closed(self) -> bool: ...

    def send_nowait(self, msg: S_contra) -> None: ...

    async def count_refused_handshakes(self, socket: str, log: logging.Logger) -> None: ...

    def close(self) -> None: ...


def _port(sock: zmq.Socket) -> int:
    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


class FrameChannel(Generic[S, R]):
    """A socket to (or, a PUB, for) its peers, with `codec` both ways."""

    def __init__(self, sock: transport.Socket, codec: FrameCodec[S, R],
                 log: logging.Logger) -> None:
        self._sock, self.codec, self._log = sock, codec, log

    @classmethod
    def publisher(cls, bind: str, codec: FrameCodec[S, R], log: logging.Logger,
                  options: transport.Options = ()) -> FrameChannel[S, R]:
        return cls(transport.pub(bind, options), codec, log)

    @classmethod
    def subscriber(cls, connect: str, codec: FrameCodec[S, R], log: logging.Logger,
                   options: transport.Options = ()) -> FrameChannel[S, R]:
        return cls(transport.sub(connect, options), codec, log)

    @classmethod
    def dealer(cls, connect: str, identity: bytes, codec: FrameCodec[S, R],
               log: logging.Logger, options: transport.Options = ()) -> FrameChannel[S, R]:
        return cls(transport.dealer(connect, identity, 0, options), codec, log)

    @property
    def port(self) -> int:
        """The port it bound (a publisher's; port 0 asked the OS for one)."""
        return _port(self._sock)

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def send_nowait(self, msg: S) -> None:
        """Past the high-water mark (a DEALER's), or closed: `ChannelFull`, with ZMQ's reason;
        nothing of the message is queued then. (A PUB never refuses: past a subscriber's
        high-water mark it drops the message for that subscriber.)"""
        try:
            transport.send_frames_nowait(self._sock, self.codec.encode(msg))
        except zmq.ZMQError as e:
            raise ChannelFull(str(e)) from None

    def __aiter__(self) -> AsyncIterator[R]:
        return transport.frame_messages(self._sock, self.codec.decode, self.codec.name, self._log)

    def unread(self) -> bool:
        return transport.readable(self._sock)

    def disconnects(self) -> AsyncIterator[str]:
        return transport.disconnects(self._sock)

    async def count_refused_handshakes(self, socket: str, log: logging.Logger) -> None:
        await transport.count_refused_handshakes(self._sock, socket, log)

    def close(self) -> None:
        transport.close(self._sock)


class FrameRouter(Generic[S, R]):
    """A ROUTER bound at `bind`: each message's identity frame, then `codec`'s frames."""

    def __init__(self, bind: str, codec: FrameCodec[S, R], log: logging.Logger,
                 options: transport.Options = ()) -> None:
        self._sock = transport.router(bind, transport.REFUSALS, options)
        self.codec, self._log = codec, log

    @property
    def port(self) -> int:
        return _port(self._sock)

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def send_nowait(self, ident: bytes, msg: S) -> None:
        """Gone (EHOSTUNREACH), not reading (EAGAIN) or closed: `ChannelFull` (`gone` unless
        EAGAIN)."""
        try:
            transport.send_frames_nowait(self._sock, [ident, *self.codec.encode(msg)])
        except zmq.ZMQError as e:
            raise ChannelFull(str(e), gone=e.errno != zmq.EAGAIN) from None

    def __aiter__(self) -> AsyncIterator[tuple[bytes, R]]:
        decode = self.codec.decode

        def routed(frames: list[bytes]) -> tuple[bytes, R]:
            return frames[0], decode(frames[1:])

        return transport.frame_messages(self._sock, routed, self.codec.name, self._log)

    async def count_refused_handshakes(self, socket: str, log: logging.Logger) -> None:
        await transport.count_refused_handshakes(self._sock, socket, log)

    def close(self, linger_s: float = 0.0) -> None:
        if not self._sock.closed:
            transport.close(self._sock, linger_s)


def _across(sender: FrameCodec[Any, Any], receiver: FrameCodec[Any, Any]
            ) -> Callable[[Any], Any]:
    return lambda msg: receiver.decode(sender.encode(msg))


def memory_frame_pair(a: FrameCodec[Any, Any], b: FrameCodec[Any, Any], bound: int = 100_000
                      ) -> tuple[MemoryChannel[Any, Any], MemoryChannel[Any, Any]]:
    """Two connected ends in memory, `a`'s end with codec `a`, `b`'s with `b`."""
    end_a: MemoryChannel[Any, Any] = MemoryChannel(bound, None, _across(a, b))
    end_b: MemoryChannel[Any, Any] = MemoryChannel(bound, None, _across(b, a))
    end_a.peer, end_b.peer = end_b, end_a
    return end_a, end_b


def memory_frame_router(router: FrameCodec[Any, Any], peer: FrameCodec[Any, Any],
                        bound: int = 100_000) -> MemoryRouter[Any, Any]:
    """A ROUTER's end in memory with codec `router`; `connect(identity)` gives a peer's end,
    with codec `peer`."""
    return MemoryRouter(bound, crosses=(_across(peer, router), _across(router, peer)))


class MemoryPublisher(Generic[S]):
    """A publisher's end in memory, with codec `codec`; `subscribe(codec)` gives a subscriber's
    end (bounded: `bound` messages it has not read)."""

    def __init__(self, codec: FrameCodec[S, Any], bound: int = 100_000) -> None:
        self.codec, self.bound = codec, bound
        self.subscribers: list[MemoryChannel[S, Any]] = []  # this end's side of each pair
        self._closed = False

    def subscribe(self, codec: FrameCodec[Any, Any]) -> MemoryChannel[Any, Any]:
        mine, theirs = memory_frame_pair(self.codec, codec, self.bound)
        self.subscribers.append(mine)
        return theirs

    @property
    def closed(self) -> bool:
        return self._closed

    def send_nowait(self, msg: S) -> None:
        if self._closed:
            raise ChannelFull("closed")
        for s in self.subscribers:
            if s.peer is not None and not s.peer.closed and len(s.peer) < self.bound:
                s.send_nowait(msg)  # (a full subscriber misses it, as a PUB drops it for it)

    async def count_refused_handshakes(self, socket: str, log: logging.Logger) -> None:
        """(In memory there are no handshakes: this waits until cancelled.)"""
        await asyncio.get_running_loop().create_future()

    def close(self) -> None:
        self._closed = True
