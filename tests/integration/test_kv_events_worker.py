"""A worker process's KV events end to end: with events on (the default) its handshake tells the
frontend where they are published and replayed (`/workers` shows it); after a request, the replay
socket gives back BlockStored events holding the prompt's full pages, parent-linked, in the
format's frames; its /metrics counts what it published and replayed. With `--no-kv-events` (or
`--no-prefix-cache`) a worker advertises none."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from tandem.runtime.kv_events import BlockStored, KvEvent, decode_replay, replay_request
from tests.cluster import Cluster, free_port
from tests.metrics_text import value

PAGE = 16
PROMPT = [10 + (i * 7) % 200 for i in range(2 * PAGE + 5)]  # two full pages and a part


def complete(url: str, model: str) -> Any:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


async def replayed(addr: str) -> list[KvEvent]:
    """Every event the worker still buffers, from its replay socket, in order."""
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(addr)
        await dealer.send_multipart(replay_request(0))
        events: list[KvEvent] = []
        seqs = []
        async with asyncio.timeout(10):
            while (item := decode_replay(await dealer.recv_multipart())) is not None:
                seqs.append(item.seq)
                events += item.batch.events
        assert seqs == list(range(len(seqs)))
        return events
    finally:
        dealer.close(0)
        ctx.term()


async def test_a_worker_publishes_its_cached_pages_where_its_handshake_says(
        tiny_model: str, tmp_path: Path) -> None:
    c = Cluster(tiny_model, str(tmp_path))
    health = free_port()
    on = c.add_worker("mock", ["--health-port", str(health), "--page-size", str(PAGE)])
    off = c.add_worker("mock", ["--no-kv-events"])
    no_cache = c.add_worker("mock", ["--no-prefix-cache"])
    try:
        c.start_frontend(["--router-policy", "round-robin"])  # (so each worker gets one)
        rows = {w["address"]: w for w in c.worker_states()}
        for w in (off, no_cache):
            assert rows[w.address]["kv_events_addr"] == rows[w.address]["kv_replay_addr"] == ""
        events, replay = rows[on.address]["kv_events_addr"], rows[on.address]["kv_replay_addr"]
        assert events.startswith("tcp://127.0.0.1:") and replay.startswith("tcp://127.0.0.1:")
        assert len({events, replay, on.address}) == 3
        assert await replayed(replay) == []  # nothing cached yet: only the end marker
        model = c.get_json("/v1/models")["data"][0]["id"]
        for _ in c.workers:
            complete(c.url, model)
        assert {w["address"]: w["placed"] for w in c.worker_states()}[on.address] == 1
        stored = [e for e in await replayed(replay) if isinstance(e, BlockStored)]
        assert stored and stored[0].parent_block_hash is None
        tokens, parent = [], None
        for e in stored:  # a chain: each run links to the last block of the one before
            assert e.block_size == PAGE and len(e.token_ids) == PAGE * len(e.block_hashes)
            assert e.parent_block_hash == parent
            tokens += e.token_ids
            parent = e.block_hashes[-1]
        assert tokens[:2 * PAGE] == PROMPT[:2 * PAGE]
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert value(metrics, "tandem_worker_kv_event_replay_requests_total") == 2
        assert value(metrics, "tandem_worker_kv_event_batches_published_total") >= 1
        c.assert_idle()
    finally:
        c.stop()
