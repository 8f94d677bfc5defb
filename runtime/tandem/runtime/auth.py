"""Authentication between tandem processes: ZMQ CURVE with one cluster key pair.

Every process of a cluster (frontends, prefill and decode workers) holds the same CURVE key pair,
read from a directory (`tandem keys init DIR` writes it; on Kubernetes, a Secret mounted as that
directory): `cluster.key` (public) and `cluster.key_secret` (public and secret). Every bound socket
is a CURVE server with that key pair and admits only clients that present the cluster's public key
(a ZAP handler checks it), and every connecting socket is a CURVE client with the same pair. A peer
without the secret cannot complete the handshake: it can send nothing and learns nothing, and the
traffic it could observe is encrypted.

A process started by hand finds its keys (`resolve_keys_dir`): `--auth-keys DIR`, or the
default directory `tandem keys init` writes without one; with neither it refuses to start unless
`--no-auth` says, by name, that it runs keyless. Binding beyond loopback without keys is refused
(`require_for`): a worker port reachable from a
network must never accept unauthenticated peers. A handshake that fails is never silent: the bound
side counts and logs it, the connecting side says why its connection dropped
(`handshake_failure`, read from ZMQ socket monitor events by tandem.runtime.transport).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("tandem.auth")

KEY_NAME = "cluster"
_ZAP_DOMAIN = "tandem"


class AuthError(Exception):
    """Keys missing, unreadable or malformed, or an unauthenticated bind beyond loopback."""


@dataclass(frozen=True)
class ClusterKeys:
    public: bytes
    secret: bytes


def write_keys(directory: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write a new cluster key pair into `directory`; returns the secret file's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    secret_file = d / f"{KEY_NAME}.key_secret"
    if secret_file.exists() and not force:
        raise AuthError(f"{secret_file} exists (use --force to replace the cluster's keys)")
    for f in (d / f"{KEY_NAME}.key", secret_file):
        f.unlink(missing_ok=True)
    public_file, secret_path = zmq.auth.create_certificates(str(d), KEY_NAME)
    os.chmod(secret_path, 0o600)
    return Path(secret_path)


def load_keys(directory: str | os.PathLike[str]) -> ClusterKeys:
    secret_file = Path(directory) / f"{KEY_NAME}.key_secret"
    if not secret_file.is_file():
        raise AuthError(f"no cluster key at {secret_file} (write one with `tandem keys init DIR`)")
    try:
        public, secret = zmq.auth.load_certificate(str(secret_file))
    except Exception as e:  # pyzmq raises ValueError/OSError on malformed files
        raise AuthError(f"cannot read the cluster key {secret_file}: {e}") from None
    if not public or not secret:
        raise AuthError(f"{secret_file} holds no secret key")
    mode = secret_file.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("the cluster's secret key %s can be read by other users (mode %o): anyone "
                    "who reads it can join the cluster; `chmod 600` it", secret_file, mode)
    return ClusterKeys(public, secret)


def digest_key(directory: str) -> bytes:
    """The key of the digests a frontend makes of identities (tenants, cache partitions:
    tandem.frontend.tenants and tandem.frontend.salt), derived from the cluster's secret key in
    `directory` ("": none, b""). The digests travel to workers, their KV events and metrics; keyed,
    nobody without the cluster's secret can test a guessed value (a low-entropy user name)
    against one. Every frontend of a cluster derives the same key, so their digests agree."""
    if not directory:
        return b""
    return hashlib.blake2b(load_keys(directory).secret, digest_size=32,
                           person=b"tandem digests").digest()


def default_keys_dir() -> Path:
    """Where `tandem keys init` writes when given no directory, and where a process started
    without --auth-keys or --no-auth looks: $XDG_CONFIG_HOME/tandem/keys (~/.config/...)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tandem" / "keys"


def resolve_keys_dir(given: str, no_auth: bool) -> str:
    """The key directory a `tandem worker` or `tandem frontend` uses ("" = none): --auth-keys
    DIR; none with --no-auth, said by name; else the default directory when `tandem keys init`
    wrote a key pair there. AuthError, saying how to give keys, otherwise."""
    if given and no_auth:
        raise AuthError("--no-auth and --auth-keys: choose one")
    if given or no_auth:
        return given
    d = default_keys_dir()
    if (d / f"{KEY_NAME}.key_secret").exists():
        load_keys(d)  # (a broken key pair is an error now, not at the first socket)
        return str(d)
    raise AuthError(
        f"no cluster keys: pass --auth-keys DIR (the directory `tandem keys init DIR` wrote, the "
        f"same for every process of the cluster), or run `tandem keys init` once to write "
        f"{d}, which tandem processes on this machine then find, or pass --no-auth to run "
        "without authentication (loopback only: any local process may then talk to this one)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(address: str) -> str:
    """`tcp://HOST:PORT` -> HOST (brackets of an IPv6 literal removed)."""
    rest = address.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")


def require_for(bind_address: str, keys: ClusterKeys | None) -> None:
    """Refuse to bind beyond loopback without keys."""
    if keys is None and not is_loopback(host_of(bind_address)):
        raise AuthError(
            f"refusing to bind {bind_address} without authentication: pass --auth-keys DIR "
            "(write the keys once with `tandem keys init DIR` and give every process of the "
            "cluster the same directory), or bind a loopback address")


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL |
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # the socket monitor events of a failure


def handshake_failure(event: int, value: int) -> str:
    """Why a security handshake failed, from a socket monitor's event and value: short (the bound
    side counts by it) and naming the likely cause (the connecting side logs it)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "handshake refused: the peer's key is not the cluster's"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "handshake failed: one side has the cluster's keys, the other none"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "handshake failed: the two sides hold different key pairs"
        return "handshake failed: a protocol error"
    return "handshake failed: the peer ended it (it may hold other keys)"


_authenticators: dict[int, ThreadAuthenticator] = {}
_lock = threading.Lock()


def _ensure_authenticator(ctx: zmq.Context, keys: ClusterKeys) -> None:
    """One ZAP handler per context, admitting only the cluster's public key."""
    with _lock:
        auth = _authenticators.get(id(ctx))
        if auth is not None and auth.is_alive():
            return
        # The handler thread needs a blocking context: a shadow shares the same ZMQ context
        # (ZAP requests travel over its inproc endpoint) whatever flavour `ctx` is.
        sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        auth = ThreadAuthenticator(sync_ctx, log=logging.getLogger("tandem.auth.zap"))
        auth.start()
        auth.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=_OnlyKey(keys.public))
        _authenticators[id(ctx)] = auth


def stop_authenticators() -> None:
    with _lock:
        for auth in _authenticators.values():
            auth.stop()
        _authenticators.clear()


class _OnlyKey:
    def __init__(self, public: bytes) -> None:
        self._z85 = public
        self._raw = zmq.utils.z85.decode(public)

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._raw or key == self._z85


def make_server(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Before bind: this socket accepts only peers holding the cluster key."""
    _ensure_authenticator(sock.context, keys)
    sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN.encode())
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """Before connect: present the cluster key and expect a server holding it."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public
