"""A worker's `/metrics` (served on its health port, tandem.worker.health): what it refused.

Rendered through tandem.runtime.metrics.Registry from state that already exists, read at scrape
time (nothing is mirrored on the hot path):

- `tandem_worker_bad_messages_total{socket}`: frames dropped because they did not decode
  (`transport.bad_messages`; socket "worker" for frontends' messages, "bootstrap" for a prefill
  worker's KV bootstrap socket);
- `tandem_worker_protocol_errors_total{socket,error}`: messages that decoded but were refused or
  could not be answered (`transport.protocol_errors`: bad requests, foreign aborts, bad credit,
  refused KV hellos and rooms, replies to gone peers, ...), and peers whose security handshake
  failed (`handshake refused: ...`, `handshake failed: ...`: no keys, or another cluster's);
- `tandem_worker_requests_in_flight` and `tandem_worker_draining`.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.runtime import transport
from tandem.runtime.metrics import Registry, Samples


def worker_registry(num_requests: Callable[[], int], draining: Callable[[], bool]) -> Registry:
    reg = Registry()

    def bad() -> Samples:
        return [((socket,), n) for socket, n in sorted(transport.bad_messages.items())]

    def refused() -> Samples:
        errors = sorted(transport.protocol_errors.items())
        return [((socket, what), n) for (socket, what), n in errors]

    reg.callback("tandem_worker_bad_messages_total", "Frames dropped because they did not decode",
                 bad, ("socket",), kind="counter")
    reg.callback("tandem_worker_protocol_errors_total",
                 "Messages that decoded but were refused or could not be answered, and peers "
                 "whose security handshake failed", refused,
                 ("socket", "error"), kind="counter")
    reg.callback("tandem_worker_requests_in_flight", "Requests submitted and not ended",
                 lambda: [((), num_requests())])
    reg.callback("tandem_worker_draining", "1 while the worker takes no new work",
                 lambda: [((), int(draining()))])
    return reg
