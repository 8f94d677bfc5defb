"""ZMQ transport: one context per process, ROUTER on workers, DEALER on frontends, and framing.

A message on the wire is `[identity,] type byte, payload` (wire.encode, and one wire.Decoder per
socket). Sockets never linger on close, have high-water marks, and refuse frames over
wire.MAX_MESSAGE_BYTES. A frame that does not decode is dropped, counted in `bad_messages` (by
socket kind) and logged at most once a second: no bytes a peer sends can end a receive loop.
A message that decodes but that its handler refuses (a value out of range, a request that is not
the sender's, a reply that cannot be routed back) is counted in `protocol_errors` by
(socket kind, what was wrong) through `refused()`, logged the same rate-limited way. Both counters
are process-wide; the worker exports them on its health port's `/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar, cast

import zmq
import zmq.asyncio
import zmq.utils.monitor

from tandem.runtime import auth, wire
from tandem.runtime.config import ZMQ_HWM

M = TypeVar("M")

_ctx: zmq.asyncio.Context | None = None
_keys: auth.ClusterKeys | None = None

# Awaiting a receive on a socket that already holds a message does not yield to the event loop, so
# a receive loop yields on purpose every RECV_BATCH messages: a busy peer cannot starve the rest.
RECV_BATCH = 64
# Frames dropped because they did not decode, by decoder name ("worker", "frontend", ...).
bad_messages: Counter[str] = Counter()
# Messages that decoded but were refused or could not be answered, by (socket kind, what).
protocol_errors: Counter[tuple[str, str]] = Counter()
_last_bad_log = 0.0


def context() -> zmq.asyncio.Context:
    """The process's one ZMQ context."""
    global _ctx
    if _ctx is None or _ctx.closed:
        _ctx = zmq.asyncio.Context()
    return _ctx


def use_keys(keys: auth.ClusterKeys | None) -> None:
    """Authenticate every socket this process makes from now on with the cluster keys
    (tandem.runtime.auth); None = loopback only (binding elsewhere is refused)."""
    global _keys
    _keys = keys


def _configure(sock: zmq.asyncio.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, ZMQ_HWM)
    sock.setsockopt(zmq.RCVHWM, ZMQ_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES + 1024)


def router(bind: str) -> zmq.asyncio.Socket:
    """A worker's socket: many frontends talk to it, each known by its identity."""
    auth.require_for(bind, _keys)
    sock = context().socket(zmq.ROUTER)
    _configure(sock)
    if _keys is not None:
        auth.make_server(sock, _keys)
    # Sending to a frontend that is gone raises EHOSTUNREACH instead of dropping silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(bind)
    return sock


def dealer(connect: str, identity: bytes) -> zmq.asyncio.Socket:
    """A frontend's socket to one worker."""
    sock = context().socket(zmq.DEALER)
    _configure(sock)
    sock.setsockopt(zmq.IDENTITY, identity)
    if _keys is not None:
        auth.make_client(sock, _keys)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(connect)
    return sock


def close(sock: zmq.asyncio.Socket) -> None:
    """Close `sock` at once (linger 0), its monitor off first (see `disconnects`)."""
    if not sock.closed:
        sock.disable_monitor()
        sock.close(linger=0)


async def disconnects(sock: zmq.asyncio.Socket) -> AsyncGenerator[None, None]:
    """One item each time `sock` loses a connection (a ZMQ monitor on it). On the way out the
    monitor is turned off BEFORE its reader is closed: libzmq's I/O thread sends monitor events
    with a blocking send, so a monitor whose reader is gone stops that thread at the next
    disconnect, and with it every socket of the context (no new connection ever connects)."""
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        while True:
            parts = await mon.recv_multipart()
            if zmq.utils.monitor.parse_monitor_message(parts)["event"] == zmq.EVENT_DISCONNECTED:
                yield None
    finally:
        if not sock.closed:
            sock.disable_monitor()
        mon.close(linger=0)


def frames(msg: wire._Tagged, identity: bytes | None = None) -> list[bytes]:
    t, payload = wire.encode(msg)
    return [identity, t, payload] if identity is not None else [t, payload]


def send_nowait(sock: zmq.asyncio.Socket, msg: wire._Tagged, identity: bytes | None = None) -> None:
    """Queue a message without awaiting: ZMQ keeps order; past the high-water mark this raises
    zmq.Again rather than growing memory without bound, and an unroutable identity raises
    EHOSTUNREACH. (pyzmq's asyncio socket tries a NOBLOCK send at once and reports the outcome in
    the returned future, already done: surface it here instead of losing it.)"""
    fut = cast("asyncio.Future[object]",
               sock.send_multipart(frames(msg, identity), flags=zmq.NOBLOCK, copy=True))
    if fut.done():
        exc = fut.exception()
        if exc is not None:
            raise exc


def _dropped(decoder: wire.Decoder[M], err: Exception, log: logging.Logger) -> None:
    global _last_bad_log
    bad_messages[decoder.name] += 1
    now = time.monotonic()
    if now - _last_bad_log >= 1.0:
        _last_bad_log = now
        log.warning("dropped a bad message (%d on %s sockets so far): %s",
                    bad_messages[decoder.name], decoder.name, err)


def refused(socket: str, what: str, log: logging.Logger, detail: object = "") -> None:
    """Count one refused message (or unanswerable peer) in `protocol_errors`, and log it at most
    once a second over all kinds: bad input must not flood the log."""
    global _last_bad_log
    protocol_errors[(socket, what)] += 1
    now = time.monotonic()
    if now - _last_bad_log >= 1.0:
        _last_bad_log = now
        log.warning("%s socket: %s (%d so far)%s", socket, what, protocol_errors[(socket, what)],
                    f": {detail}" if detail else "")


async def _frames_in(sock: zmq.asyncio.Socket, decoder: wire.Decoder[M], log: logging.Logger,
                    frames: int) -> AsyncIterator[tuple[list[bytes], M]]:
    """Every message with `frames` frames (the last two: type byte, payload), fairly: bad ones are
    counted, logged (rate-limited) and dropped, and the loop yields every RECV_BATCH messages."""
    n = 0
    while True:
        n += 1
        if n % RECV_BATCH == 0:
            await asyncio.sleep(0)
        parts = await sock.recv_multipart()
        try:
            if len(parts) != frames:
                raise wire.ProtocolError(
                    f"{decoder.name}: expected {frames} frames, got {len(parts)}")
            msg = decoder.decode(parts[-2], parts[-1])
        except wire.ProtocolError as e:
            _dropped(decoder, e, log)
            continue
        yield parts, msg


async def router_messages(sock: zmq.asyncio.Socket, decoder: wire.Decoder[M],
                          log: logging.Logger) -> AsyncIterator[tuple[bytes, M]]:
    """Every (identity, message) arriving on a ROUTER socket (see _frames_in)."""
    async for parts, msg in _frames_in(sock, decoder, log, 3):
        yield parts[0], msg


async def dealer_messages(sock: zmq.asyncio.Socket, decoder: wire.Decoder[M],
                          log: logging.Logger) -> AsyncIterator[M]:
    """Every message arriving on a DEALER socket (see _frames_in)."""
    async for _, msg in _frames_in(sock, decoder, log, 2):
        yield msg
