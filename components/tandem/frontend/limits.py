"""HTTP limits: no client holds a descriptor or a buffer forever, and what all clients together
make the server hold is bounded.

uvicorn closes a connection that stays idle after a response (`timeout_keep_alive`), but not one
that never completes its request head: a client that connects and sends nothing, or trickles its
headers, would keep its descriptor for good, and 20,000 of them exhaust the process's. tandem's
uvicorn protocol (tandem.frontend.uvicorn_protocol) enforces, with the values of `HttpLimits`:

- a connection cap (`max_connections`): a connection past it gets a 503 with an OpenAI error body
  and is closed at once, so descriptors stay bounded whatever clients do;
- a cap per client address (`per_client`): one client's connections past it get the same, so
  one client cannot take every connection and lock the others out;
- a header deadline (`header_timeout_s`) from the connection's start, or from the first byte of
  each later request on it, to the end of the request head: past it, 408 and close;
- a cap on the request head's size (`max_header_bytes`): past it, 431 and close.

The body has its own deadline and size cap, checked where it is read (tandem.frontend.http
`read_body`: 408 and 413), on every server, and so has the server's budget of body bytes being
received (`BodyBudget`: 503 with Retry-After). `raise_fd_limit` lifts the soft descriptor limit
toward the hard one so the cap, not the kernel, is what refuses connections.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

import msgspec

from tandem.config import FrontendConfig

log = logging.getLogger("tandem.frontend")
FD_RESERVE = 1024  # descriptors kept for worker sockets, logs and the rest


MAX_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The limits of one server: `of(config)` makes them from the frontend's flags. (A body's
    deadline is the app's: it reads `http_body_timeout_s` itself, tandem.frontend.app.)"""

    max_connections: int
    header_timeout_s: float
    idle_timeout_s: float  # keep-alive: idle between requests
    max_header_bytes: int = MAX_HEADER_BYTES
    max_connections_per_client: int = 0  # 0: half of max_connections

    @classmethod
    def of(cls, config: FrontendConfig) -> HttpLimits:
        return cls(config.max_connections, config.http_header_timeout_s,
                   config.http_idle_timeout_s, max_connections_per_client=config.max_connections_per_client)

    @property
    def per_client(self) -> int:
        """The most connections one client address may hold."""
        return self.max_connections_per_client or max(1, self.max_connections // 2)


class BodyBudget:
    """The bytes of request bodies being received, over every connection of one server: a body
    takes its bytes as they arrive (`take`, False when they would pass `limit`: nothing taken)
    and gives them all back when it ends, however it ends (`give`)."""

    __slots__ = ("limit", "in_flight")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    @property
    def free(self) -> int:
        return self.limit - self.in_flight

    def take(self, n: int) -> bool:
        if self.in_flight + n > self.limit:
            return False
        self.in_flight += n
        return True

    def give(self, n: int) -> None:
        self.in_flight -= n


def _reply(status: int, reason: str, message: str, type_: str) -> bytes:
    body = msgspec.json.encode({"error": {"message": message, "type": type_, "param": None,
                                          "code": None}})
    retry = "retry-after: 1\r\n" if status == 503 else ""
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{retry}connection: close\r\n\r\n").encode() + body


BUSY = _reply(503, "Service Unavailable", "Too many open connections.", "service_unavailable")
CROWDED = _reply(503, "Service Unavailable", "Too many open connections from this client.",
                 "service_unavailable")
SLOW = _reply(408, "Request Timeout", "The request head did not arrive in time.",
              "invalid_request_error")
BIG = _reply(431, "Request Header Fields Too Large", "The request head is too large.",
             "invalid_request_error")
BAD = _reply(400, "Bad Request", "Invalid HTTP request received.", "invalid_request_error")


def raise_fd_limit(wanted: int) -> int:
    """Lift the soft RLIMIT_NOFILE toward `wanted` + FD_RESERVE (at most the hard limit); return
    how many connections the limit leaves room for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    room = wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - FD_RESERVE))
    if room < wanted:
        log.warning("open-file limit %d leaves room for %d HTTP connections, not %d", soft, room,
                    wanted)
    return room
