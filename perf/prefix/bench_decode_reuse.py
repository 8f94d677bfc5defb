"""Decode-held reuse in PD, measured on multi-turn chat: a follow-up turn's prompt holds the last
turn's completion, which only the decode worker that generated it has cached. Two arms on the same
mock cluster shape (`--shape`, 2P2D by default), the kv policy both, the runs interleaved and the
arms' order rotated per run:

- `recompute`: every turn through a prefill worker, which computes what it lacks (the last
  answer included) and hands the KV over (the decode worker receives only the pages it lacks);
- `decode-reuse`: `--pd-local-prefill-tokens N`: a turn whose prompt the chosen decode worker
  lacks at most N tokens of, and fewer than the chosen prefill worker lacks, is prefilled on
  the decode worker, where the last answer's KV is (tandem.router.pool).

The workload is perf.prefix.prefix_workloads' `multiturn-own`: sessions whose next prompt is the
previous prompt, the mock engine's own answer (its ids, so the cached completion matches) and a
new user turn. The cluster has keys (a decode worker caches KV it received only from a peer that
authenticated: keyless, it caches nothing and there is nothing to reuse). Figures per level from the client (perf.prefix.prefix_drive): TTFT p50/p90, the
prompt tokens not computed (usage.cached_tokens) and output tok/s; medians of `--runs`.

    python -m perf.prefix.bench_decode_reuse --out perf/results/decode_reuse
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

from perf.prefix import prefix_workloads as W
from perf.prefix.prefix_arms import tandem_arm
from tandem.up import new_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "hit_rate", "output_tok_s", "ok", "requests")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m perf.prefix.bench_decode_reuse",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--shape", default="2p2d")
    a("--rates", default="4,8", help="offered turns/s per level")
    a("--runs", type=int, default=3)
    a("--local-tokens", type=int, default=256, help="the decode-reuse arm's "
      "--pd-local-prefill-tokens")
    a("--model", default=os.path.join(ROOT, "models", "smollm2"))
    a("--num-pages", type=int, default=2000)
    a("--max-batch", type=int, default=64)
    a("--prefill-us", type=float, default=100.0)
    a("--step-us", type=float, default=10_000.0)
    a("--seq-us", type=float, default=100.0)
    a("--kv-bytes-per-s", type=float, default=2e9, help="the mock's simulated KV transfer rate")
    a("--level-seconds", type=float, default=20.0)
    a("--out", default="perf/results/decode_reuse")
    args = p.parse_args(argv)
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    eos = cfg.get("eos_token_id")
    params = W.Params(level_seconds=args.level_seconds, mock_vocab=int(cfg["vocab_size"]),
                      mock_eos=list(eos) if isinstance(eos, list) else [] if eos is None
                      else [eos])
    worker = ["--page-size", str(params.page_size), "--num-pages", str(args.num_pages),
              "--max-batch", str(args.max_batch), "--mock-prefill-us-per-token",
              str(args.prefill_us), "--mock-decode-step-us", str(args.step_us),
              "--mock-decode-us-per-seq", str(args.seq_us), "--kv-bytes-per-s",
              str(args.kv_bytes_per_s)]
    arms = {"recompute": [], "decode-reuse": ["--pd-local-prefill-tokens",
                                              str(args.local_tokens)]}
    rates = [float(r) for r in args.rates.split(",") if r]
    levels = [(i, r, W.level_seed(1, "multiturn-own", i)) for i, r in enumerate(rates)]
    rows: list[dict] = []
    names = list(arms)
    keys = new_keys()
    try:
        for run in range(args.runs):
            for arm in names[run % 2:] + names[:run % 2]:
                spec = {"model": args.model,
                        "model_name": os.path.basename(args.model.rstrip("/")),
                        "params": asdict(params), "max_tokens": params.answer_tokens,
                        "timeout_s": 120.0, "tandem_worker_args": worker,
                        "tandem_frontend_args": arms[arm], "keys": keys}
                print(f"run {run} {arm}", flush=True)
                with tempfile.TemporaryDirectory(prefix="decode-reuse-") as d:
                    for row in tandem_arm(spec, args.shape, "kv", "multiturn-own", levels, d):
                        rows.append({**row, "arm": arm, "run": run})
                with open(args.out + ".json", "w") as f:
                    json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    finally:
        shutil.rmtree(keys, ignore_errors=True)
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    lines = ["# Decode-held reuse in PD on multi-turn chat (the last answer's KV, held by the "
             "decode worker)", "",
             f"`python -m perf.prefix.bench_decode_reuse "
             f"{' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             f"{time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} cores, tree {tree}; "
             f"{args.shape} mock workers, {args.num_pages} pages each, mock timing "
             f"{args.prefill_us:g} µs per computed prompt token, decode step {args.step_us:g} µs "
             f"+ {args.seq_us:g} µs per sequence, KV transfer {args.kv_bytes_per_s / 1e9:g} GB/s; "
             f"multiturn-own, {params.answer_tokens}-token answers, {args.level_seconds:g} s per "
             f"level; medians of {args.runs} runs, arms in turn.", "",
             "| arm | turns/s | TTFT p50 ms | TTFT p90 ms | prompt tokens not computed | "
             "output tok/s | ok / sent |", "|---|---:|---:|---:|---:|---:|---:|"]
    for rate in rates:
        for arm in names:
            mine = [r for r in rows if r["arm"] == arm and r["rate"] == rate]
            if not mine:
                continue
            m = {k: statistics.median(r[k] for r in mine) for k in FIGURES}
            lines.append(f"| {arm} | {rate:g} | {m['ttft_p50_ms']:.0f} | {m['ttft_p90_ms']:.0f} "
                         f"| {m['hit_rate']:.3f} | {m['output_tok_s']:.0f} | {m['ok']:.0f} / "
                         f"{m['requests']:.0f} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
