"""The prefill side of the KV handoff's bootstrap protocol (tandem.kv.bootstrap.decode has the
protocol and the decode side): the ROUTER channel decode workers connect to (a ZMQ ROUTER bound at
its address, or any `RouterChannel` given), the rooms waiting for their pages or their request,
and the page WRITEs (through the mover) with their `KvDone` answers.

It treats every decode peer as untrusted input. Bytes that do not decode are dropped by the
transport; a `KvHello` is checked (tandem.kv.bootstrap.checks: caps on metadata, pages, address range)
before the mover sees it, and the mover adds the peer off the event loop, one at a time; a
`KvRoom` is checked against the layout its peer announced, and binds its room to that peer (ZMQ
identity): a second peer's `KvRoom` for it is refused, and only the binding peer may `KvCancel`
it. A reply to a peer that is gone (EHOSTUNREACH under ROUTER_MANDATORY) or not reading (EAGAIN)
is skipped. Each refusal is counted in `transport.protocol_errors` ("bootstrap", what) and logged
rate-limited, as is each peer whose security handshake failed (no keys, or another cluster's);
nothing a peer sends ends the loops, which are supervised (a death is fatal).
At most MAX_PEERS peers are known at once (the least recently heard idle one makes room) and
MAX_ROOMS rooms wait at once, so memory stays bounded whatever peers send.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tandem.kv.bootstrap.checks import NO_HELLO, check_hello, check_room
from tandem.kv.transfer.movers import KvMover
from tandem.runtime import transport, wire
from tandem.runtime.channel import ChannelFull, RouterChannel, ZmqRouterChannel, serve
from tandem.runtime.errors import KvHandoffError
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.passes import PassBatcher
from tandem.runtime.wire import (
    KvCancel, KvDone, KvDones, KvHello, KvHelloReply, KvLayout, KvRoom, KvRooms, TokenLogprobs,
)

log = logging.getLogger("tandem.kv")

MAX_PEERS = 256  # decode peers a prefill worker knows at once (idle ones make room for new ones)
MAX_PENDING_HELLOS = 8
MAX_ROOMS = 1 << 16  # rooms waiting for their request or their pages
MAX_BATCH = 4096  # KvRooms or KvDones items in one message (a pass's for one peer may take more)

__all__ = ["DecodePeers", "Destination", "PrefillSide", "batches"]

B = TypeVar("B")
DecodePeers = RouterChannel[wire.Message, wire.ToPrefill]


def batches(items: list[B], batch: Callable[[list[B]], wire.Message]) -> Iterator[wire.Message]:
    """`items` as `batch(chunk)` messages of at most MAX_BATCH items each."""
    for i in range(0, len(items), MAX_BATCH):
        yield batch(items[i:i + MAX_BATCH])


@dataclass(eq=False)
class Destination:
    ident: bytes  # the decode side's socket identity
    peer: str  # the decode side's agent name for the mover
    pages: list[int]
    skip: int = 0  # the prompt's pages before this one are cached there: not written


@dataclass(eq=False)
class _Room:
    fut: asyncio.Future[Destination]
    expires: float
    owner: bytes | None = None  # the decode peer whose KvRoom bound it: only it may cancel it
    failed: str = ""  # its prefill failed before the pages came: their KvRoom gets this at once


@dataclass(eq=False)
class _Peer:
    name: str  # its agent name in the mover
    last_heard: float
    writes: int = 0  # writes into its pages under way


class PrefillSide:
    carries_logprobs = True  # KvDone carries the first token's logprobs (tandem.engines.handoff)

    def __init__(self, mover: KvMover, host: str, port: int, *, room_timeout_s: float,
                 transfer_timeout_s: float, advertise_host: str = "",
                 channel: DecodePeers | None = None) -> None:
        """`channel`: where decode sides reach it; by default `start` binds a ZMQ ROUTER at
        host:port."""
        self.mover = mover
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host  # what decode workers connect to
        self.room_timeout_s = room_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._channel = channel
        self._peers: dict[bytes, _Peer] = {}
        self._layouts: dict[bytes, KvLayout] = {}
        self._hellos: set[bytes] = set()  # peers whose KvHello is being added, off the loop
        self._hello_lock = asyncio.Lock()  # one peer added at a time
        self._rooms: dict[int, _Room] = {}
        self._dones: PassBatcher[tuple[bytes, KvDone]] = PassBatcher(self._send_dones)
        self._loops = TaskGroup(supervised=True)  # the socket's loops: a death is fatal
        self._tasks = TaskGroup()  # writes and hellos

    @property
    def address(self) -> str:
        return f"{self.advertise_host}:{self.port}"

    async def start(self) -> None:
        if self._channel is None:
            self._channel = ZmqRouterChannel(f"tcp://{self.host}:{self.port}", wire.TO_PREFILL,
                                             log)
        self._loops.spawn(serve(self._channel, self.dispatch, "bootstrap", log),
                          name="kv-bootstrap")
        self._loops.spawn(self._expire_loop(), name="kv-expire")
        self._loops.spawn(self._channel.count_refused_handshakes("bootstrap", log),
                          name="kv-handshakes")

    async def close(self) -> None:
        await self._loops.close()
        await self._tasks.close()
        if self._channel is not None:
            self._dones.flush_now()  # (what this pass ended is said before the channel goes)
            self._channel.close()
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
        r.failed = ""  # (a request for the room again: it is no longer failed)
        if r.fut.done() and not r.fut.cancelled():  # the pages came first: no wait
            return r.fut.result()  # (or the KvHandoffError of a cancel by the decode side)
        try:
            return await asyncio.wait_for(asyncio.shield(r.fut), self.room_timeout_s)
        except asyncio.TimeoutError:
            self._rooms.pop(room, None)
            raise KvHandoffError(f"room {room}: no decode worker sent its pages within "
                                 f"{self.room_timeout_s:.0f}s") from None

    def send(self, room: int, dest: Destination, local_pages: Sequence[int], first_token: int,
             first_logprobs: TokenLogprobs | None = None, cached_tokens: int = 0
             ) -> asyncio.Task[KvHandoffError | None]:
        """Start the WRITE of the prompt's KV into `dest`; KvDone goes to the decode side once it
        has ended. The write is a task of ours (closed with us) whose result is None, or the
        KvHandoffError it failed with; the caller holds `local_pages` until it is done."""
        self._rooms.pop(room, None)
        return self._tasks.spawn(self._send(room, dest, list(local_pages), first_token,
                                            first_logprobs, cached_tokens),
                                 name=f"kv-send {room}")

    async def _send(self, room: int, dest: Destination, local: list[int], first: int,
                    first_logprobs: TokenLogprobs | None,
                    cached_tokens: int) -> KvHandoffError | None:
        n, skip = len(dest.pages), dest.skip
        if skip + n > len(local):
            self._done(dest.ident, KvDone(room, False,
                                          error="decode side asked for more pages"))
            return KvHandoffError(f"room {room}: decode side wants pages {skip} to {skip + n}, "
                                  f"prompt has {len(local)}")
        peer = self._peers.get(dest.ident)
        if peer is not None:
            peer.writes += 1  # (not evicted while it runs)
        try:
            await self.mover.write(dest.peer, local[skip:skip + n], dest.pages,
                                   self.transfer_timeout_s)
        except Exception as e:  # the one place a mover's failure becomes a KvHandoffError
            self._done(dest.ident, KvDone(room, False, error=f"KV transfer failed: {e}"))
            return KvHandoffError(f"room {room}: KV transfer failed: {e}")
        finally:
            if peer is not None:
                peer.writes -= 1
        self._done(dest.ident, KvDone(room, True, first, first_logprobs=first_logprobs,
                                      cached_tokens=cached_tokens))
        return None

    def fail(self, room: int, error: str) -> None:
        """The prefill of `room` failed before any write: tell its decode side if we know it."""
        r = self._rooms.pop(room, None)
        if r is not None and r.fut.done() and not r.fut.cancelled() and r.fut.exception() is None:
            self._done(r.fut.result().ident, KvDone(room, False, error=error))
            return
        if r is not None and not r.fut.done():
            r.fut.cancel()
        if len(self._rooms) < MAX_ROOMS:  # the pages may still come: remember why, until expiry
            self._room(room).failed = error or "the prefill failed"

    def _done(self, ident: bytes, msg: KvDone) -> None:
        """Tell the decode side a room ended: with the others of this loop pass for that peer, in
        one message (a burst's prefills end together; a send per room would wake ZMQ's I/O thread
        for each)."""
        self._dones.add((ident, msg))

    def _send_dones(self, dones: list[tuple[bytes, KvDone]]) -> None:
        per_peer: dict[bytes, list[KvDone]] = {}
        for ident, done in dones:
            per_peer.setdefault(ident, []).append(done)
        for ident, items in per_peer.items():
            for msg in batches(items, KvDones):
                self._reply(ident, msg)

    def _reply(self, ident: bytes, msg: wire.Message) -> None:
        """Send to a decode peer; one that is gone (EHOSTUNREACH) or not reading (EAGAIN past the
        high-water mark) is counted and skipped: it never ends the loop."""
        assert self._channel is not None
        try:
            self._channel.send_nowait(ident, msg)
        except ChannelFull as e:
            transport.refused("bootstrap", "reply to a gone or slow peer", log, e)

    def _refuse_room(self, ident: bytes, room: int, what: str, why: str) -> None:
        transport.refused("bootstrap", what, log, why)
        self._done(ident, KvDone(room, False, error=why))

    def dispatch(self, item: tuple[bytes, wire.ToPrefill]) -> None:
        """One message from a decode peer (identity, message): the receive loop's handler."""
        ident, msg = item
        peer = self._peers.get(ident)
        if peer is not None:
            peer.last_heard = time.monotonic()
        if isinstance(msg, KvRooms):
            if len(msg.items) > MAX_ROOMS:
                return transport.refused("bootstrap", "too many rooms in one message", log,
                                         len(msg.items))
            for one in msg.items:  # (each checked as if it came alone)
                self._on_room(ident, one)
        elif isinstance(msg, KvCancel):
            if len(msg.rooms) > MAX_ROOMS:
                return transport.refused("bootstrap", "too many rooms in one message", log,
                                         len(msg.rooms))
            for room in msg.rooms:
                self._on_cancel(ident, room)
        elif isinstance(msg, KvHello):
            self._on_hello(ident, msg)

    def _on_cancel(self, ident: bytes, room: int) -> None:
        r = self._rooms.get(room)
        if r is None:
            return  # written, failed or expired already (the race is normal)
        if r.owner is None or r.owner != ident:
            return transport.refused("bootstrap", "cancel of a room the peer did not bind", log)
        del self._rooms[room]
        if not r.fut.done():
            r.fut.set_exception(KvHandoffError(f"room {room} cancelled by decode"))
            r.fut.exception()  # retrieved: no "never retrieved" warning if nobody waits

    def _on_room(self, ident: bytes, msg: KvRoom) -> None:
        peer, layout = self._peers.get(ident), self._layouts.get(ident)
        if peer is None or layout is None:
            return self._refuse_room(ident, msg.room, "room from a peer without KvHello",
                                     NO_HELLO)
        why = check_room(msg, layout)
        if why is not None:
            return self._refuse_room(ident, msg.room, "bad room", why)
        r = self._rooms.get(msg.room)
        if r is not None and r.failed:
            del self._rooms[msg.room]
            return self._done(ident, KvDone(msg.room, False, error=r.failed))
        if r is None:
            if len(self._rooms) >= MAX_ROOMS:
                return self._refuse_room(ident, msg.room, "too many rooms",
                                         f"more than {MAX_ROOMS} rooms wait for their requests")
            r = self._room(msg.room)
        if r.owner is not None:
            if r.owner != ident:
                self._refuse_room(ident, msg.room, "room bound to another peer",
                                  "the room is another peer's")
            return  # (the same peer twice: the first stands)
        r.owner = ident
        if not r.fut.done():
            r.fut.set_result(Destination(ident, peer.name, msg.pages, msg.skip))

    def _on_hello(self, ident: bytes, msg: KvHello) -> None:
        why = check_hello(msg, self.mover.kv_layout())
        if why is None and ident in self._hellos:
            why = "a KvHello from this peer is being handled"
        if why is None and len(self._hellos) >= MAX_PENDING_HELLOS:
            why = "too many KvHellos at once; try again"
        if why is not None:
            transport.refused("bootstrap", "hello refused", log, f"{msg.decode_name[:64]}: {why}")
            return self._reply(ident, KvHelloReply(False, self.address, why))
        self._hellos.add(ident)
        self._tasks.spawn(self._add_peer(ident, msg), name="kv-hello")

    async def _add_peer(self, ident: bytes, msg: KvHello) -> None:
        """Add a peer to the mover off the event loop (preparing its descriptors costs time in
        proportion to its pages), one at a time; then answer it."""
        try:
            async with self._hello_lock:
                if ident not in self._peers and not self._make_room_for_a_peer():
                    raise ValueError(f"already {MAX_PEERS} peers, each busy")
                name = await asyncio.to_thread(self.mover.add_peer, msg.agent_metadata,
                                               msg.layout)
            self._peers[ident] = _Peer(name, time.monotonic())
            self._layouts[ident] = msg.layout
            reply = KvHelloReply(True, self.address)
        except Exception as e:
            transport.refused("bootstrap", "hello refused", log, f"{msg.decode_name[:64]}: {e}")
            reply = KvHelloReply(False, self.address, str(e)[:512])
        finally:
            self._hellos.discard(ident)
        self._reply(ident, reply)

    def _make_room_for_a_peer(self) -> bool:
        """At MAX_PEERS, forget the peer heard from least recently that has no room bound and no
        write under way (a decode worker that restarted, most likely); False if none can go."""
        if len(self._peers) < MAX_PEERS:
            return True
        owners = {r.owner for r in self._rooms.values()}
        idle = [(p.last_heard, i) for i, p in self._peers.items()
                if not p.writes and i not in owners]
        if not idle:
            return False
        ident = min(idle)[1]
        gone = self._peers.pop(ident)
        self._layouts.pop(ident, None)
        if all(p.name != gone.name for p in self._peers.values()):
            self.mover.remove_peer(gone.name)
        return True

    async def _expire_loop(self) -> None:
        """Rooms whose pages arrived but whose request never did are forgotten after a deadline."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for room, r in list(self._rooms.items()):
                if r.expires < now:
                    del self._rooms[room]
                    if r.fut.done() and not r.fut.cancelled() and r.fut.exception() is None:
                        self._done(r.fut.result().ident,
                                   KvDone(room, False, error="the prefill request never came"))
                    elif not r.fut.done():
                        r.fut.cancel()
