"""ZMQ transport: one context per process, ROUTER on workers, DEALER on frontends, and framing.

A message on the wire is `[identity,] payload` (wire.encode, and one wire.Decoder per
socket). Sockets never linger on close, have high-water marks, and refuse frames over
wire.MAX_MESSAGE_BYTES. A frame that does not decode is dropped, counted in `bad_messages` (by
socket kind) and logged at most once a second: no bytes a peer sends can end a receive loop.
A message that decodes but that its handler refuses (a value out of range, a request that is not
the sender's, a reply that cannot be routed back) is counted in `protocol_errors` by
(socket kind, what was wrong) through `refused()`, logged the same rate-limited way
(tandem.runtime.refusals owns both counters; they are named here too, where the sockets are).

Sockets are driven here, not by pyzmq's asyncio layer (`Socket`): a send is one non-blocking call
per frame, and a receive loop reads every message already queued with non-blocking calls and
waits on the socket's file descriptor only when none is. pyzmq's asyncio socket makes a future,
flag enums and event checks for every message: a Credit sent and received cost 36.9 us of CPU on
this machine through it, 7.9 through this module (perf/transfer/bench_zmq_io.py, perf/results/zmq_io.md).
ZMQ's descriptor is edge-triggered: it signals once when the socket's state may have changed, and
any call on the socket (a send, a ZMQ_EVENTS query) may take that signal. So a receive loop checks
ZMQ_EVENTS before it waits, the descriptor's callback always queries it (which also clears the
signal), and a send, or a query, made while the loop waits re-checks readiness (once per loop pass
for sends). Monitor sockets (`disconnects` on a frontend's or a decode worker's connection,
`count_refused_handshakes` on a bound socket) are rare and stay on pyzmq's asyncio layer, over the
same libzmq context (tandem.runtime.monitors). A failed security handshake (CURVE: a peer without the cluster's keys, or with
another cluster's) is counted in `protocol_errors` on the bound side, and said, as the reason of
the disconnect, on the connecting side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TypeVar, cast

import zmq
import zmq.backend

from tandem.runtime import auth, wire
from tandem.runtime.config import ZMQ_HWM
from tandem.runtime.monitors import (DISCONNECTS, REFUSALS, Monitor, count_refused_handshakes,
                                     disconnects, take_watcher)
from tandem.runtime.refusals import bad_messages, dropped, protocol_errors, refused

__all__ = ["DISCONNECTS", "REFUSALS", "Monitor", "Options", "Socket", "bad_messages", "close", "context", "count_refused_handshakes",
           "dealer", "dealer_messages", "disconnects", "forget_context", "frame_messages", "keys",
           "protocol_errors", "pub", "readable", "refused", "router", "router_messages",
           "send_frames_nowait", "send_nowait", "sub", "url_host", "use_keys"]

M = TypeVar("M")

# Awaiting a receive on a socket that already holds a message does not yield to the event loop, so
# a receive loop yields on purpose every RECV_BATCH messages: a busy peer cannot starve the rest.
RECV_BATCH = 64
MAX_FRAMES = 8  # frames of one message kept; a peer's longer message is read to its end, dropped

# libzmq's calls without pyzmq's Python layer over them (plain ints, no flag enums).
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_raw_get = zmq.backend.Socket.get
_NOBLOCK, _MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS, _RCVMORE, _POLLIN = int(zmq.EVENTS), int(zmq.RCVMORE), int(zmq.POLLIN)


class Socket(zmq.Socket):
    """A ZMQ socket this module drives: at most one receive loop (`frame_messages`) reads it."""

    loop: asyncio.AbstractEventLoop | None = None  # the receive loop's, while it reads
    fd: int = -1  # the descriptor that loop watches
    waiter: asyncio.Future[None] | None = None  # set while the loop waits for a message
    recheck_due: bool = False  # a readiness re-check is scheduled (a send took the signal)
    watcher: Monitor | None = None  # its monitor, on since before it connected or bound, unread

    def close(self, linger: int | None = None) -> None:
        """Close; a receive loop waiting on it wakes and ends (its next read fails)."""
        _unwatch(self)
        super().close(linger)


_ctx: zmq.Context | None = None
_keys: auth.ClusterKeys | None = None


def context() -> zmq.Context:
    """The process's one ZMQ context."""
    global _ctx
    ctx = _ctx
    if ctx is None or ctx.closed:
        ctx = _ctx = zmq.Context()
    return ctx


def forget_context() -> zmq.Context | None:
    """Forget the process's context and return it (None if there was none); the next socket
    makes a new one. Its sockets, and destroying it, are the caller's: after a fork, or between
    the tests of one process."""
    global _ctx
    ctx, _ctx = _ctx, None
    return ctx


def use_keys(keys: auth.ClusterKeys | None) -> None:
    """Authenticate every socket this process makes from now on with the cluster keys
    (tandem.runtime.auth); None = loopback only (binding elsewhere is refused)."""
    global _keys
    _keys = keys


def keys() -> auth.ClusterKeys | None:
    """The cluster's key pair this process uses (None: no CURVE)."""
    return _keys


def url_host(host: str) -> str:
    """`host` as it goes in a URL (tcp://HOST:PORT): an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


Options = Sequence[tuple[int, int | bytes]]


def _socket(kind: int, options: Options = ()) -> Socket:
    """A socket of `kind` with the defaults, then `options` (set before it binds or connects:
    ZMQ gives a connection the options its socket had then)."""
    sock = context().socket(kind, socket_class=Socket)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, ZMQ_HWM)
        sock.setsockopt(zmq.RCVHWM, ZMQ_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES + 1024)
        for option, value in options:
            sock.setsockopt(option, value)
    except BaseException:
        sock.close()
        raise
    return sock


def _bound(kind: int, bind: str, watch: int, options: Options) -> Socket:
    """A socket every peer connects to: its monitor (`watch` events) on from the start, a CURVE
    server with the cluster's keys (binding beyond loopback without them: AuthError)."""
    auth.require_for(bind, _keys)
    sock = _socket(kind, options)
    try:
        if watch:
            sock.watcher = Monitor(sock, watch)
        if _keys is not None:
            auth.make_server(sock, _keys)
        if bind.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(bind)
    except BaseException:
        close(sock)
        raise
    return sock


def _connected(kind: int, connect: str, watch: int, options: Options) -> Socket:
    """A socket to one peer: its monitor on from the start, a CURVE client with the keys."""
    sock = _socket(kind, options)
    if watch:
        sock.watcher = Monitor(sock, watch)
    if _keys is not None:
        auth.make_client(sock, _keys)
    if connect.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(connect)
    return sock


def router(bind: str, watch: int = 0, options: Options = ()) -> Socket:
    """A worker's socket: many frontends talk to it, each known by its identity. `watch`: the
    monitor events to catch from the start (REFUSALS), for a reader to come."""
    # Sending to a frontend that is gone raises EHOSTUNREACH instead of dropping silently.
    return _bound(zmq.ROUTER, bind, watch, ((zmq.ROUTER_MANDATORY, 1), *options))


def dealer(connect: str, identity: bytes, watch: int = 0, options: Options = ()) -> Socket:
    """A frontend's socket to one worker. `watch`: the monitor events to catch from the start
    (DISCONNECTS), for a reader to come."""
    return _connected(zmq.DEALER, connect, watch, ((zmq.IDENTITY, identity), *options))


def pub(bind: str, options: Options = ()) -> Socket:
    """A publisher every subscriber connects to (refused handshakes watched: REFUSALS)."""
    return _bound(zmq.PUB, bind, REFUSALS, options)


def sub(connect: str, options: Options = ()) -> Socket:
    """A subscriber to every message of one publisher."""
    return _connected(zmq.SUB, connect, 0, ((zmq.SUBSCRIBE, b""), *options))


def close(sock: Socket, linger_s: float = 0.0) -> None:
    """Close `sock`, its monitor off first (see `Monitor`); what it has queued gets `linger_s`
    seconds to leave (by default none)."""
    unread = take_watcher(sock)
    if unread is not None:  # (nobody else will close its reader's end)
        unread.close()
    if not sock.closed:
        sock.disable_monitor()
        sock.close(linger=int(linger_s * 1000))


def send_nowait(sock: Socket, msg: wire.Message, identity: bytes | None = None) -> None:
    """Queue a message without waiting: ZMQ keeps order; past the high-water mark this raises
    zmq.Again rather than growing memory without bound, an unroutable identity raises
    EHOSTUNREACH, a closed socket ENOTSOCK. Nothing is queued unless all of it is (ZMQ takes a
    message's frames as one: a refusal comes at the first)."""
    payload = wire.encode(msg)
    if identity is not None:
        _raw_send(sock, identity, _MORE)
    _raw_send(sock, payload, _NOBLOCK)
    if sock.waiter is not None and not sock.recheck_due:  # the send may have taken the signal
        _recheck_soon(sock)


def send_frames_nowait(sock: Socket, frames: Sequence[bytes]) -> None:
    """`send_nowait` for a message already in frames (a foreign format's: its codec made them)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _raw_send(sock, frame, _NOBLOCK if i == last else _MORE)
    if sock.waiter is not None and not sock.recheck_due:
        _recheck_soon(sock)


def _recheck_soon(sock: Socket) -> None:
    sock.recheck_due = True
    assert sock.loop is not None
    sock.loop.call_soon(_recheck, sock)


def readable(sock: Socket) -> bool:
    """Whether a message waits unread on `sock` (a waiting receive loop is woken if so)."""
    if sock.closed:
        return False
    ready = bool(_events(sock) & _POLLIN)
    if ready:
        _wake(sock)
    return ready


def _events(sock: Socket) -> int:
    """ZMQ_EVENTS (this takes the descriptor's signal too)."""
    return cast(int, _raw_get(sock, _EVENTS))


def _wake(sock: Socket) -> None:
    w = sock.waiter
    if w is not None and not w.done():
        w.set_result(None)


def _recheck(sock: Socket) -> None:
    sock.recheck_due = False
    if sock.waiter is not None:
        readable(sock)


def _on_fd(sock: Socket) -> None:
    """The descriptor signalled: query the events (which clears the signal), wake the loop."""
    if not sock.closed and _events(sock) & _POLLIN:
        _wake(sock)


def _watch(sock: Socket) -> None:
    if sock.loop is not None:
        raise RuntimeError("a socket has one receive loop")
    loop = asyncio.get_running_loop()
    fd = int(sock.getsockopt(zmq.FD))
    loop.add_reader(fd, _on_fd, sock)
    sock.loop, sock.fd = loop, fd


def _unwatch(sock: Socket) -> None:
    loop, sock.loop = sock.loop, None
    if loop is not None:
        with contextlib.suppress(Exception):  # (a loop already closed)
            loop.remove_reader(sock.fd)
    _wake(sock)


def _recv(sock: Socket) -> list[bytes]:
    """The next whole message, without waiting (zmq.Again if none), at most MAX_FRAMES frames."""
    parts: list[bytes] = [_raw_recv(sock, _NOBLOCK)]
    while _raw_get(sock, _RCVMORE):
        frame = _raw_recv(sock, _NOBLOCK)  # (the rest of a message is there: it came whole)
        if len(parts) < MAX_FRAMES:
            parts.append(frame)
    return parts


async def frame_messages(sock: Socket, decode: Callable[[list[bytes]], M], name: str,
                         log: logging.Logger) -> AsyncGenerator[M, None]:
    """Every message arriving on `sock`, as `decode` makes it of the message's frames, fairly:
    one `decode` refuses (wire.ProtocolError) is counted in `bad_messages[name]`, logged
    (rate-limited) and dropped, and the loop yields every RECV_BATCH messages. Ends once the
    socket is closed."""
    _watch(sock)
    loop = asyncio.get_running_loop()
    try:
        n = 0
        while True:
            n += 1
            if n % RECV_BATCH == 0:
                await asyncio.sleep(0)
            try:
                parts = _recv(sock)
            except zmq.Again:
                if sock.closed:
                    return
                if _events(sock) & _POLLIN:  # (a message came since)
                    continue
                sock.waiter = loop.create_future()
                try:
                    await sock.waiter
                finally:
                    sock.waiter = None
                continue
            except zmq.ZMQError:
                if sock.closed:
                    return
                raise
            try:
                msg = decode(parts)
            except wire.ProtocolError as e:
                dropped(name, e, log)
                continue
            yield msg
    finally:
        _unwatch(sock)


def _frames(decoder: wire.Decoder[M], parts: list[bytes], frames: int) -> M:
    if len(parts) != frames:
        raise wire.ProtocolError(f"{decoder.name}: expected {frames} frames, got {len(parts)}")
    return decoder.decode(parts[-1])


async def router_messages(sock: Socket, decoder: wire.Decoder[M],
                          log: logging.Logger) -> AsyncIterator[tuple[bytes, M]]:
    """Every (identity, message) arriving on a ROUTER socket (see frame_messages)."""
    def decode(parts: list[bytes]) -> tuple[bytes, M]:
        return parts[0], _frames(decoder, parts, 2)

    async with contextlib.aclosing(frame_messages(sock, decode, decoder.name, log)) as messages:
        async for msg in messages:  # (closed with this one: the socket is free again)
            yield msg


async def dealer_messages(sock: Socket, decoder: wire.Decoder[M],
                          log: logging.Logger) -> AsyncIterator[M]:
    """Every message arriving on a DEALER socket (see frame_messages)."""
    async with contextlib.aclosing(frame_messages(
            sock, lambda parts: _frames(decoder, parts, 1), decoder.name, log)) as messages:
        async for msg in messages:
            yield msg
