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
this machine through it, 7.9 through this module (perf/bench_zmq_io.py, perf/results/zmq_io.md).
ZMQ's descriptor is edge-triggered: it signals once when the socket's state may have changed, and
any call on the socket (a send, a ZMQ_EVENTS query) may take that signal. So a receive loop checks
ZMQ_EVENTS before it waits, the descriptor's callback always queries it (which also clears the
signal), and a send, or a query, made while the loop waits re-checks readiness (once per loop pass
for sends). Monitor sockets (`disconnects` on a frontend's or a decode worker's connection,
`count_refused_handshakes` on a bound socket) are rare and stay on pyzmq's asyncio layer, over the
same libzmq context. A failed security handshake (CURVE: a peer without the cluster's keys, or with
another cluster's) is counted in `protocol_errors` on the bound side, and said, as the reason of
the disconnect, on the connecting side.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar, cast

import zmq
import zmq.asyncio
import zmq.backend
import zmq.utils.monitor

from tandem.runtime import auth, wire
from tandem.runtime.config import ZMQ_HWM
from tandem.runtime.refusals import bad_messages, dropped, protocol_errors, refused

__all__ = ["Socket", "bad_messages", "close", "context", "count_refused_handshakes", "dealer",
           "dealer_messages", "disconnects", "forget_context", "keys", "protocol_errors",
           "readable", "refused", "router", "router_messages", "send_nowait", "use_keys"]

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
    """A ZMQ socket this module drives: at most one receive loop (`_frames_in`) reads it."""

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
_actx: zmq.asyncio.Context | None = None  # the same libzmq context, for monitor sockets
_keys: auth.ClusterKeys | None = None
_monitors = itertools.count()


def context() -> zmq.Context:
    """The process's one ZMQ context."""
    global _ctx, _actx
    ctx = _ctx
    if ctx is None or ctx.closed:
        ctx = _ctx = zmq.Context()
        _actx = zmq.asyncio.Context.shadow(ctx.underlying)
    return ctx


def forget_context() -> zmq.Context | None:
    """Forget the process's context and return it (None if there was none); the next socket
    makes a new one. Its sockets, and destroying it, are the caller's: after a fork, or between
    the tests of one process."""
    global _ctx, _actx
    ctx, _ctx, _actx = _ctx, None, None
    return ctx


def use_keys(keys: auth.ClusterKeys | None) -> None:
    """Authenticate every socket this process makes from now on with the cluster keys
    (tandem.runtime.auth); None = loopback only (binding elsewhere is refused)."""
    global _keys
    _keys = keys


def keys() -> auth.ClusterKeys | None:
    """The cluster's key pair this process uses (None: no CURVE)."""
    return _keys


def _socket(kind: int) -> Socket:
    sock = context().socket(kind, socket_class=Socket)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, ZMQ_HWM)
    sock.setsockopt(zmq.RCVHWM, ZMQ_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES + 1024)
    return sock


REFUSALS = auth.HANDSHAKE_FAILED  # what `count_refused_handshakes` reads
DISCONNECTS = zmq.EVENT_DISCONNECTED | auth.HANDSHAKE_FAILED  # what `disconnects` reads


def router(bind: str, watch: int = 0) -> Socket:
    """A worker's socket: many frontends talk to it, each known by its identity. `watch`: the
    monitor events to catch from the start (REFUSALS), for a reader to come."""
    auth.require_for(bind, _keys)
    sock = _socket(zmq.ROUTER)
    if watch:
        sock.watcher = Monitor(sock, watch)
    if _keys is not None:
        auth.make_server(sock, _keys)
    # Sending to a frontend that is gone raises EHOSTUNREACH instead of dropping silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(bind)
    return sock


def dealer(connect: str, identity: bytes, watch: int = 0) -> Socket:
    """A frontend's socket to one worker. `watch`: the monitor events to catch from the start
    (DISCONNECTS), for a reader to come."""
    sock = _socket(zmq.DEALER)
    if watch:
        sock.watcher = Monitor(sock, watch)
    sock.setsockopt(zmq.IDENTITY, identity)
    if _keys is not None:
        auth.make_client(sock, _keys)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(connect)
    return sock


def _take_watcher(sock: zmq.Socket) -> Monitor | None:
    """The monitor `sock` was made with and nobody reads yet (it is the taker's to close now)."""
    if not isinstance(sock, Socket):
        return None
    mon, sock.watcher = sock.watcher, None
    return mon


def close(sock: Socket, linger_s: float = 0.0) -> None:
    """Close `sock`, its monitor off first (see `Monitor`); what it has queued gets `linger_s`
    seconds to leave (by default none)."""
    unread = _take_watcher(sock)
    if unread is not None:  # (nobody else will close its reader's end)
        unread.close()
    if not sock.closed:
        sock.disable_monitor()
        sock.close(linger=int(linger_s * 1000))


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
        assert _actx is not None  # (made with the context that made `sock`)
        self.sock, self.events = sock, events
        self.pair = _actx.socket(zmq.PAIR)
        self.pair.connect(address)

    def close(self) -> None:
        """Off (on a socket still open), then its reader's end closed."""
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.pair.close(linger=0)


async def _monitor(sock: Socket, events: int) -> AsyncGenerator[tuple[int, int], None]:
    """Each (event, value) of `events` on `sock`: from its own monitor when it was made with one
    (`watch=`), else from one turned on now."""
    mon = _take_watcher(sock) or Monitor(sock, events)
    try:
        while True:
            event = zmq.utils.monitor.parse_monitor_message(await mon.pair.recv_multipart())
            if event["event"] & events:
                yield int(event["event"]), int(event["value"])
    finally:
        mon.close()


async def disconnects(sock: Socket) -> AsyncGenerator[str, None]:
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


async def count_refused_handshakes(sock: Socket, socket: str, log: logging.Logger) -> None:
    """Until cancelled: each peer whose security handshake with bound `sock` failed (no keys, or
    another cluster's) is counted in `protocol_errors` (socket, why) and logged, rate-limited."""
    async with contextlib.aclosing(_monitor(sock, REFUSALS)) as events:
        async for event, value in events:
            refused(socket, auth.handshake_failure(event, value), log)


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


async def _frames_in(sock: Socket, decoder: wire.Decoder[M], log: logging.Logger,
                    frames: int) -> AsyncGenerator[tuple[list[bytes], M], None]:
    """Every message with `frames` frames (the last: the payload), fairly: bad ones are
    counted, logged (rate-limited) and dropped, and the loop yields every RECV_BATCH messages.
    Ends once the socket is closed."""
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
                if len(parts) != frames:
                    raise wire.ProtocolError(
                        f"{decoder.name}: expected {frames} frames, got {len(parts)}")
                msg = decoder.decode(parts[-1])
            except wire.ProtocolError as e:
                dropped(decoder.name, e, log)
                continue
            yield parts, msg
    finally:
        _unwatch(sock)


async def router_messages(sock: Socket, decoder: wire.Decoder[M],
                          log: logging.Logger) -> AsyncIterator[tuple[bytes, M]]:
    """Every (identity, message) arriving on a ROUTER socket (see _frames_in)."""
    async with contextlib.aclosing(_frames_in(sock, decoder, log, 2)) as messages:
        async for parts, msg in messages:  # (closed with this one: the socket is free again)
            yield parts[0], msg


async def dealer_messages(sock: Socket, decoder: wire.Decoder[M],
                          log: logging.Logger) -> AsyncIterator[M]:
    """Every message arriving on a DEALER socket (see _frames_in)."""
    async with contextlib.aclosing(_frames_in(sock, decoder, log, 1)) as messages:
        async for _, msg in messages:
            yield msg
