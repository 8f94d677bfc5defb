"""The kv policy's own CPU against the frontend's total: one mock worker (no compute), many short
requests (the worst case for a per-request cost), the same traffic under `least-loaded` and `kv`
in turn; per arm the frontend's and the worker's CPU per streamed token (psutil) and, for `kv`,
the router's own wall time by part from its /metrics (`tandem_router_kv_seconds_total`: placement
= choosing and recording, events = decoding and applying the worker's KV events).

    .venv/bin/python -m perf.prefix.bench_router_cpu --requests 4096 --runs 3 \\
        --out perf/results/router_cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from perf.prefix.bench_prefix_cache import drive
from perf.common.launch import launch


def one(policy: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tandem-router-cpu-") as d:
        c = launch("agg", "models/tiny", d, ["--max-batch", "4096"], ["--router-policy", policy])
        try:
            cpu0 = c.cpu_s()
            res, _ = asyncio.run(drive(c.port, "tiny", prompts, concurrency, max_tokens))
            cpu1 = c.cpu_s()
            with urllib.request.urlopen(c.url + "/metrics", timeout=10) as r:
                text = r.read().decode()
        finally:
            c.stop()
    toks = sum(r.completion_tokens for r in res if r.ok)
    out = {f"{k} CPU-µs/tok": (cpu1[k] - cpu0[k]) / toks * 1e6 for k in cpu1}
    out["frontend CPU-µs/request"] = (cpu1["frontend"] - cpu0["frontend"]) / len(prompts) * 1e6
    for line in text.splitlines():
        if line.startswith("tandem_router_kv_seconds_total{"):
            part = line.split('part="')[1].split('"')[0]
            out[f"kv {part} µs/request"] = float(line.rsplit(" ", 1)[1]) / len(prompts) * 1e6
    out["failed"] = sum(not r.ok for r in res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="pairs, interleaved")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(20, 80))]
               for _ in range(args.requests)]
    runs: dict[str, list[dict]] = {"least-loaded": [], "kv": []}
    for _ in range(args.runs):
        for policy in runs:
            runs[policy].append(one(policy, prompts, args.concurrency, args.max_tokens))
            print(policy, runs[policy][-1], flush=True)
    keys = sorted({k for rs in runs.values() for r in rs for k in r})
    lines = ["# The kv policy's CPU against the frontend's total", "",
             f"`python -m perf.prefix.bench_router_cpu --requests {args.requests} --concurrency "
             f"{args.concurrency} --max-tokens {args.max_tokens} --runs {args.runs}` "
             f"({time.strftime('%Y-%m-%d %H:%M')}, one mock worker with no compute, prompts of "
             f"20-79 random tokens; medians of {args.runs} interleaved runs)", "",
             "| metric | least-loaded | kv |", "|---|---:|---:|"]
    for k in keys:
        vals = [statistics.median(r[k] for r in runs[p] if k in r) if any(k in r for r in runs[p])
                else None for p in runs]
        lines.append(f"| {k} | " + " | ".join("-" if v is None else f"{v:.3g}" for v in vals)
                     + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
