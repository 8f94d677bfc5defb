"""Auth problems are never silent: a peer whose CURVE handshake with a bound socket fails (no
keys, another cluster's keys) is counted in `protocol_errors` (a worker's /metrics) and logged;
the connecting side learns why its connection dropped, and a frontend's worker link says it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from tandem.router.link import WorkerLink
from tandem.runtime import auth, transport, wire
from tandem.runtime.channel import memory_pair

MISMATCH = "handshake failed: one side has the cluster's keys, the other none"
NOT_OURS = "handshake failed: the peer ended it (it may hold other keys)"


@pytest.fixture(autouse=True)
def _no_keys_after():
    yield
    transport.use_keys(None)


def _keys(path) -> auth.ClusterKeys:  # type: ignore[no-untyped-def]
    auth.write_keys(path)
    return auth.load_keys(path)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait for a condition (each check on the next loop pass), failing at the deadline."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def _count(what: str, socket: str = "worker") -> int:
    return transport.protocol_errors[(socket, what)]


def _handshakes(socket: str = "worker") -> int:
    """Failed handshakes counted, whatever the reason ZMQ gave: for a keyless peer, which side
    sees the mechanism mismatch first is a race (the other sees only that the peer ended it)."""
    return sum(n for (s, what), n in transport.protocol_errors.items()
               if s == socket and what.startswith("handshake"))


async def test_a_bound_socket_counts_and_logs_every_refused_handshake(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    cluster, other = _keys(tmp_path / "a"), _keys(tmp_path / "b")
    addr = f"tcp://127.0.0.1:{_free_port()}"
    transport.use_keys(cluster)
    server = transport.router(addr, watch=transport.REFUSALS)  # (as a worker's: no peer missed)
    counting = asyncio.ensure_future(
        transport.count_refused_handshakes(server, "worker", logging.getLogger("test.worker")))
    wrong_key = "handshake refused: the peer's key is not the cluster's"
    before = (_handshakes(), _count(wrong_key))
    transport.use_keys(None)
    plain = transport.dealer(addr, b"plain")  # no CURVE at all
    transport.send_nowait(plain, wire.LoadQuery(1))
    # Another key pair that knows the server's public key: the ZAP handler refuses it.
    intruder = transport.context().socket(transport.zmq.DEALER, socket_class=transport.Socket)
    intruder.setsockopt(transport.zmq.LINGER, 0)
    intruder.curve_secretkey, intruder.curve_publickey = other.secret, other.public
    intruder.curve_serverkey = cluster.public
    try:
        with caplog.at_level("WARNING", logger="test.worker"):
            await _until(lambda: _handshakes() > before[0], "the plain peer counted")
            intruder.connect(addr)
            await _until(lambda: _count(wrong_key) > before[1], "the wrong key counted")
        assert any("worker socket: handshake" in r.getMessage() for r in caplog.records)
        assert not transport.readable(server)  # neither got a message through
    finally:
        counting.cancel()
        await asyncio.gather(counting, return_exceptions=True)
        transport.close(plain)
        transport.close(intruder)
        transport.close(server)


@pytest.mark.parametrize("client_keys, why", [("none", MISMATCH), ("other", NOT_OURS)])
async def test_the_connecting_side_learns_why_its_handshake_failed(
        tmp_path, client_keys: str, why: str) -> None:
    addr = f"tcp://127.0.0.1:{_free_port()}"
    transport.use_keys(_keys(tmp_path / "a"))
    server = transport.router(addr)
    transport.use_keys(None if client_keys == "none" else _keys(tmp_path / "b"))
    # As a frontend's: its monitor is on before it connects. libzmq does not reconnect after a
    # failed handshake, so that first failure is the only one there is to see.
    client = transport.dealer(addr, b"fe", watch=transport.DISCONNECTS)
    events = transport.disconnects(client)
    try:
        got = await asyncio.wait_for(events.__anext__(), 10)
        # (A keyless side may also see only that the other ended the handshake, when the other
        # noticed the mismatch first: a race. Either way it is named a failed handshake.)
        assert got == why or (client_keys == "none" and got.startswith("handshake failed")), got
    finally:
        transport.close(client)
        await events.aclose()
        transport.close(server)


def test_a_worker_link_says_at_once_when_the_keys_differ(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    frontend_end, _ = memory_pair()
    link = WorkerLink("tcp://127.0.0.1:7100", "fe", frontend_end, clock=lambda: now[0],
                      heartbeat_deadline_s=3.0, start_timeout_s=5.0)
    with caplog.at_level("WARNING", logger="tandem.router"):
        for _ in range(3):  # every reconnect fails the same way: said once
            link.tick()
            link.on_disconnected(MISMATCH)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and MISMATCH in said[0] and "--auth-keys" in said[0], said
        for _ in range(12):
            now[0] += 0.5
            link.tick()
    unreachable = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1 and MISMATCH in unreachable[0], unreachable
    assert "--auth-keys" in unreachable[0]
    link.on_message(wire.HelloReply(wire.PROTOCOL_VERSION, True, wire.WorkerInfo(
        "w", "agg", "mock", "m", 16, 64, 2048)))
    assert link.state == "up" and link.security_error == ""  # answered: the keys match now
