"""A quick look at routing arms on the shared-prefix workload (perf.prefix.bench_prefix_cache's): one run
per arm on a mock cluster of SHAPE (4agg, 2p2d, ...) at one concurrency, each worker's cache
bounded by --num-pages; TTFT p50/p90, hit rate (the workers' own counters), output tok/s. The
full benchmark, with its load ladder and the side-by-side with Dynamo, is perf/prefix/bench_prefix.py.

    .venv/bin/python -m perf.prefix.bench_kv_arms --shape 2p2d --concurrency 32 --num-pages 1000 \\
        --arms kv,kv:--pd-local-prefill-tokens=256,round-robin
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from perf.common.launch import launch
from perf.common.stats import quantile
from perf.prefix.bench_prefix_cache import DEFAULT_TIMING, drive, worker_counts, workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4agg")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-pages", type=int, default=1000, help="KV pages per worker")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--arms", default="round-robin,kv",
                    help="comma-separated POLICY[:FRONTEND-FLAG=VALUE...] (flags joined by ':')")
    args = ap.parse_args()
    prompts = workload(32, 1200, 40, args.requests, 1024, 1)
    for arm in args.arms.split(","):
        policy, *flags = arm.split(":")
        extra = [part for f in flags for part in f.split("=", 1)]
        with tempfile.TemporaryDirectory(prefix="tandem-arms-") as d:
            c = launch(args.shape, "models/tiny", d, [*DEFAULT_TIMING, "--max-batch", "64",
                                                       "--num-pages", str(args.num_pages)],
                       ["--router-policy", policy, *extra])
            try:
                res, wall = asyncio.run(drive(c.port, "tiny", prompts, args.concurrency, 32))
                time.sleep(0.6)
                q, h = worker_counts(c.url)
            finally:
                c.stop()
        ok = [r for r in res if r.ok]
        print(f"{args.shape} {arm}: TTFT p50 {1000 * quantile([r.ttft_s for r in ok], 0.5):.1f} "
              f"p90 {1000 * quantile([r.ttft_s for r in ok], 0.9):.1f} ms, hit rate "
              f"{h / max(q, 1):.2f}, {sum(r.completion_tokens for r in ok) / wall:.0f} tok/s, "
              f"{len(res) - len(ok)} failed", flush=True)


if __name__ == "__main__":
    main()
