"""ZMQ transport: one context per process, ROUTER on workers, DEALER on frontends, and framing.

A message on the wire is `[identity,] type byte, payload` (protocol.encode/decode). Sockets never
linger on close, have high-water marks, and refuse frames over protocol.MAX_MESSAGE_BYTES.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import zmq
import zmq.asyncio

from tandem.runtime import protocol
from tandem.runtime.config import ZMQ_HWM

T = TypeVar("T")

_ctx: zmq.asyncio.Context | None = None

# Awaiting a receive on a socket that already holds a message does not yield to the event loop, so
# a receive loop yields on purpose every RECV_BATCH messages: a busy peer cannot starve the rest.
RECV_BATCH = 64


def context() -> zmq.asyncio.Context:
    """The process's one ZMQ context."""
    global _ctx
    if _ctx is None or _ctx.closed:
        _ctx = zmq.asyncio.Context()
    return _ctx


def _configure(sock: zmq.asyncio.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, ZMQ_HWM)
    sock.setsockopt(zmq.RCVHWM, ZMQ_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES + 1024)


def router(bind: str) -> zmq.asyncio.Socket:
    """A worker's socket: many frontends talk to it, each known by its identity."""
    sock = context().socket(zmq.ROUTER)
    _configure(sock)
    # Sending to a frontend that is gone raises EHOSTUNREACH instead of dropping silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(bind)
    return sock


def dealer(connect: str, identity: bytes) -> zmq.asyncio.Socket:
    """A frontend's socket to one worker."""
    sock = context().socket(zmq.DEALER)
    _configure(sock)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(connect)
    return sock


def frames(msg: protocol._Msg, identity: bytes | None = None) -> list[bytes]:
    t, payload = protocol.encode(msg)
    return [identity, t, payload] if identity is not None else [t, payload]


def send_nowait(sock: zmq.asyncio.Socket, msg: protocol._Msg, identity: bytes | None = None) -> None:
    """Queue a message without awaiting: ZMQ keeps order; past the high-water mark this raises
    zmq.Again rather than growing memory without bound, and an unroutable identity raises
    EHOSTUNREACH. (pyzmq's asyncio socket tries a NOBLOCK send at once and reports the outcome in
    the returned future, already done: surface it here instead of losing it.)"""
    fut = sock.send_multipart(frames(msg, identity), flags=zmq.NOBLOCK, copy=True)
    if fut.done():
        exc = fut.exception()
        if exc is not None:
            raise exc


async def recv_router(sock: zmq.asyncio.Socket) -> tuple[bytes, protocol._Msg]:
    """Receive one message on a ROUTER socket. Raises protocol.ProtocolError on bad frames."""
    parts = await sock.recv_multipart()
    if len(parts) != 3:
        raise protocol.ProtocolError(f"expected 3 frames, got {len(parts)}")
    return parts[0], protocol.decode(parts[1], parts[2])


async def recv_dealer(sock: zmq.asyncio.Socket) -> protocol._Msg:
    parts = await sock.recv_multipart()
    if len(parts) != 2:
        raise protocol.ProtocolError(f"expected 2 frames, got {len(parts)}")
    return protocol.decode(parts[0], parts[1])


async def _fair(recv: Callable[[zmq.asyncio.Socket], Awaitable[T]], sock: zmq.asyncio.Socket,
                log: logging.Logger) -> AsyncIterator[T]:
    n = 0
    while True:
        n += 1
        if n % RECV_BATCH == 0:
            await asyncio.sleep(0)
        try:
            yield await recv(sock)
        except protocol.ProtocolError as e:
            log.warning("dropped a bad message: %s", e)


def router_messages(sock: zmq.asyncio.Socket, log: logging.Logger
                    ) -> AsyncIterator[tuple[bytes, protocol._Msg]]:
    """Every (identity, message) arriving on a ROUTER socket, fairly: bad frames are logged and
    dropped, and the loop yields every RECV_BATCH messages."""
    return _fair(recv_router, sock, log)


def dealer_messages(sock: zmq.asyncio.Socket, log: logging.Logger) -> AsyncIterator[protocol._Msg]:
    """Every message arriving on a DEALER socket, fairly (as router_messages)."""
    return _fair(recv_dealer, sock, log)
