"""The prefix cache on one worker, on and off, side by side in one run: a shared-prefix workload
(G groups, each a long system prompt, many short questions per group, the groups interleaved), one
mock-engine worker whose timing model charges prefill per computed prompt token, the same client.

    .venv/bin/python -m perf.prefix.bench_prefix_cache --groups 32 --prefix-tokens 1200 \\
        --question-tokens 40 --requests 512 --concurrency 16 --max-tokens 32 --runs 3 \\
        --out perf/results/prefix_cache

Per arm (cache on: the default; off: `--no-prefix-cache`), the runs interleaved (on, off, on, ...):
prompt tokens computed (the worker's `tandem_prefix_cache_queries_total` minus `_hits_total`; with
the cache off every prompt token), the hit rate, `usage.prompt_tokens_details.cached_tokens` as
the client saw it, TTFT p50/p99, output tok/s; medians over the runs and on/off ratios. Writes
OUT.json and OUT.md; prints the table.

Requests are /v1/completions with token-id prompts, so lengths are exact: group g's system prompt
is a fixed random list of `--prefix-tokens` ids, each question `--question-tokens` random ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from typing import Any

from perf.common.client import Connection, StreamResult
from perf.common.launch import launch
from perf.common.stats import quantile

DEFAULT_TIMING = ["--mock-prefill-us-per-token", "50", "--mock-decode-step-us", "10000",
                  "--mock-decode-us-per-seq", "100"]


def workload(groups: int, prefix: int, question: int, n: int, vocab: int,
             seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(prefix)] for _ in range(groups)]
    return [systems[rng.randrange(groups)] + [rng.randrange(3, vocab) for _ in range(question)]
            for _ in range(n)]


async def drive(port: int, model: str, prompts: list[list[int]], concurrency: int,
                max_tokens: int) -> tuple[list[StreamResult], float]:
    todo = list(enumerate(prompts))
    results: list[StreamResult | None] = [None] * len(prompts)

    async def slot() -> None:
        conn = Connection("127.0.0.1", port)
        try:
            while todo:
                i, prompt = todo.pop(0)
                body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                   "ignore_eos": True, "stream": True,
                                   "stream_options": {"include_usage": True}}).encode()
                results[i] = await conn.post_stream("/v1/completions", body)
        finally:
            await conn.close()

    t0 = time.monotonic()
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    wall = time.monotonic() - t0
    return [r for r in results if r is not None], wall


def worker_counts(url: str) -> tuple[int, int]:
    from tandem.launcher import get_json

    rows = get_json(url + "/workers")
    rows = rows["workers"] if isinstance(rows, dict) else rows
    return (sum(int(r.get("prefix_cache_queries", 0)) for r in rows),
            sum(int(r.get("prefix_cache_hits", 0)) for r in rows))


def one_run(args: argparse.Namespace, cache: bool, prompts: list[list[int]],
            log_dir: str) -> dict[str, Any]:
    worker_args = [*DEFAULT_TIMING, "--max-batch", str(args.max_batch),
                   *(["--no-prefix-cache"] if not cache else []), *args.worker_args.split()]
    cluster = launch("agg", args.model, log_dir, worker_args, [])
    try:
        results, wall = asyncio.run(drive(cluster.port, args.model_name, prompts,
                                          args.concurrency, args.max_tokens))
        time.sleep(0.6)  # the workers' next load report carries the last counts
        queries, hits = worker_counts(cluster.url)
    finally:
        cluster.stop()
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "cache": cache, "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "prompt_tokens": prompt_tokens,
        "computed_prompt_tokens": (queries - hits) if cache else prompt_tokens,
        "worker_queries": queries, "worker_hits": hits,
        "hit_rate": hits / queries if queries else 0.0,
        "client_cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_p50_ms": 1000 * quantile([r.ttft_s for r in ok], 0.5),
        "ttft_p99_ms": 1000 * quantile([r.ttft_s for r in ok], 0.99),
        "tok_s": sum(r.completion_tokens for r in ok) / wall, "wall_s": wall,
    }


METRICS = ["computed_prompt_tokens", "hit_rate", "client_cached_tokens", "ttft_p50_ms",
           "ttft_p99_ms", "tok_s", "failed"]


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    on = [r for r in runs if r["cache"]]
    off = [r for r in runs if not r["cache"]]
    lines = ["# Prefix cache on vs off, one mock worker, shared-prefix workload", "",
             f"`python -m perf.prefix.bench_prefix_cache {' '.join(args.argv)}`",
             f"({time.strftime('%Y-%m-%d %H:%M')}, medians of {len(on)} interleaved runs each; "
             f"worker timing {' '.join(DEFAULT_TIMING)})", "",
             f"{args.groups} groups x {args.prefix_tokens}-token system prompt, "
             f"{args.question_tokens}-token questions, {args.requests} requests, concurrency "
             f"{args.concurrency}, max_tokens {args.max_tokens}", "",
             "| metric | cache off | cache on | on/off |", "|---|---:|---:|---:|"]
    for m in METRICS:
        a = statistics.median(r[m] for r in off)
        b = statistics.median(r[m] for r in on)
        ratio = f"{b / a:.2f}" if a else "-"
        lines.append(f"| {m} | {_fmt(a)} | {_fmt(b)} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=1200)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="on/off pairs, interleaved")
    ap.add_argument("--worker-args", default="", help="more worker flags (both arms)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import sys

    args.argv = sys.argv[1:]
    with open(f"{args.model}/config.json") as f:
        vocab = int(json.load(f)["vocab_size"])
    from tandem.launcher import get_json  # noqa: F401  (fail early if not importable)

    args.model_name = args.model.rstrip("/").rsplit("/", 1)[-1]
    prompts = workload(args.groups, args.prefix_tokens, args.question_tokens, args.requests,
                       vocab, args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="tandem-prefix-") as logs:
        for i in range(args.runs):
            for cache in (True, False):
                r = one_run(args, cache, prompts, f"{logs}/{i}-{cache}")
                print(f"run {i} cache {'on ' if cache else 'off'}: computed "
                      f"{r['computed_prompt_tokens']} of {r['prompt_tokens']} prompt tokens, "
                      f"hit rate {r['hit_rate']:.2f}, TTFT p50 {r['ttft_p50_ms']:.1f} ms "
                      f"p99 {r['ttft_p99_ms']:.1f} ms, {r['tok_s']:.0f} tok/s, "
                      f"{r['failed']} failed", flush=True)
                runs.append(r)
    text = report(args, runs)
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"argv": args.argv, "runs": runs}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
