"""KV handoff between a prefill and a decode worker: the bootstrap protocol over ZMQ (the socket
layer of the handoff; the per-request state machine over it is tandem.engines.pd). See
ARCHITECTURE.md, "Disaggregated prefill/decode".

The prefill side binds a ROUTER bootstrap socket. A decode side connects a DEALER to it and, once
per peer, sends `KvHello` (its transfer agent's metadata and KV layout). Per request (`room`) the
decode side reserves pages and sends `KvRoom(room, pages)`; the prefill side computes the prompt's
KV, WRITEs it into those pages with the mover (NIXL, or a simulation for the mock engine), and
answers `KvDone(room, ok, first_token)` — only after its write has ended, so a `KvDone` of either
kind means no more bytes will land in those pages.

Page safety on the decode side: `DecodeSide.fetch` owns the reserved pages until it returns the
first token. On any failure (timeout, cancellation, prefill gone) it calls `release()` exactly once
when the pages are safe to reuse: at once if the prefill side said done or died, otherwise after
the prefill side's transfer deadline has passed — a late write can never land in reused pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.utils.monitor

from tandem.kv.movers import KvMover
from tandem.runtime import wire, transport
from tandem.runtime.errors import KvHandoffError
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.wire import (
    Bootstrap,
    KvCancel,
    KvDone,
    KvHello,
    KvHelloReply,
    KvRoom,
)

log = logging.getLogger("tandem.kv")

HELLO_TIMEOUT_S = 10.0
QUARANTINE_GRACE_S = 2.0

__all__ = ["DecodeSide", "Destination", "KvHandoffError", "PrefillSide", "QUARANTINE_GRACE_S"]


# --- prefill side ---------------------------------------------------------------------------------


@dataclass(eq=False)
class Destination:
    ident: bytes  # the decode side's socket identity
    peer: str  # the decode side's agent name for the mover
    pages: list[int]


@dataclass(eq=False)
class _Room:
    fut: asyncio.Future[Destination]
    expires: float


class PrefillSide:
    def __init__(self, mover: KvMover, host: str, port: int, *, room_timeout_s: float,
                 transfer_timeout_s: float, advertise_host: str = "") -> None:
        self.mover = mover
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host  # what decode workers connect to
        self.room_timeout_s = room_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._sock: zmq.asyncio.Socket | None = None
        self._peers: dict[bytes, str] = {}
        self._rooms: dict[int, _Room] = {}
        self._tasks = TaskGroup()

    @property
    def address(self) -> str:
        return f"{self.advertise_host}:{self.port}"

    async def start(self) -> None:
        self._sock = transport.router(f"tcp://{self.host}:{self.port}")
        self._tasks.spawn(self._recv_loop(), name="kv-bootstrap")
        self._tasks.spawn(self._expire_loop(), name="kv-expire")

    async def close(self) -> None:
        await self._tasks.close()
        if self._sock is not None:
            self._sock.close(linger=0)
        self.mover.close()

    def _room(self, room: int) -> _Room:
        r = self._rooms.get(room)
        if r is None:
            r = _Room(asyncio.get_running_loop().create_future(),
                      time.monotonic() + self.room_timeout_s)
            self._rooms[room] = r
        return r

    async def wait_room(self, room: int) -> Destination:
        """Where the decode side wants this room's KV (deadline: room_timeout_s)."""
        r = self._room(room)
        try:
            return await asyncio.wait_for(asyncio.shield(r.fut), self.room_timeout_s)
        except asyncio.TimeoutError:
            self._rooms.pop(room, None)
            raise KvHandoffError(f"room {room}: no decode worker sent its pages within "
                                 f"{self.room_timeout_s:.0f}s") from None

    def send(self, room: int, dest: Destination, local_pages: Sequence[int],
             first_token: int) -> asyncio.Task[KvHandoffError | None]:
        """Start the WRITE of the prompt's KV into `dest`; KvDone goes to the decode side once it
        has ended. The write is a task of ours (closed with us) whose result is None, or the
        KvHandoffError it failed with; the caller holds `local_pages` until it is done."""
        self._rooms.pop(room, None)
        return self._tasks.spawn(self._send(room, dest, list(local_pages), first_token),
                                 name=f"kv-send {room}")

    async def _send(self, room: int, dest: Destination, local: list[int],
                    first: int) -> KvHandoffError | None:
        n = len(dest.pages)
        if n > len(local):
            self._done(dest, KvDone(room, False, error="decode side asked for more pages"))
            return KvHandoffError(f"room {room}: decode side wants {n} pages, prompt has "
                                  f"{len(local)}")
        try:
            await self.mover.write(dest.peer, local[:n], dest.pages, self.transfer_timeout_s)
        except Exception as e:  # the one place a mover's failure becomes a KvHandoffError
            self._done(dest, KvDone(room, False, error=f"KV transfer failed: {e}"))
            return KvHandoffError(f"room {room}: KV transfer failed: {e}")
        self._done(dest, KvDone(room, True, first))
        return None

    def fail(self, room: int, error: str) -> None:
        """The prefill of `room` failed before any write: tell its decode side if we know it."""
        r = self._rooms.pop(room, None)
        if r is not None and r.fut.done() and not r.fut.cancelled() and r.fut.exception() is None:
            self._done(r.fut.result(), KvDone(room, False, error=error))
        elif r is not None and not r.fut.done():
            r.fut.cancel()

    def _done(self, dest: Destination, msg: KvDone) -> None:
        assert self._sock is not None
        try:
            transport.send_nowait(self._sock, msg, dest.ident)
        except zmq.ZMQError as e:
            log.warning("room %d: decode side unreachable (%s)", msg.room, e)

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        async for ident, msg in transport.router_messages(self._sock, wire.TO_PREFILL, log):
            if isinstance(msg, KvRoom):
                peer = self._peers.get(ident)
                r = self._room(msg.room)
                if peer is None:
                    transport.send_nowait(self._sock, KvDone(msg.room, False, error="no KvHello"), ident)
                elif not r.fut.done():
                    r.fut.set_result(Destination(ident, peer, msg.pages))
            elif isinstance(msg, KvCancel):
                cancelled = self._rooms.pop(msg.room, None)
                if cancelled is not None and not cancelled.fut.done():
                    cancelled.fut.set_exception(KvHandoffError(f"room {msg.room} cancelled by "
                                                               "decode"))
                    cancelled.fut.exception()  # retrieved: no "never retrieved" warning if nobody waits
            elif isinstance(msg, KvHello):
                self._on_hello(ident, msg)

    def _on_hello(self, ident: bytes, msg: KvHello) -> None:
        assert self._sock is not None
        try:
            if msg.version != wire.PROTOCOL_VERSION:
                raise ValueError(f"protocol version {msg.version} != {wire.PROTOCOL_VERSION}")
            self._peers[ident] = self.mover.add_peer(msg.agent_metadata, msg.layout)
            reply = KvHelloReply(True, self.address)
        except Exception as e:
            log.error("bootstrap hello from %s refused: %s", msg.decode_name, e)
            reply = KvHelloReply(False, self.address, str(e))
        transport.send_nowait(self._sock, reply, ident)

    async def _expire_loop(self) -> None:
        """Rooms whose pages arrived but whose request never did are forgotten after a deadline."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for room, r in list(self._rooms.items()):
                if r.expires < now:
                    del self._rooms[room]
                    if r.fut.done() and not r.fut.cancelled() and r.fut.exception() is None:
                        self._done(r.fut.result(), KvDone(room, False,
                                                          error="the prefill request never came"))
                    elif not r.fut.done():
                        r.fut.cancel()


# --- decode side ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Pending:
    fut: asyncio.Future[KvDone]
    release: Callable[[], None]


@dataclass(eq=False)
class _Conn:
    address: str
    sock: zmq.asyncio.Socket
    hello: asyncio.Future[KvHelloReply]
    rooms: dict[int, _Pending] = field(default_factory=dict)
    dead: bool = False


class DecodeSide:
    def __init__(self, mover: KvMover, name: str, *, done_timeout_s: float,
                 transfer_timeout_s: float) -> None:
        self.mover = mover
        self.name = name
        self.done_timeout_s = done_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._conns: dict[str, _Conn] = {}
        self._tasks = TaskGroup()
        self._ident = f"{name}-{id(self):x}".encode()

    async def close(self) -> None:
        for c in list(self._conns.values()):
            self._drop(c, "the decode worker is shutting down")
        await self._tasks.close()
        self.mover.close()

    @property
    def num_pending(self) -> int:
        return sum(len(c.rooms) for c in self._conns.values())

    async def fetch(self, bootstrap: Bootstrap, pages: list[int],
                    release: Callable[[], None]) -> int:
        """Ask the prefill side for the room's KV in `pages`; return the first token once the KV
        is in place. On failure raise KvHandoffError and call `release()` once pages are safe."""
        try:
            conn = await self._connect(bootstrap)
        except BaseException:
            release()
            raise
        done_fut: asyncio.Future[KvDone] = asyncio.get_running_loop().create_future()
        pending = _Pending(done_fut, release)
        conn.rooms[bootstrap.room] = pending
        self._send(conn, KvRoom(bootstrap.room, pages))
        try:
            done = await asyncio.wait_for(asyncio.shield(done_fut), self.done_timeout_s)
        except BaseException as e:
            # The prefill side may still be writing into `pages`: quarantine them.
            self._send(conn, KvCancel(bootstrap.room))
            self._tasks.spawn(self._quarantine(conn, bootstrap.room, pending))
            if isinstance(e, asyncio.TimeoutError):
                raise KvHandoffError(f"room {bootstrap.room}: no KV from {conn.address} within "
                                     f"{self.done_timeout_s:.0f}s") from None
            raise
        conn.rooms.pop(bootstrap.room, None)
        if not done.ok:
            release()
            raise KvHandoffError(f"room {bootstrap.room}: prefill failed: {done.error}")
        return done.first_token

    async def _quarantine(self, conn: _Conn, room: int, pending: _Pending) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(pending.fut),
                                   self.transfer_timeout_s + QUARANTINE_GRACE_S)
        except BaseException:
            pass
        finally:
            conn.rooms.pop(room, None)
            pending.release()

    def _send(self, conn: _Conn, msg: wire._Tagged) -> None:
        try:
            transport.send_nowait(conn.sock, msg)
        except zmq.ZMQError as e:
            self._drop(conn, f"cannot send to {conn.address}: {e}")

    async def _connect(self, b: Bootstrap) -> _Conn:
        address = f"{b.host}:{b.port}"
        conn = self._conns.get(address)
        if conn is None or conn.dead:
            sock = transport.dealer(f"tcp://{address}", self._ident)
            conn = _Conn(address, sock, asyncio.get_running_loop().create_future())
            self._conns[address] = conn
            self._tasks.spawn(self._recv_loop(conn), name=f"kv-recv {address}")
            self._tasks.spawn(self._watch(conn), name=f"kv-watch {address}")
            self._send(conn, KvHello(wire.PROTOCOL_VERSION, self.name, self.mover.metadata(),
                                     self.mover.kv_layout()))
        try:
            reply = await asyncio.wait_for(asyncio.shield(conn.hello), HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._drop(conn, "no bootstrap hello reply")
            raise KvHandoffError(f"prefill bootstrap {address} did not answer within "
                                 f"{HELLO_TIMEOUT_S:.0f}s") from None
        if not reply.ok:
            raise KvHandoffError(f"prefill bootstrap {address} refused us: {reply.error}")
        return conn

    def _drop(self, conn: _Conn, why: str) -> None:
        """The prefill side is gone: nothing more will be written, so its pages are safe now."""
        if conn.dead:
            return
        conn.dead = True
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
        if not conn.hello.done():
            conn.hello.set_exception(KvHandoffError(why))
            conn.hello.exception()
        for p in conn.rooms.values():
            if not p.fut.done():
                p.fut.set_result(KvDone(-1, False, error=why))
        conn.sock.close(linger=0)

    async def _recv_loop(self, conn: _Conn) -> None:
        try:
            async for msg in transport.dealer_messages(conn.sock, wire.TO_DECODE, log):
                if isinstance(msg, KvDone):
                    p = conn.rooms.get(msg.room)
                    if p is not None and not p.fut.done():
                        p.fut.set_result(msg)
                elif isinstance(msg, KvHelloReply) and not conn.hello.done():
                    conn.hello.set_result(msg)
        except zmq.ZMQError:
            return  # the socket was closed: the connection was dropped

    async def _watch(self, conn: _Conn) -> None:
        mon = conn.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while not conn.dead:
                event = zmq.utils.monitor.parse_monitor_message(await mon.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._drop(conn, f"prefill worker at {conn.address} disconnected")
        finally:
            mon.close(linger=0)
