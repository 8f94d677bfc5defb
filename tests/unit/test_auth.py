"""CURVE authentication between tandem sockets: only holders of the cluster key get through."""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq

from tandem.runtime import auth, transport, wire


@pytest.fixture
def keys_dir(tmp_path):
    auth.write_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture(autouse=True)
def _no_keys_after():
    yield
    transport.use_keys(None)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _roundtrip(server: transport.Socket, client: transport.Socket,
                     timeout: float = 1.5) -> wire.ToWorker | None:
    transport.send_nowait(client, wire.LoadQuery(7))
    messages = transport.router_messages(server, wire.TO_WORKER, logging.getLogger("test"))
    try:
        async with asyncio.timeout(timeout):
            async for _, msg in messages:
                return msg
    except TimeoutError:
        return None
    finally:
        await messages.aclose()
    raise AssertionError("unreachable: the messages never end")


async def test_cluster_key_holders_talk(keys_dir):
    keys = auth.load_keys(keys_dir)
    transport.use_keys(keys)
    addr = f"tcp://127.0.0.1:{_free_port()}"
    server = transport.router(addr)
    client = transport.dealer(addr, b"fe")
    try:
        assert await _roundtrip(server, client) == wire.LoadQuery(7)
    finally:
        client.close(0)
        server.close(0)


async def test_plain_peer_gets_nothing_through(keys_dir):
    transport.use_keys(auth.load_keys(keys_dir))
    addr = f"tcp://127.0.0.1:{_free_port()}"
    server = transport.router(addr)
    transport.use_keys(None)
    client = transport.dealer(addr, b"intruder")  # no CURVE at all
    try:
        assert await _roundtrip(server, client) is None
    finally:
        client.close(0)
        server.close(0)


async def test_wrong_key_gets_nothing_through(keys_dir, tmp_path):
    good = auth.load_keys(keys_dir)
    auth.write_keys(tmp_path / "other")
    other = auth.load_keys(tmp_path / "other")
    addr = f"tcp://127.0.0.1:{_free_port()}"
    transport.use_keys(good)
    server = transport.router(addr)
    # A client that knows the server's PUBLIC key but holds another key pair: the handshake
    # succeeds cryptographically, and the ZAP handler must still refuse it.
    ctx = transport.context()
    client = ctx.socket(zmq.DEALER, socket_class=transport.Socket)
    client.setsockopt(zmq.LINGER, 0)
    client.curve_secretkey = other.secret
    client.curve_publickey = other.public
    client.curve_serverkey = good.public
    client.connect(addr)
    try:
        assert await _roundtrip(server, client) is None
    finally:
        client.close(0)
        server.close(0)


def test_binding_beyond_loopback_needs_keys():
    transport.use_keys(None)
    with pytest.raises(auth.AuthError, match="--auth-keys"):
        transport.router("tcp://0.0.0.0:0")
    auth.require_for("tcp://127.0.0.1:5555", None)  # loopback is fine
    auth.require_for("tcp://localhost:5555", None)


def test_keys_on_disk(tmp_path):
    with pytest.raises(auth.AuthError, match="tandem keys init"):
        auth.load_keys(tmp_path / "none")
    secret = auth.write_keys(tmp_path / "k")
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(auth.AuthError, match="exists"):
        auth.write_keys(tmp_path / "k")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "cluster.key_secret").write_text("garbage\n")
    with pytest.raises(auth.AuthError):
        auth.load_keys(tmp_path / "bad")


def test_a_secret_key_others_can_read_is_used_with_a_warning(tmp_path, caplog) -> None:
    secret = auth.write_keys(tmp_path)
    with caplog.at_level("WARNING", logger="tandem.auth"):
        auth.load_keys(tmp_path)
    assert not caplog.records  # written 0600: no warning
    secret.chmod(0o644)
    with caplog.at_level("WARNING", logger="tandem.auth"):
        auth.load_keys(tmp_path)
    assert any("can be read by other users" in r.getMessage() for r in caplog.records)
