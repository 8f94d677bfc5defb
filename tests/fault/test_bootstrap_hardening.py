"""A prefill worker's KV bootstrap socket (tandem.kv.bootstrap.prefill) against hostile or broken decode
peers, through raw ZMQ DEALERs: replies to peers that left never end its loop; a KvHello with a
huge layout or garbage metadata is refused before the mover sees it; a KvRoom naming pages the
peer does not have is refused; rooms belong to the peer that bound them; and a loop that dies
anyway is fatal for the process (supervised), not a silently deaf bootstrap socket."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import pytest
import zmq
import zmq.asyncio

from tandem.kv.transfer.movers import SimulatedMover
from tandem.kv.bootstrap.decode import PrefillSide
from tandem.runtime import lifecycle, transport, wire
from tandem.runtime.errors import KvHandoffError
from tandem.runtime.wire import KvCancel, KvDone, KvHello, KvHelloReply, KvLayout, KvRoom
from tests.cluster import free_port

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
    """A raw DEALER on the decode side of the bootstrap protocol."""

    def __init__(self, address: str, identity: bytes) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)
        self.name = identity.decode()

    async def send(self, msg: wire.Message) -> None:
        await self.sock.send_multipart([wire.encode(msg)])

    async def recv(self, timeout: float = 5.0) -> wire.ToDecode:
        parts = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        return wire.TO_DECODE.decode(parts[0])

    async def hello(self, num_pages: int = 32, page_bytes: int = PAGE_BYTES,
                    metadata: bytes | None = None) -> KvHelloReply:
        md = self.name.encode() if metadata is None else metadata
        await self.send(KvHello(wire.PROTOCOL_VERSION, self.name, md,
                                KvLayout(0, page_bytes, num_pages, "SIM")))
        reply = await self.recv()
        assert isinstance(reply, KvHelloReply)
        return reply

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
async def prefill() -> AsyncIterator[tuple[PrefillSide, SpyMover, str]]:
    mover = SpyMover()
    port = free_port()
    side = PrefillSide(mover, "127.0.0.1", port, room_timeout_s=5.0, transfer_timeout_s=5.0)
    await side.start()
    try:
        yield side, mover, f"tcp://127.0.0.1:{port}"
    finally:
        await side.close()


async def test_replies_to_peers_that_left_never_end_the_loop(prefill) -> None:
    side, _, address = prefill
    before = transport.protocol_errors[("bootstrap", "reply to a gone or slow peer")]
    gone = [Decode(address, f"gone-{i}".encode()) for i in range(5)]
    for d in gone:  # a room without a hello, and a hello: each has an answer
        await d.send(KvRoom(1, [0, 1]))
        await d.send(KvHello(wire.PROTOCOL_VERSION, "gone", b"gone", KvLayout(0, PAGE_BYTES, 8,
                                                                              "SIM")))
    # Hold the event loop (the bootstrap's too) while the messages arrive and the peers leave:
    # every answer then goes to a peer that is gone (EHOSTUNREACH under ROUTER_MANDATORY).
    time.sleep(0.3)
    for d in gone:
        d.close()
    time.sleep(0.3)
    async with asyncio.timeout(10):  # until the loop has sent the answers (and counted them)
        while transport.protocol_errors[("bootstrap", "reply to a gone or slow peer")] == before:
            await asyncio.sleep(0.01)
    d = Decode(address, b"decode-ok")
    assert (await d.hello()).ok  # the loop still answers
    await d.send(KvRoom(77, [3, 4]))
    dest = await asyncio.wait_for(side.wait_room(77), 5)
    assert dest.pages == [3, 4] and dest.ident == b"decode-ok"
    d.close()


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
    _, mover, address = prefill
    d = Decode(address, b"decode-x")
    await d.send(KvHello(wire.PROTOCOL_VERSION, "x", metadata, layout))
    reply = await d.recv()
    assert isinstance(reply, KvHelloReply) and not reply.ok and reply.error
    assert mover.added == []  # the mover never saw it
    d.close()


async def test_garbage_metadata_the_mover_rejects_is_refused_not_fatal(prefill) -> None:
    _, _, address = prefill
    d = Decode(address, b"decode-y")
    reply = await d.hello(metadata=b"\xff\xfe")  # not the simulated mover's UTF-8 name
    assert not reply.ok
    assert (await d.hello()).ok  # the same peer, done right, is accepted
    d.close()


async def test_a_room_naming_pages_the_peer_lacks_is_refused(prefill) -> None:
    side, _, address = prefill
    d = Decode(address, b"decode-z")
    assert (await d.hello(num_pages=8)).ok
    for room, pages in [(1, [8]), (2, [-1]), (3, []), (4, [1, 1]), (-5, [1]),
                        (6, list(range(9)))]:
        await d.send(KvRoom(room, pages))
        done = await d.recv()
        assert isinstance(done, KvDone) and done.room == room and not done.ok, pages
    with pytest.raises(asyncio.TimeoutError):  # nothing was bound for them
        await asyncio.wait_for(asyncio.shield(side.wait_room(1)), 0.2)
    d.close()


async def test_rooms_belong_to_the_peer_that_bound_them(prefill) -> None:
    side, _, address = prefill
    a, b = Decode(address, b"decode-a"), Decode(address, b"decode-b")
    assert (await a.hello()).ok and (await b.hello()).ok
    before = transport.protocol_errors[("bootstrap", "cancel of a room the peer did not bind")]
    waiting = asyncio.create_task(side.wait_room(42))
    await a.send(KvRoom(42, [1, 2, 3]))
    await asyncio.sleep(0.1)
    await b.send(KvRoom(42, [4, 5, 6]))  # another peer's room: refused to b
    refused = await b.recv()
    assert isinstance(refused, KvDone) and refused.room == 42 and not refused.ok
    unbound = asyncio.create_task(side.wait_room(43))
    await asyncio.sleep(0)
    await b.send(KvCancel(42))  # not b's to cancel: ignored
    await b.send(KvCancel(43))  # a room nobody bound yet: ignored
    await asyncio.sleep(0.2)
    dest = await asyncio.wait_for(waiting, 5)
    assert dest.ident == b"decode-a" and dest.pages == [1, 2, 3]
    assert not unbound.done()
    after = transport.protocol_errors[("bootstrap", "cancel of a room the peer did not bind")]
    assert after - before == 2
    # The binding peer's own cancel still works.
    await a.send(KvRoom(43, [7]))
    assert (await asyncio.wait_for(unbound, 5)).pages == [7]
    third = asyncio.create_task(side.wait_room(44))
    await a.send(KvRoom(44, [8]))
    await a.send(KvCancel(44))
    await asyncio.sleep(0.1)
    if third.done():
        assert third.result().pages == [8]  # bound before the cancel arrived
    else:
        with pytest.raises(KvHandoffError):
            await asyncio.wait_for(third, 5)
    a.close()
    b.close()


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
    await asyncio.sleep(0.1)
    await side.close()
    assert crashes == ["task kv-bootstrap died"]


async def test_pages_that_come_after_their_prefill_failed_are_answered_at_once(prefill) -> None:
    side, _, address = prefill
    d = Decode(address, b"decode-late")
    assert (await d.hello()).ok
    side.fail(55, "the prefill request was aborted")  # before the decode side's pages came
    await d.send(KvRoom(55, [1, 2]))
    done = await d.recv(timeout=1.0)
    assert isinstance(done, KvDone) and done.room == 55 and not done.ok
    assert "aborted" in done.error
    d.close()


async def test_a_pass_of_rooms_is_checked_room_by_room_and_its_dones_come_in_one(prefill) -> None:
    """KvRooms (a decode worker's loop pass of rooms) binds each good room as if it came alone
    and refuses each bad one; the writes the prefill side ends in one loop pass are answered in
    one KvDones. A KvRooms past the room cap is refused whole, and counted."""
    side, _, address = prefill
    d = Decode(address, b"decode-batch")
    assert (await d.hello(num_pages=8)).ok
    await d.send(wire.KvRooms([KvRoom(61, [1, 2]), KvRoom(62, [9]), KvRoom(63, [3])]))
    refused = await d.recv()
    assert isinstance(refused, KvDone) and refused.room == 62 and not refused.ok
    a, b = await asyncio.wait_for(asyncio.gather(side.wait_room(61), side.wait_room(63)), 5)
    assert (a.pages, b.pages) == ([1, 2], [3])
    writes = [side.send(61, a, [5, 6], 11), side.send(63, b, [7], 12)]  # (in one loop pass)
    assert await asyncio.gather(*writes) == [None, None]
    dones = await d.recv()
    assert isinstance(dones, wire.KvDones)
    assert [(x.room, x.ok, x.first_token) for x in dones.items] == [(61, True, 11), (63, True, 12)]
    before = transport.protocol_errors[("bootstrap", "too many rooms in one message")]
    from tandem.kv.bootstrap.prefill import MAX_ROOMS
    await d.send(wire.KvRooms([KvRoom(100 + i, [1]) for i in range(MAX_ROOMS + 1)]))
    for _ in range(100):
        await asyncio.sleep(0.02)
        if transport.protocol_errors[("bootstrap", "too many rooms in one message")] > before:
            break
    assert transport.protocol_errors[("bootstrap", "too many rooms in one message")] == before + 1
    with pytest.raises(asyncio.TimeoutError):  # none of its rooms was bound
        await asyncio.wait_for(asyncio.shield(side.wait_room(100)), 0.2)
    d.close()


async def test_a_decode_side_whose_hello_was_forgotten_says_hello_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hellos from many outside identities make the prefill side forget an idle legitimate peer
    (it makes room for new ones); that peer's next room is refused with NO_HELLO, and the decode
    side says hello again and asks once more, so its request succeeds. (Seen before: every later
    PD request failed with "no KvHello", for as long as the prefill worker lived.)"""
    from tandem.kv.bootstrap import prefill as prefill_mod
    from tandem.kv.bootstrap.decode import DecodeSide
    from tandem.runtime.wire import Bootstrap

    monkeypatch.setattr(prefill_mod, "MAX_PEERS", 3)
    port = free_port()
    side = PrefillSide(SimulatedMover("prefill", PAGE_BYTES, 64), "127.0.0.1", port,
                       room_timeout_s=5.0, transfer_timeout_s=5.0)
    await side.start()
    decode = DecodeSide(SimulatedMover("decode", PAGE_BYTES, 64), "decode", done_timeout_s=5.0,
                        transfer_timeout_s=1.0)
    flood: list[Decode] = []
    try:
        async def one(room: int) -> int:
            fetch = asyncio.create_task(decode.fetch(Bootstrap("127.0.0.1", port, room), [2, 3],
                                                     lambda: None))
            dest = await asyncio.wait_for(side.wait_room(room), 5)
            err = await side.send(room, dest, [0, 1], first_token=40 + room)
            assert err is None
            first, _ = await asyncio.wait_for(fetch, 5)
            return first

        assert await one(1) == 41
        for i in range(6):  # outsiders' hellos push the idle legitimate peer out
            d = Decode(f"tcp://127.0.0.1:{port}", f"outsider-{i}".encode())
            flood.append(d)
            assert (await d.hello()).ok
        assert await one(2) == 42  # refused once (NO_HELLO), hello again, then served
        refused = transport.protocol_errors[("bootstrap", "room from a peer without KvHello")]
        assert refused >= 1
    finally:
        for d in flood:
            d.close()
        await decode.close()
        await side.close()
