"""What /workers and /metrics show of each worker of a WorkerPool (tandem.router.pool): its
handshake, state and load, what the router placed on it, and its KV index (tandem.router.kv_feed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from typing import Any

from tandem.router.kv_feed import KvFeeds
from tandem.router.link import WorkerLink
from tandem.runtime.metrics import Registry

__all__ = ["register_metrics", "snapshot"]


async def snapshot(links: Sequence[WorkerLink], leaving: Collection[str], placed: dict[str, int],
                   kv_feeds: KvFeeds | None) -> list[dict[str, Any]]:
    """/workers: each worker's handshake, state, load (queried now) and routing counters."""
    loads = await asyncio.gather(*(w.query_load() for w in links))
    out = []
    for w, load in zip(links, loads):
        info = w.info
        out.append({
            "name": info.name if info else "",
            "role": info.role if info else "",
            "engine": info.engine if info else "",
            "address": w.address,
            "kv_events_addr": info.kv_events_addr if info else "",
            "kv_replay_addr": info.kv_replay_addr if info else "",
            "state": "leaving" if w.address in leaving else w.state,
            "draining": bool(getattr(load, "draining", False)),
            "placed": placed.get(w.address, 0),
            "in_flight": w.num_in_flight,
            "failed_in_a_row": w.streak.count,
            "pending_prefill_tokens": w.pending_prefill_tokens,
            "active_decode_tokens": w.active_decode_tokens,
            "running": load.running,
            "waiting": load.waiting,
            "pages_free": load.pages_free,
            "pages_total": load.pages_total,
            "pages_reserved": load.pages_reserved,
            "pages_cached": load.pages_cached,  # (of pages_free)
            "prefix_cache_queries": load.cache_queries,
            "prefix_cache_hits": load.cache_hits,
            "host_pages_total": load.host_pages_total,
            "host_pages_cached": load.host_pages_cached,
            "prefix_cache_host_hits": load.host_hits,  # (of prefix_cache_hits)
            "host_load_s_per_page": load.host_load_s_per_page,
            "prefill_s_per_token": load.prefill_s_per_token,
            **(kv_feeds.row(w.address) if kv_feeds is not None else {}),
        })
    return out


def register_metrics(r: Registry, links: list[WorkerLink], placed: dict[str, int]) -> None:
    """Per-worker metrics, read at scrape time from `links` and `placed` (the pool's own, which
    change as workers come and go)."""

    def per_worker(get: Callable[[WorkerLink], float]) -> Callable[[], list[Any]]:
        return lambda: [((w.address,), get(w)) for w in links]

    r.callback("tandem_worker_placed_requests_total", "Requests placed on the worker.",
               lambda: [((a,), n) for a, n in placed.items()], ("worker",),
               kind="counter")
    for name, help_, get in (
        ("tandem_worker_up", "Whether the worker is usable (1) or not (0).",
         lambda w: int(w.usable)),
        ("tandem_worker_in_flight_requests", "Requests in flight on the worker.",
         lambda w: w.num_in_flight),
        ("tandem_worker_pending_prefill_tokens",
         "Prompt tokens sent to the worker whose first delta has not come back.",
         lambda w: w.pending_prefill_tokens),
        ("tandem_worker_active_decode_tokens",
         "Prompt and generated tokens of the requests decoding on the worker.",
         lambda w: w.active_decode_tokens),
        ("tandem_worker_running_requests", "Requests running on the worker (last report).",
         lambda w: w.load.running),
        ("tandem_worker_pages_free", "KV pages free on the worker (last report).",
         lambda w: w.load.pages_free),
        ("tandem_worker_pages_total", "KV pages on the worker.", lambda w: w.load.pages_total),
        ("tandem_worker_waiting_requests", "Requests waiting on the worker (last report).",
         lambda w: w.load.waiting),
        ("tandem_worker_prefix_cache_hits", "Prompt tokens the worker found in its "
         "prefix cache (last report).", lambda w: w.load.cache_hits),
        ("tandem_worker_prefix_cache_queries", "Prompt tokens the worker looked up in "
         "its prefix cache (last report).", lambda w: w.load.cache_queries),
    ):
        r.callback(name, help_, per_worker(get), ("worker",))
    r.callback("tandem_delta_protocol_errors_total", "Deltas refused for a gap or an overlap.",
               per_worker(lambda w: w.protocol_errors), ("worker",), kind="counter")
