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
- `tandem_worker_requests_in_flight` and `tandem_worker_draining`;
- the engine's prefix cache, from its `load()` (vLLM's names): `tandem_prefix_cache_queries_total`
  (prompt tokens looked up at admission), `tandem_prefix_cache_hits_total` (of those, found
  cached), `tandem_kv_pages_cached` (cached pages nobody holds), `tandem_kv_pages_free`; with a
  host tier, `tandem_prefix_cache_host_hits_total` (of the hits, loaded from it),
  `tandem_kv_host_pages_cached`, and the costs a router weighs it by,
  `tandem_kv_host_load_seconds_per_page` and `tandem_prefill_seconds_per_token`;
- with KV events on (tandem.worker.kv_events): `tandem_worker_kv_events_published_total` (events in
  the batches the PUB socket took), `tandem_worker_kv_event_batches_published_total`,
  `tandem_worker_kv_event_batches_dropped_total` (not encodable, or the socket closed),
  `tandem_worker_kv_event_replay_requests_total`, `tandem_worker_kv_event_replays_refused_total`
  (past a peer's queue or the peers answered at once) and
  `tandem_worker_kv_event_batches_replayed_total`; their handshake failures and bad replay
  requests count in the protocol errors (sockets "kv-events", "kv-replay").
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.runtime import transport
from tandem.runtime.metrics import Registry, Samples
from tandem.runtime.wire import Load
from tandem.worker.kv_events import KvEventCounts

_KV_EVENT_COUNTERS = (
    ("tandem_worker_kv_events_published_total", "events_published",
     "KV events in the batches the PUB socket took"),
    ("tandem_worker_kv_event_batches_published_total", "batches_published",
     "KV event batches the PUB socket took"),
    ("tandem_worker_kv_event_batches_dropped_total", "batches_dropped",
     "KV event batches not published (not encodable, or the socket was closed)"),
    ("tandem_worker_kv_event_replay_requests_total", "replay_requests",
     "KV event replay requests received"),
    ("tandem_worker_kv_event_replays_refused_total", "replay_refused",
     "KV event replay requests refused (the peer's queue, or the peers answered at once, full)"),
    ("tandem_worker_kv_event_batches_replayed_total", "batches_replayed",
     "KV event batches sent in answer to replay requests"),
)


def worker_registry(num_requests: Callable[[], int], draining: Callable[[], bool],
                    load: Callable[[], Load | None] = lambda: None,
                    kv_events: Callable[[], KvEventCounts | None] = lambda: None) -> Registry:
    """`load`: the engine's last load (None before it serves); `kv_events`: the publisher's
    counts (None when there is none). No series while either is None."""
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

    def of(field: str) -> Callable[[], Samples]:
        def read() -> Samples:
            now = load()
            return [] if now is None else [((), getattr(now, field))]

        return read

    reg.callback("tandem_prefix_cache_queries_total", "Prompt tokens looked up in the prefix "
                 "cache at admission", of("cache_queries"), kind="counter")
    reg.callback("tandem_prefix_cache_hits_total", "Prompt tokens found in the prefix cache "
                 "(not computed)", of("cache_hits"), kind="counter")
    reg.callback("tandem_kv_pages_cached", "Cached KV pages no request holds (evictable)",
                 of("pages_cached"))
    reg.callback("tandem_kv_pages_free", "KV pages a new request can get (free or cached, less "
                 "those promised to running requests)", of("pages_free"))
    reg.callback("tandem_prefix_cache_host_hits_total", "Of the prefix cache hits, prompt tokens "
                 "loaded from the host tier", of("host_hits"), kind="counter")
    reg.callback("tandem_kv_host_pages_cached", "Pages cached in the host tier",
                 of("host_pages_cached"))
    reg.callback("tandem_kv_host_load_seconds_per_page", "Measured seconds to load one page "
                 "back from the host tier (moving average)", of("host_load_s_per_page"))
    reg.callback("tandem_prefill_seconds_per_token", "Measured prefill seconds per token (moving "
                 "average; with a host tier)", of("prefill_s_per_token"))

    def count(field: str) -> Callable[[], Samples]:
        def read() -> Samples:
            counts = kv_events()
            return [] if counts is None else [((), getattr(counts, field))]
        return read

    for name, field, help in _KV_EVENT_COUNTERS:
        reg.callback(name, help, count(field), kind="counter")
    return reg
