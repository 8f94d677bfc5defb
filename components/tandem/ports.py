"""Local TCP ports for the processes a local cluster starts (tandem.launcher, the tests, perf)."""

from __future__ import annotations

import random
import socket

_GIVEN: set[int] = set()  # ports free_port handed out in this process


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, never the same twice in this process, and below
    the kernel's ephemeral range: an outgoing connection takes its local port from that range, so
    a port the OS picked there could be taken by a client before our server binds it ("Address
    already in use"). Falls back to the OS's pick."""
    lo = min(_ephemeral_low(), 65536)
    first = 20000 if lo > 21000 else 1024
    for _ in range(100):
        port = random.randrange(first, lo)
        if port in _GIVEN or port_in_use(host, port):
            continue
        _GIVEN.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _GIVEN.add(port)
    return port


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is ok
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
