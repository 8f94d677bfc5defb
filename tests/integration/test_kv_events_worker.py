"""A worker process's KV events: with events on (the default) its handshake tells the frontend
where they are published and replayed (`/workers` shows it), both sockets answer there, and its
/metrics counts the replay it served; with `--no-kv-events` it advertises none."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import zmq
import zmq.asyncio

from tandem.runtime.kv_events import decode_replay, replay_request
from tests.cluster import Cluster, free_port
from tests.metrics_text import value


async def test_the_handshake_advertises_the_event_sockets(tiny_model: str, tmp_path: Path) -> None:
    c = Cluster(tiny_model, str(tmp_path))
    health = free_port()
    on = c.add_worker("mock", ["--health-port", str(health)])
    off = c.add_worker("mock", ["--no-kv-events"])
    try:
        c.start_frontend()
        rows = {w["address"]: w for w in c.worker_states()}
        assert rows[off.address]["kv_events_addr"] == rows[off.address]["kv_replay_addr"] == ""
        events, replay = rows[on.address]["kv_events_addr"], rows[on.address]["kv_replay_addr"]
        assert events.startswith("tcp://127.0.0.1:") and replay.startswith("tcp://127.0.0.1:")
        assert len({events, replay, on.address}) == 3
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(events)
            dealer.connect(replay)
            await dealer.send_multipart(replay_request(0))
            async with asyncio.timeout(10):  # whatever it published so far, then the end
                while decode_replay(await dealer.recv_multipart()) is not None:
                    pass
        finally:
            sub.close(0)
            dealer.close(0)
            ctx.term()
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert value(metrics, "tandem_worker_kv_event_replay_requests_total") == 1
    finally:
        c.stop()
