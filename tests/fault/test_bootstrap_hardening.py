"""A prefill worker's KV bootstrap side (tandem.kv.bootstrap.prefill) against hostile or broken
decode peers, on an in-memory ROUTER channel (every message through the wire encoding): replies to
peers that left never end its loop; a KvHello with a huge layout or garbage metadata is refused
before the mover sees it; a room naming pages the peer does not have is refused; rooms belong to the
peer that bound them; a decode side whose hello was forgotten says hello again; and a loop that
dies anyway is fatal for the process (supervised), not a silently deaf bootstrap socket."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import pytest

from tandem.kv.bootstrap.decode import DecodeSide, PrefillSide
from tandem.kv.transfer.movers import SimulatedMover
from tandem.runtime import lifecycle, transport, wire
from tandem.runtime.channel import MemoryChannel, MemoryRouter
from tandem.runtime.wire import (Bootstrap, KvCancel, KvDone, KvDones, KvHello, KvHelloReply,
                                 KvLayout, KvRoom, KvRooms)
from tests.cluster import free_port
from tests.waits import until

PAGE_BYTES = 4096


class SpyMover(SimulatedMover):
    """A simulated mover remembering the layouts it was asked to add (a NIXL mover would
    allocate and register descriptors for each of their pages)."""

    def __init__(self) -> None:
        super().__init__("prefill", PAGE_BYTES, 64)
        self.added: list[KvLayout] = []

    def add_peer(self, metadata: bytes, layout: KvLayout) -> str:
        self.added.append(layout)
        return super().add_peer(metadata, layout)


class Decode:
    """A decode peer, played by the test, on its own connection to the prefill side."""

    def __init__(self, router: MemoryRouter, identity: bytes) -> None:
        self.ident = identity
        self.end: MemoryChannel = router.connect(identity)
        self.name = identity.decode()

    def send(self, msg: wire.Message) -> None:
        self.end.send_nowait(msg)

    async def recv(self, timeout: float = 5.0) -> wire.ToDecode:
        return await asyncio.wait_for(anext(aiter(self.end)), timeout)

    async def done(self) -> KvDone:
        """The next KvDones, holding one KvDone."""
        msg = await self.recv()
        assert isinstance(msg, KvDones) and len(msg.items) == 1, msg
        return msg.items[0]

    async def hello(self, num_pages: int = 32, page_bytes: int = PAGE_BYTES,
                    metadata: bytes | None = None) -> KvHelloReply:
        md = self.name.encode() if metadata is None else metadata
        self.send(KvHello(wire.PROTOCOL_VERSION, self.name, md,
                          KvLayout(0, page_bytes, num_pages, "SIM")))
        reply = await self.recv()
        assert isinstance(reply, KvHelloReply)
        return reply

    def close(self) -> None:
        self.end.close()


def rooms(*items: tuple[int, list[int]]) -> KvRooms:
    return KvRooms([KvRoom(room, pages) for room, pages in items])


@pytest.fixture
async def prefill() -> AsyncIterator[tuple[PrefillSide, SpyMover, MemoryRouter]]:
    mover = SpyMover()
    router: MemoryRouter = MemoryRouter(decoders=(wire.TO_PREFILL, wire.TO_DECODE))
    side = PrefillSide(mover, "127.0.0.1", 7200, room_timeout_s=5.0, transfer_timeout_s=5.0,
                       channel=router)
    await side.start()
    try:
        yield side, mover, router
    finally:
        await side.close()


def counted(what: str) -> int:
    return transport.protocol_errors[("bootstrap", what)]


async def test_replies_to_peers_that_left_never_end_the_loop(prefill) -> None:
    side, _, router = prefill
    before = counted("reply to a gone or slow peer")
    gone = [Decode(router, f"gone-{i}".encode()) for i in range(5)]
    for d in gone:  # a room without a hello, and a hello: each has an answer...
        d.send(rooms((1, [0, 1])))
        d.send(KvHello(wire.PROTOCOL_VERSION, "gone", b"gone", KvLayout(0, PAGE_BYTES, 8, "SIM")))
        d.close()  # ...that goes to a peer gone before the loop read its messages
    await until(lambda: counted("reply to a gone or slow peer") - before == 10)
    d = Decode(router, b"decode-ok")
    assert (await d.hello()).ok  # the loop still answers
    d.send(rooms((77, [3, 4])))
    dest = await asyncio.wait_for(side.wait_room(77), 5)
    assert dest.pages == [3, 4] and dest.ident == b"decode-ok"


async def test_a_reply_to_an_identity_the_router_does_not_know_is_refused_not_raised() -> None:
    """On ZMQ: a send to a peer that is not connected (EHOSTUNREACH under ROUTER_MANDATORY) is
    counted and skipped, the same as on the in-memory channel."""
    side = PrefillSide(SpyMover(), "127.0.0.1", free_port(), room_timeout_s=5.0,
                       transfer_timeout_s=5.0)
    await side.start()
    try:
        before = counted("reply to a gone or slow peer")
        side.dispatch((b"never-connected", rooms((1, [0]))))  # refused: no KvHello
        await until(lambda: counted("reply to a gone or slow peer") == before + 1)
    finally:
        await side.close()


@pytest.mark.parametrize("layout, metadata", [
    (KvLayout(0, PAGE_BYTES, 1 << 30, "SIM"), b"m"),  # a billion pages: GBs of descriptors
    (KvLayout(0, PAGE_BYTES, 0, "SIM"), b"m"),
    (KvLayout(2**64 - PAGE_BYTES, PAGE_BYTES, 8, "SIM"), b"m"),  # past the 64-bit addresses
    (KvLayout(0, PAGE_BYTES, 8, "X" * 1000), b"m"),
    (KvLayout(0, PAGE_BYTES, 8, "SIM", device=-1), b"m"),
    (KvLayout(0, PAGE_BYTES, 8, "SIM"), b""),
    (KvLayout(0, PAGE_BYTES, 8, "SIM"), b"\x00" * (1 << 20)),  # 1 MiB of "metadata"
])
async def test_a_hello_that_would_cost_gigabytes_or_is_garbage_is_refused(
        prefill, layout: KvLayout, metadata: bytes) -> None:
    _, mover, router = prefill
    d = Decode(router, b"decode-x")
    d.send(KvHello(wire.PROTOCOL_VERSION, "x", metadata, layout))
    reply = await d.recv()
    assert isinstance(reply, KvHelloReply) and not reply.ok and reply.error
    assert mover.added == []  # the mover never saw it


async def test_garbage_metadata_the_mover_rejects_is_refused_not_fatal(prefill) -> None:
    _, _, router = prefill
    d = Decode(router, b"decode-y")
    reply = await d.hello(metadata=b"\xff\xfe")  # not the simulated mover's UTF-8 name
    assert not reply.ok
    assert (await d.hello()).ok  # the same peer, done right, is accepted


async def test_a_room_naming_pages_the_peer_lacks_is_refused(prefill) -> None:
    side, _, router = prefill
    d = Decode(router, b"decode-z")
    assert (await d.hello(num_pages=8)).ok
    for room, pages in [(1, [8]), (2, [-1]), (3, []), (4, [1, 1]), (-5, [1]),
                        (6, list(range(9)))]:
        d.send(rooms((room, pages)))
        done = await d.done()
        assert done.room == room and not done.ok, pages
    waiting = asyncio.create_task(side.wait_room(1))
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing was bound for it
    waiting.cancel()


async def test_rooms_belong_to_the_peer_that_bound_them(prefill) -> None:
    side, _, router = prefill
    a, b = Decode(router, b"decode-a"), Decode(router, b"decode-b")
    assert (await a.hello()).ok and (await b.hello()).ok
    before = counted("cancel of a room the peer did not bind")
    waiting = asyncio.create_task(side.wait_room(42))
    a.send(rooms((42, [1, 2, 3])))
    dest = await asyncio.wait_for(waiting, 5)  # bound to a
    assert dest.ident == b"decode-a" and dest.pages == [1, 2, 3]
    side.dispatch((b"decode-b", rooms((42, [4, 5, 6]))))  # another peer's room: refused to b
    refused = await b.done()
    assert refused.room == 42 and not refused.ok
    unbound = asyncio.create_task(side.wait_room(43))
    await asyncio.sleep(0)  # (the room exists, bound to nobody)
    side.dispatch((b"decode-b", KvCancel([42, 43])))  # neither is b's to cancel: both ignored
    assert counted("cancel of a room the peer did not bind") - before == 2
    assert not unbound.done()
    assert (await side.wait_room(42)).ident == b"decode-a"  # still bound to a
    # The binding peer's own rooms, and its cancel: the room is forgotten.
    a.send(rooms((43, [7])))
    assert (await asyncio.wait_for(unbound, 5)).pages == [7]
    side.dispatch((b"decode-a", rooms((44, [8]))))
    side.dispatch((b"decode-a", KvCancel([44])))
    again = asyncio.create_task(side.wait_room(44))
    await asyncio.sleep(0)
    assert not again.done()  # a new room: it waits for pages again
    again.cancel()


async def test_a_bootstrap_loop_that_dies_is_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    crashes: list[str] = []
    monkeypatch.setattr(lifecycle, "crash", lambda why, exc=None: crashes.append(why))

    async def broken(sock: object, decoder: object, log: logging.Logger) -> AsyncIterator[
            tuple[bytes, Sequence[int]]]:
        raise RuntimeError("injected receive failure")
        yield  # pragma: no cover

    monkeypatch.setattr(transport, "router_messages", broken)
    side = PrefillSide(SpyMover(), "127.0.0.1", free_port(), room_timeout_s=5.0,
                       transfer_timeout_s=5.0)
    await side.start()
    await until(lambda: bool(crashes))
    await side.close()
    assert crashes == ["task kv-bootstrap died"]


async def test_pages_that_come_after_their_prefill_failed_are_answered_at_once(prefill) -> None:
    side, _, router = prefill
    d = Decode(router, b"decode-late")
    assert (await d.hello()).ok
    side.fail(55, "the prefill request was aborted")  # before the decode side's pages came
    d.send(rooms((55, [1, 2])))
    done = await d.done()
    assert done.room == 55 and not done.ok and "aborted" in done.error


async def test_a_pass_of_rooms_is_checked_room_by_room_and_its_dones_come_in_one(prefill) -> None:
    """KvRooms (a decode worker's loop pass of rooms) binds each good room as if it came alone
    and refuses each bad one; the writes the prefill side ends in one loop pass are answered in
    one KvDones. A KvRooms past the room cap is refused whole, and counted."""
    side, _, router = prefill
    d = Decode(router, b"decode-batch")
    assert (await d.hello(num_pages=8)).ok
    d.send(rooms((61, [1, 2]), (62, [9]), (63, [3])))
    refused = await d.done()
    assert refused.room == 62 and not refused.ok
    a, b = await asyncio.wait_for(asyncio.gather(side.wait_room(61), side.wait_room(63)), 5)
    assert (a.pages, b.pages) == ([1, 2], [3])
    writes = [side.send(61, a, [5, 6], 11), side.send(63, b, [7], 12)]  # (in one loop pass)
    assert await asyncio.gather(*writes) == [None, None]
    dones = await d.recv()
    assert isinstance(dones, KvDones)
    assert [(x.room, x.ok, x.first_token) for x in dones.items] == [(61, True, 11), (63, True, 12)]
    before = counted("too many rooms in one message")
    from tandem.kv.bootstrap.prefill import MAX_ROOMS
    side.dispatch((b"decode-batch", rooms(*[(100 + i, [1]) for i in range(MAX_ROOMS + 1)])))
    assert counted("too many rooms in one message") == before + 1
    side.dispatch((b"decode-batch", KvCancel(list(range(MAX_ROOMS + 1)))))
    assert counted("too many rooms in one message") == before + 2
    waiting = asyncio.create_task(side.wait_room(100))
    await asyncio.sleep(0)
    assert not waiting.done()  # none of its rooms was bound
    waiting.cancel()


async def test_a_decode_side_whose_hello_was_forgotten_says_hello_again(
        monkeypatch: pytest.MonkeyPatch, prefill) -> None:
    """Hellos from many outside identities make the prefill side forget an idle legitimate peer
    (it makes room for new ones); that peer's next room is refused with NO_HELLO, and the decode
    side says hello again and asks once more, so its request succeeds. (Seen before: every later
    PD request failed with "no KvHello", for as long as the prefill worker lived.)"""
    from tandem.kv.bootstrap import prefill as prefill_mod

    monkeypatch.setattr(prefill_mod, "MAX_PEERS", 3)
    side, _, router = prefill
    decode = DecodeSide(SimulatedMover("decode", PAGE_BYTES, 64), "decode", done_timeout_s=5.0,
                        transfer_timeout_s=1.0, connect=lambda _, ident: router.connect(ident))
    try:
        async def one(room: int) -> int:
            fetch = asyncio.create_task(decode.fetch(Bootstrap("127.0.0.1", 7200, room), [2, 3],
                                                     lambda: None))
            dest = await asyncio.wait_for(side.wait_room(room), 5)
            err = await side.send(room, dest, [0, 1], first_token=40 + room)
            assert err is None
            first, _, _ = await asyncio.wait_for(fetch, 5)
            return first

        assert await one(1) == 41
        for i in range(6):  # outsiders' hellos push the idle legitimate peer out
            assert (await Decode(router, f"outsider-{i}".encode()).hello()).ok
        before = counted("room from a peer without KvHello")
        assert await one(2) == 42  # refused once (NO_HELLO), hello again, then served
        assert counted("room from a peer without KvHello") == before + 1
    finally:
        await decode.close()
