"""HTTP connection limits: no client holds a descriptor or a buffer forever.

uvicorn closes a connection that stays idle after a response (`timeout_keep_alive`), but not one
that never completes its request head: a client that connects and sends nothing, or trickles its
headers, would keep its descriptor for good, and 20,000 of them exhaust the process's. tandem's
uvicorn protocol (tandem.frontend.uvicorn_protocol) enforces, with the values here:

- a connection cap (`max_connections`): a connection past it gets a 503 with an OpenAI error body
  and is closed at once, so descriptors stay bounded whatever clients do;
- a header deadline (`header_timeout_s`) from the connection's start, or from the first byte of
  each later request on it, to the end of the request head: past it, 408 and close;
- a cap on the request head's size (`max_header_bytes`): past it, 431 and close.

The body has its own deadline and size cap, checked where it is read (tandem.frontend.http
`read_body`: 408 and 413). `raise_fd_limit` lifts the soft descriptor limit toward the hard one so
the cap, not the kernel, is what refuses connections.
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
    """The limits of one server: `of(config)` makes them from the frontend's flags."""

    max_connections: int
    header_timeout_s: float
    idle_timeout_s: float  # keep-alive: idle between requests
    body_timeout_s: float
    max_header_bytes: int = MAX_HEADER_BYTES

    @classmethod
    def of(cls, config: FrontendConfig) -> HttpLimits:
        return cls(config.max_connections, config.http_header_timeout_s,
                   config.http_idle_timeout_s, config.http_body_timeout_s)


def _reply(status: int, reason: str, message: str, type_: str) -> bytes:
    body = msgspec.json.encode({"error": {"message": message, "type": type_, "param": None,
                                          "code": None}})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


BUSY = _reply(503, "Service Unavailable", "Too many open connections.", "service_unavailable")
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
