"""A flood of KV event replay requests against a running worker (issue 38, N1), end to end.

The attack found on b182143: on a keyless cluster, 50 replay requests of nine bytes each
(`[b"", start_seq 0]`) from peers that never read made the worker send up to 10,000 buffered
batches per request on its event loop; the frontend declared the worker down, 4 of 4 other streams
failed, and the worker's RSS went from 43 MB to 1.1 GB.

Here: a keyless one-worker cluster (mock engine, prefix cache and KV events on, a decode step of
`--step-ms`) on loopback. Its replay buffer is filled first (`--fill` short requests of unique
prompts: one or more event batches each). Then, while `--streams` streamed requests of
`--max-tokens` run through the frontend, `--peers` DEALER sockets that never read (receive
high-water mark 1) each send `--asks` replay requests from seq 0. The worker's RSS is sampled every
half second from before the flood until the streams end; its replay counters are read from its
/metrics. Reported: whether every stream completed whole, the RSS before, at its peak and at the
end, and the counters. With `TANDEM_SERVER_PYTHONPATH` the servers of another checkout run instead
(perf.common.launch).

    python -m perf.prefix.kv_replay_flood --out perf/results/kv_replay_flood
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import urllib.request

import httpx
import psutil
import zmq

from perf.common.launch import launch
from perf.prefix.prefix_arms import get_text, metric_sums


async def _stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> dict[str, object]:
    body = {"prompt": [5 + i, 6, 7, 8], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens, finish, error = 0, None, ""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "tokens": 0, "error": (await r.aread()).decode()}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"].get("message", "")
                for c in chunk.get("choices", ()):
                    finish = c.get("finish_reason") or finish
                if chunk.get("usage"):  # (chunks merge tokens when the reader lags: count these)
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return {"status": 200, "tokens": tokens, "finish": finish, "error": error}


async def _fill(client: httpx.AsyncClient, n: int) -> None:
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        async with sem:
            body = {"prompt": [(i * 7919 + j * 31) % 900 + 10 for j in range(32)],
                    "max_tokens": 1}
            (await client.post("/v1/completions", json=body)).raise_for_status()
    await asyncio.gather(*(one(i) for i in range(n)))


def _flood(address: str, peers: int, asks: int) -> list[zmq.Socket]:
    ctx = zmq.Context.instance()
    socks = []
    for p in range(peers):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, f"flood-{p}".encode())
        s.connect(address)
        for _ in range(asks):
            s.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])  # 9 bytes: seq 0
        socks.append(s)
    return socks


async def run(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        from tandem.engines.reference.checkpoint import write_tiny_model

        model = os.path.join(tmp, "model")
        write_tiny_model(model, seed=0)
        c = launch("agg", model, os.path.join(tmp, "logs"),
                   ["--max-batch", "4", "--num-pages", "4096", "--page-size", "16",
                    "--mock-decode-step-us", str(int(args.step_ms * 1000))],
                   [], health_base_port=0)
        socks: list[zmq.Socket] = []
        try:
            worker = psutil.Process(c.procs["agg"].pid)
            with urllib.request.urlopen(c.url + "/workers", timeout=10) as r:
                replay_addr = json.loads(r.read())["workers"][0]["kv_replay_addr"]
            health = c.cluster.plan.workers[0].http_url  # (its /metrics)
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(base_url=c.url, timeout=120.0, limits=limits) as client:
                t0 = time.monotonic()
                await _fill(client, args.fill)
                fill_s = time.monotonic() - t0
                rss_before = worker.memory_info().rss / 2**20
                streams = [asyncio.create_task(_stream(client, i, args.max_tokens))
                           for i in range(args.streams)]
                await asyncio.sleep(0.2)  # (the streams are running)
                socks = _flood(replay_addr, args.peers, args.asks)
                samples = [(0.0, rss_before)]
                t1 = time.monotonic()
                while not all(s.done() for s in streams):
                    await asyncio.sleep(0.5)
                    samples.append((round(time.monotonic() - t1, 1),
                                    worker.memory_info().rss / 2**20))
                results = [s.result() for s in streams]
            counters: dict[str, float | None] = {}
            if health:
                names = ("tandem_worker_kv_event_batches_published_total",
                         "tandem_worker_kv_event_replay_requests_total",
                         "tandem_worker_kv_event_replays_refused_total",
                         "tandem_worker_kv_event_batches_replayed_total")
                sums = metric_sums(get_text(health + "/metrics", 10), names)
                counters = {name: sums.get(name) for name in names}
            alive = worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
        finally:
            for s in socks:
                s.close()
            c.stop()
    whole = sum(1 for r in results if r.get("finish") == "length"
                and r["tokens"] == args.max_tokens and not r.get("error"))
    return {
        "server": os.environ.get("TANDEM_SERVER_PYTHONPATH", "this tree"),
        "args": vars(args), "fill_s": round(fill_s, 1), "worker_alive": alive,
        "streams_whole": whole, "streams": results,
        "rss_mb": {"before": round(rss_before, 1), "peak": round(max(m for _, m in samples), 1),
                   "end": round(samples[-1][1], 1)},
        "rss_samples": [(t, round(m, 1)) for t, m in samples], "counters": counters,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fill", type=int, default=3000, help="requests that fill the replay buffer")
    ap.add_argument("--peers", type=int, default=50, help="flooding peers (DEALER sockets)")
    ap.add_argument("--asks", type=int, default=1, help="replay requests each peer sends")
    ap.add_argument("--streams", type=int, default=4, help="streams running through the flood")
    ap.add_argument("--max-tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the mock's decode step")
    ap.add_argument("--out", default="", help="write OUT.json")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rss_samples", "streams")},
                     indent=1))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
