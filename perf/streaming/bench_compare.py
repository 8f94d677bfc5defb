"""Side by side in one run: the same sweep against a baseline commit's server code and the current
tree's, interleaved (A B A B ...), and the ratios of what matters.

The load generator, its verification and its CPU accounting are this tree's `perf.streaming.sweep` in both
cases; only the cluster's code differs. The baseline's code is checked out with `git worktree` into
a temporary directory, and its processes run with that tree first on PYTHONPATH (tandem is a
namespace package, so its own modules win).

    .venv/bin/python -m perf.streaming.bench_compare --baseline 7e51940 --shape 1p1d --concurrency 256 \\
        --max-tokens 128 --worker-args "--max-batch 4096 --mock-decode-step-us 20000" \\
        --repeats 2 --out perf/results/compare_paced_1p1d

Writes OUT.json (every run's rows) and OUT.md (medians and current/baseline ratios per level);
prints the table. A ratio below 1 for CPU or latency, above 1 for throughput, is an improvement.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METRICS = [
    ("tokens_per_s", "tok/s"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
    ("itl_p50_ms", "ITL p50 ms"), ("itl_p99_ms", "ITL p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
    ("e2e_p50_ms", "E2E p50 ms"), ("e2e_p99_ms", "E2E p99 ms"), ("chunks_per_token", "chunks/tok"),
    ("cpu_us_per_token_frontend", "frontend CPU-µs/tok"),
    ("cpu_us_per_chunk_frontend", "frontend CPU-µs/chunk"), ("cpu_us_per_chunk", "CPU-µs/chunk"),
    ("cpu_us_per_token_agg", "agg CPU-µs/tok"), ("cpu_us_per_token_prefill", "prefill CPU-µs/tok"),
    ("cpu_us_per_token_decode", "decode CPU-µs/tok"), ("cpu_us_per_token", "all CPU-µs/tok"),
    ("client_cpu_us_per_token", "load generator CPU-µs/tok"),
    ("frontend_chunk_per_client_token", "frontend CPU/chunk ÷ load generator CPU/tok"),
]


def _worktree(commit: str) -> str:
    path = tempfile.mkdtemp(prefix="tandem-baseline-")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, commit], check=True,
                   capture_output=True)
    return path


def _run(tree: str, args: argparse.Namespace, out: str) -> list[dict]:
    env = dict(os.environ)
    # The load generator is this tree's; only the cluster's processes run `tree`'s code.
    env["TANDEM_SERVER_PYTHONPATH"] = os.pathsep.join([os.path.join(tree, "runtime"),
                                                       os.path.join(tree, "components")])
    cmd = [sys.executable, "-m", "perf.streaming.sweep", "--launch", args.shape, "--model", args.model,
           "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens),
           "--requests-per-level", str(args.requests_per_level), "--rounds", str(args.rounds),
           "--worker-args", args.worker_args, "--frontend-args", args.frontend_args, "--out", out]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    with open(out + ".json") as f:
        return list(json.load(f)["levels"])


def _value(row: dict, key: str) -> float | None:
    if key == "cpu_us_per_chunk_frontend":  # frontend CPU per streamed chunk (derived)
        tok, cpt = row.get("cpu_us_per_token_frontend"), row.get("chunks_per_token")
        return round(tok / cpt, 2) if isinstance(tok, (int, float)) and cpt else None
    if key == "frontend_chunk_per_client_token":
        # The load generator's code is this tree's in every run: its CPU per token moves only
        # with the machine's speed (by a third between runs on a shared VM), so this ratio is the
        # frontend's cost with that drift taken out (derived).
        chunk, client = _value(row, "cpu_us_per_chunk_frontend"), row.get("client_cpu_us_per_token")
        return round(chunk / client, 3) if chunk is not None and client else None
    v = row.get(key)
    return v if isinstance(v, (int, float)) else None


def _median(rows: list[dict], key: str) -> float | None:
    xs = [v for r in rows if (v := _value(r, key)) is not None]
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.streaming.bench_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="commit whose server code is the baseline")
    p.add_argument("--shape", choices=["agg", "1p1d"], default="1p1d")
    p.add_argument("--model", default="models/tiny")
    p.add_argument("--concurrency", default="256")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-per-level", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worker-args", default="--max-batch 4096 --mock-decode-step-us 20000")
    p.add_argument("--frontend-args", default="")
    p.add_argument("--repeats", type=int, default=2, help="A/B pairs, interleaved (default: 2)")
    p.add_argument("--out", default="perf/results/compare")
    args = p.parse_args(argv)
    base = _worktree(args.baseline)
    runs: dict[str, list[list[dict]]] = {"baseline": [], "current": []}
    tmp = tempfile.mkdtemp(prefix="tandem-compare-")
    try:
        for i in range(args.repeats):
            for name, tree in (("baseline", base), ("current", ROOT)):
                print(f"== {name} run {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
                runs[name].append(_run(tree, args, os.path.join(tmp, f"{name}{i}")))
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base],
                       capture_output=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    lines = [f"# {args.shape}: current tree vs {args.baseline}",
             "", f"`{' '.join(shlex.quote(a) for a in ['python', '-m', 'perf.streaming.bench_compare', *(argv or sys.argv[1:])])}`",
             f"({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; medians of "
             f"{args.repeats} interleaved runs each)", ""]
    for li, level in enumerate(levels):
        lines += [f"## concurrency {level}", "", "| metric | baseline | current | ratio |",
                  "|---|---:|---:|---:|"]
        for key, label in METRICS:
            b = _median([r[li] for r in runs["baseline"]], key)
            c = _median([r[li] for r in runs["current"]], key)
            if b is None or c is None:
                continue
            ratio = f"{c / b:.2f}" if b else "n/a"
            lines.append(f"| {label} | {b:g} | {c:g} | {ratio} |")
        fails = sum(r[li]["failed"] for rs in runs.values() for r in rs)
        lines += ["", f"failed streams in all runs: {fails}", ""]
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"argv": sys.argv, "baseline": args.baseline, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
