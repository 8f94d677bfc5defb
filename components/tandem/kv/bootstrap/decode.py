"""KV handoff between a prefill and a decode worker: the bootstrap protocol over ZMQ (the socket
layer of the handoff; the per-request state machine over it is tandem.engines.handoff). See
ARCHITECTURE.md, "Disaggregated prefill/decode".

The prefill side (tandem.kv.bootstrap.prefill) binds a ROUTER bootstrap socket. A decode side connects
a DEALER to it and, once per peer, sends `KvHello` (its transfer agent's metadata and KV layout).
Per request (`room`) the decode side reserves pages and sends `KvRoom(room, pages)`; the prefill
side computes the prompt's KV, WRITEs it into those pages with the mover (NIXL, or a simulation
for the mock engine), and answers `KvDone(room, ok, first_token)` — only after its write has
ended, so a `KvDone` of either kind means no more bytes will land in those pages. Each side sends
what one loop pass produced for one peer as one message (`KvRooms`, `KvDones`, `KvCancel`: each
always a list, tandem.runtime.passes): a burst of requests costs a few ZMQ sends, not one or two per
request. Both sides are written against channels (tandem.runtime.channel): a decode side's
connection to a prefill side is a `Channel` (a ZMQ DEALER by default; `connect` gives another).

Page safety on the decode side: `DecodeSide.fetch` owns the reserved pages until it returns the
first token. On any failure (timeout, cancellation, prefill gone) it calls `release()` exactly once
when the pages are safe to reuse: at once if the prefill side said done or died, otherwise after
the prefill side's transfer deadline has passed — a late write can never land in reused pages.
What a prefill side sends is handled message by message (tandem.runtime.channel.serve): a reply a
handler fails on is dropped and counted, never the connection or the decode worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.kv.transfer.movers import KvMover
from tandem.kv.bootstrap.checks import NO_HELLO
from tandem.kv.bootstrap.prefill import Destination, PrefillSide, batches
from tandem.runtime import wire
from tandem.runtime.channel import Channel, ChannelFull, ZmqChannel, serve
from tandem.runtime.errors import KvHandoffError
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.passes import PassBatcher
from tandem.runtime.wire import (
    Bootstrap,
    KvCancel,
    KvDone,
    KvDones,
    KvHello,
    KvHelloReply,
    KvRoom,
    KvRooms,
    TokenLogprobs,
)

log = logging.getLogger("tandem.kv")

KV_HELLO_TIMEOUT_S = 10.0  # a prefill bootstrap must answer a decode worker's KvHello within
QUARANTINE_GRACE_S = 2.0

__all__ = ["DecodeSide", "Destination", "KvHandoffError", "PrefillSide", "QUARANTINE_GRACE_S"]

PrefillChannel = Channel[wire.Message, wire.ToDecode]
Connect = Callable[[str, bytes], PrefillChannel]  # (host:port, identity) -> a connected channel


def zmq_connect(address: str, identity: bytes) -> PrefillChannel:
    """A DEALER to a prefill side's bootstrap socket."""
    return ZmqChannel(f"tcp://{address}", identity, wire.TO_DECODE, log)


# --- decode side ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Pending:
    fut: asyncio.Future[KvDone]
    release: Callable[[], None]


@dataclass(eq=False)
class _Conn:
    address: str
    channel: PrefillChannel
    hello: asyncio.Future[KvHelloReply]
    out: PassBatcher[KvRoom | int] = field(init=False)  # this pass's rooms, and cancels (ints)
    rooms: dict[int, _Pending] = field(default_factory=dict)
    dead: bool = False
    watch: asyncio.Task[None] | None = None  # _watch: its disconnect monitor's reader


class DecodeSide:
    carries_logprobs = True  # fetch returns (first token, its logprobs) (tandem.engines.handoff)

    def __init__(self, mover: KvMover, name: str, *, done_timeout_s: float,
                 transfer_timeout_s: float, connect: Connect = zmq_connect) -> None:
        self.mover = mover
        self.connect = connect
        self.name = name
        self.done_timeout_s = done_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._conns: dict[str, _Conn] = {}
        self._tasks = TaskGroup()
        self._ident = f"{name}-{id(self):x}"
        self._num_conns = 0  # each connection has an identity of its own (see _connect)

    async def close(self) -> None:
        for c in list(self._conns.values()):
            self._drop(c, "the decode worker is shutting down")
        await self._tasks.close()
        self.mover.close()

    async def fetch(self, bootstrap: Bootstrap, pages: list[int], release: Callable[[], None],
                    skip: int = 0) -> tuple[int, TokenLogprobs | None, int]:
        """Ask the prefill side for the room's KV in `pages` (the prompt's pages from page `skip`
        on: the ones before are cached here); return the first token, its logprobs (when the
        request asked for them) and the prompt tokens the prefill side had cached, once the KV is
        in place. On failure raise KvHandoffError and call `release()` once pages are safe."""
        for ask in (1, 2):
            try:
                conn = await self._connect(bootstrap)
            except BaseException:
                release()
                raise
            done_fut: asyncio.Future[KvDone] = asyncio.get_running_loop().create_future()
            pending = _Pending(done_fut, release)
            conn.rooms[bootstrap.room] = pending
            self._queue(conn, KvRoom(bootstrap.room, pages, skip))
            try:
                done = await asyncio.wait_for(asyncio.shield(done_fut), self.done_timeout_s)
            except BaseException as e:
                # The prefill side may still be writing into `pages`: quarantine them.
                self._queue(conn, bootstrap.room)  # KvCancel (after its KvRoom, if that waits)
                self._tasks.spawn(self._quarantine(conn, bootstrap.room, pending))
                if isinstance(e, asyncio.TimeoutError):
                    raise KvHandoffError(f"room {bootstrap.room}: no KV from {conn.address} "
                                         f"within {self.done_timeout_s:.0f}s") from None
                raise
            conn.rooms.pop(bootstrap.room, None)
            if ask == 1 and not done.ok and done.error == NO_HELLO:
                # It forgot our hello (it restarted, or made room for other peers): it wrote
                # nothing, so say hello again on a new connection and ask once more.
                self._drop(conn, "the prefill side does not hold our KvHello")
                continue
            break
        if not done.ok or done.first_token < 0:
            release()
            raise KvHandoffError(f"room {bootstrap.room}: prefill failed: "
                                 f"{done.error or 'no first token'}")
        return done.first_token, done.first_logprobs, done.cached_tokens

    async def _quarantine(self, conn: _Conn, room: int, pending: _Pending) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(pending.fut),
                                   self.transfer_timeout_s + QUARANTINE_GRACE_S)
        except BaseException:
            pass
        finally:
            conn.rooms.pop(room, None)
            pending.release()

    def _queue(self, conn: _Conn, item: KvRoom | int) -> None:
        """A room (KvRoom), or a room to cancel (its number): sent with the others of this loop
        pass to the same prefill worker (`_flush`)."""
        if not conn.dead:
            conn.out.add(item)

    def _flush(self, conn: _Conn, items: list[KvRoom | int]) -> None:
        """This pass's rooms to `conn` as KvRooms, then its cancels as one KvCancel (a room is
        always asked for in an earlier pass than its cancel, or earlier in the same one)."""
        if conn.dead:
            return
        rooms = [m for m in items if isinstance(m, KvRoom)]
        for batch in batches(rooms, KvRooms):
            self._send(conn, batch)
        if len(rooms) < len(items):
            for cancels in batches([m for m in items if isinstance(m, int)], KvCancel):
                self._send(conn, cancels)

    def _send(self, conn: _Conn, msg: wire.Message) -> None:
        try:
            conn.channel.send_nowait(msg)
        except ChannelFull as e:
            self._drop(conn, f"cannot send to {conn.address}: {e}")

    async def _connect(self, b: Bootstrap) -> _Conn:
        address = f"{b.host}:{b.port}"
        conn = self._conns.get(address)
        if conn is None or conn.dead:
            # A new identity: the prefill side's ROUTER drops a connection that reuses one it may
            # not have seen leave yet (and a new connection is a new peer there: hello first).
            self._num_conns += 1
            channel = self.connect(address, f"{self._ident}-{self._num_conns}".encode())
            conn = _Conn(address, channel, asyncio.get_running_loop().create_future())
            conn.out = PassBatcher(functools.partial(self._flush, conn))
            self._conns[address] = conn
            self._tasks.spawn(serve(channel, functools.partial(self._on_message, conn), "decode",
                                    log), name=f"kv-recv {address}")
            conn.watch = self._tasks.spawn(self._watch(conn), name=f"kv-watch {address}")
            self._send(conn, KvHello(wire.PROTOCOL_VERSION, self.name, self.mover.metadata(),
                                     self.mover.kv_layout()))
        if conn.hello.done():  # The usual case: no wait (which, in 3.11's wait_for, would also
            reply = conn.hello.result()  # swallow a cancel made during its one loop pass).
        else:
            try:
                reply = await asyncio.wait_for(asyncio.shield(conn.hello), KV_HELLO_TIMEOUT_S)
            except asyncio.TimeoutError:
                self._drop(conn, "no bootstrap hello reply")
                raise KvHandoffError(f"prefill bootstrap {address} did not answer within "
                                     f"{KV_HELLO_TIMEOUT_S:.0f}s") from None
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
        conn.out.clear()
        conn.channel.close()  # (a ZMQ one turns its monitor off first: transport.disconnects)
        w = conn.watch
        if w is not None and w is not asyncio.current_task():
            w.cancel()

    def _on_message(self, conn: _Conn, msg: wire.ToDecode) -> None:
        if isinstance(msg, KvHelloReply):
            if not conn.hello.done():
                conn.hello.set_result(msg)
            return
        rooms = conn.rooms
        for done in msg.items:
            p = rooms.get(done.room)
            if p is not None and not p.fut.done():
                p.fut.set_result(done)

    async def _watch(self, conn: _Conn) -> None:
        async for why in conn.channel.disconnects():
            self._drop(conn, f"prefill worker at {conn.address} disconnected"
                       + (f" ({why})" if why else ""))
            return
