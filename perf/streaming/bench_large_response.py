"""What one large request costs the rest of the server: a mock-engine agg cluster, one chat request
with many choices and top logprobs (by default the issue's n=64, top_logprobs=20, max_tokens 2000,
ignore_eos), or with --prompt-chars one request with a prompt that long to --path (/tokenize,
/v1/completions or /v1/chat/completions: its templating and tokenizing), and meanwhile GET /health
every 10 ms on its own keep-alive connection. Reports the request's status, size and time, /health latency while it ran
(p50, p99, max) and the frontend's resident memory (before, peak). Writes OUT.json and OUT.md
(default perf/results/large_response_run; the recorded comparison is perf/results/
large_response.md).

    .venv/bin/python perf/streaming/bench_large_response.py [--max-tokens 2000] [--n 64] [--top 20] \
        [--stream] [--repeats 3] [--frontend-args "--max-response-logprobs 3000000"]
    .venv/bin/python perf/streaming/bench_large_response.py --path /tokenize --prompt-chars 3900000
    # the same against another tree's server code (the load side stays this tree's):
    git archive COMMIT runtime components | tar -x -C /tmp/base
    TANDEM_SERVER_PYTHONPATH=/tmp/base/runtime:/tmp/base/components .venv/bin/python ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.common.launch import launch  # noqa: E402
from tandem.config import served_name  # noqa: E402


async def _read_response(r: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}
    if b"content-length" in headers:
        return status, await r.readexactly(int(headers[b"content-length"]))
    parts = []  # chunked
    while True:
        size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
        data = await r.readexactly(size + 2)
        if not size:
            return status, b"".join(parts)
        parts.append(data[:-2])


async def _probe(port: int, stop: asyncio.Event, out: list[float]) -> None:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            w.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            await _read_response(r)
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
    finally:
        w.close()


async def _rss(pid: int, stop: asyncio.Event, out: list[int]) -> None:
    p = psutil.Process(pid)
    while not stop.is_set():
        out.append(p.memory_info().rss)
        await asyncio.sleep(0.01)


async def _run(port: int, frontend_pid: int, path: str, body: bytes) -> dict:
    stop = asyncio.Event()
    lat: list[float] = []
    rss: list[int] = []
    before = psutil.Process(frontend_pid).memory_info().rss
    tasks = [asyncio.create_task(_probe(port, stop, lat)), asyncio.create_task(_rss(
        frontend_pid, stop, rss))]
    await asyncio.sleep(0.1)
    lat.clear()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    w.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
    status, data = await _read_response(r)
    took = time.perf_counter() - t0
    w.close()
    stop.set()
    await asyncio.gather(*tasks)
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) >= 2 else [0.0] * 99
    return {"status": status, "response_bytes": len(data), "request_s": round(took, 3),
            "error": json.loads(data)["error"]["message"] if status != 200 else None,
            "health_probes": len(lat), "health_p50_ms": round(q[49] * 1e3, 2),
            "health_p99_ms": round(q[98] * 1e3, 2),
            "health_max_ms": round(max(lat, default=0.0) * 1e3, 2),
            "frontend_rss_before_mb": round(before / 2**20, 1),
            "frontend_rss_peak_mb": round(max(rss, default=before) / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--top", type=int, default=20, help="top_logprobs")
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--stream", action="store_true", help="the same request streamed (SSE)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--frontend-args", default="", help="extra frontend flags")
    ap.add_argument("--path", default="/v1/chat/completions", help="where the request goes")
    ap.add_argument("--prompt-chars", type=int, default=0,
                    help="instead: one request whose prompt (or chat message) is this long")
    ap.add_argument("--out", default=str(ROOT / "perf/results/large_response_run"))
    args = ap.parse_args()
    body = json.dumps({"model": served_name(args.model), "n": args.n, "logprobs": True,
                       "top_logprobs": args.top, "max_tokens": args.max_tokens,
                       "ignore_eos": True, "stream": args.stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    if args.prompt_chars:
        text = ("hello there, a long prompt. " * (args.prompt_chars // 28 + 1))[:args.prompt_chars]
        req: dict = {"model": served_name(args.model), "max_tokens": 1}
        if args.path.endswith("chat/completions"):
            req["messages"] = [{"role": "user", "content": text}]
        else:
            req["prompt"] = text
        body = json.dumps(req).encode()
    log_dir = tempfile.mkdtemp(prefix="tandem-large-response-")
    cluster = launch("agg", args.model, log_dir, [], args.frontend_args.split())
    try:
        pid = cluster.procs["frontend"].pid
        rows = [asyncio.run(_run(cluster.port, pid, args.path, body))
                for _ in range(args.repeats)]
    finally:
        cluster.stop()
    server = os.environ.get("TANDEM_SERVER_PYTHONPATH", "this tree")
    for row in rows:
        print(json.dumps(row))
    with open(args.out + ".json", "w") as f:
        json.dump({"argv": sys.argv, "server_code": server, "rows": rows}, f, indent=1)
    keys = list(rows[0])
    mode = "streamed" if args.stream else "non-streamed"
    what = (f"POST {args.path} with a prompt of {args.prompt_chars} characters"
            if args.prompt_chars else f"One {mode} chat request, n={args.n}, "
            f"top_logprobs={args.top}, max_tokens={args.max_tokens}")
    lines = [f"# {what}, /health every 10 ms meanwhile", "",
             f"    {' '.join(sys.argv)}", f"    server code: {server}", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
