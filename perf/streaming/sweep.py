"""Concurrency sweep over a tandem frontend: streamed tokens/s, TTFT and inter-token latency per
concurrency level, every stream verified; JSON + CSV + PNG under --out.

    python -m perf.streaming.sweep --url http://127.0.0.1:8000 --concurrency 1,8,64,256
    python -m perf.streaming.sweep --launch 1p1d --concurrency 1,64,1024 --requests-per-level 2048

With --launch the sweep starts its own mock-engine cluster (no delays) and also reports CPU-µs per
streamed token of frontend + workers (psutil CPU time deltas over each level).

A frontend started with --api-key-file: put the file's text (or one key) in OPENAI_API_KEY; the
sweep presents its first key as `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import sys
import tempfile
import time

import psutil

from perf.common.client import Connection
from perf.common.launch import SHAPES, launch
from perf.common.stats import quantile
from perf.streaming.load import LoadSpec, check, print_progress, run, run_level
from tandem.config import served_name


def summarize(level, spec: LoadSpec, expected: str | None) -> dict:
    failures = [(r, why) for r in level.results if (why := check(r, spec, expected))]
    good = [r for r in level.results if r.ok]
    tokens = sum(r.completion_tokens for r in good)
    ttft = [r.ttft_s for r in good]
    gaps = [g for r in good for g in r.gaps_s]
    # A request's whole time (write to last event) and its time per output token after the first
    # (vLLM's E2EL and TPOT): at a fixed concurrency, Little's law ties the end-to-end time to the
    # throughput, so TTFT and the decode time are one split of it (fewer, later chunks move time
    # from the decode into TTFT, and back).
    e2e = [r.ttft_s + sum(r.gaps_s) for r in good]
    tpot = [sum(r.gaps_s) / (r.completion_tokens - 1) for r in good
            if r.completion_tokens > 1]
    return {
        "concurrency": level.concurrency, "requests": len(level.results),
        "failed": len(failures), "failures": sorted({why for _, why in failures})[:5],
        "wall_s": round(level.wall_s, 3), "tokens": tokens,
        "tokens_per_s": round(tokens / level.wall_s, 1) if level.wall_s else 0.0,
        "ttft_p50_ms": round(quantile(ttft, 0.5) * 1e3, 2),
        "ttft_p99_ms": round(quantile(ttft, 0.99) * 1e3, 2),
        "itl_p50_ms": round(quantile(gaps, 0.5) * 1e3, 3),
        "itl_p99_ms": round(quantile(gaps, 0.99) * 1e3, 3),
        "tpot_p50_ms": round(quantile(tpot, 0.5) * 1e3, 3),
        "e2e_p50_ms": round(quantile(e2e, 0.5) * 1e3, 2),
        "e2e_p99_ms": round(quantile(e2e, 0.99) * 1e3, 2),
        "chunks": sum(r.content_chunks for r in good),
        "chunks_per_token": round(sum(r.content_chunks for r in good) / tokens, 3) if tokens else 0,
    }


async def reference_text(spec: LoadSpec) -> str:
    conn = Connection(spec.host, spec.port)
    try:
        res = await conn.post_stream(spec.path, spec.body(), 60.0, spec.headers)
    finally:
        await conn.close()
    why = check(res, spec, None)
    if why:
        raise SystemExit(f"the reference stream failed: {why}")
    return res.text


def _cpu_self() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


async def sweep(args: argparse.Namespace, spec: LoadSpec, cluster) -> list[dict]:
    expected = await reference_text(spec)
    rows = []
    for c in args.concurrency:
        n = 0 if args.duration else max(args.requests_per_level, args.rounds * c)
        before = cluster.cpu_s() if cluster else {}
        client_before = _cpu_self()
        machine_before = psutil.cpu_times()
        level = await run_level(spec, c, requests=n, duration_s=args.duration,
                                progress=print_progress(c))
        print(file=sys.stderr)
        row = summarize(level, spec, expected)
        row["client_cpu_us_per_token"] = _per_token(_cpu_self() - client_before, row["tokens"])
        row["machine_busy_pct"] = _busy_pct(machine_before, psutil.cpu_times())
        if cluster:
            after = cluster.cpu_s()
            for name in after:
                row[f"cpu_us_per_token_{name}"] = _per_token(after[name] - before[name],
                                                             row["tokens"])
            row["cpu_us_per_token"] = _per_token(sum(after.values()) - sum(before.values()),
                                                 row["tokens"])
            # Under load deltas merge and one SSE chunk carries several tokens: per chunk too.
            row["cpu_us_per_chunk"] = _per_token(sum(after.values()) - sum(before.values()),
                                                 row["chunks"])
        rows.append(row)
        print(_line(row), flush=True)
    peak = max(r["tokens_per_s"] for r in rows)
    for r in rows:
        r["below_peak_pct"] = round(100 * (1 - r["tokens_per_s"] / peak), 1) if peak else 0.0
    return rows


def _busy_pct(before, after) -> float:
    """How busy the whole machine was (all processes, all cores), in percent."""
    idle = (after.idle + getattr(after, "iowait", 0)) - (before.idle + getattr(before, "iowait", 0))
    total = sum(after) - sum(before)
    return round(100 * (1 - idle / total), 1) if total > 0 else float("nan")


def _per_token(cpu_s: float, tokens: int) -> float:
    return round(cpu_s * 1e6 / tokens, 2) if tokens else float("nan")


def _line(r: dict) -> str:
    cpu = f"  cpu {r['cpu_us_per_token']:.1f} µs/tok" if "cpu_us_per_token" in r else ""
    return (f"c={r['concurrency']:<5} {r['requests']} req ({r['failed']} failed)  "
            f"{r['tokens_per_s']:.0f} tok/s  ttft p50 {r['ttft_p50_ms']:.1f} p99 "
            f"{r['ttft_p99_ms']:.1f} ms  itl p50 {r['itl_p50_ms']:.2f} p99 {r['itl_p99_ms']:.2f} "
            f"ms  e2e p50 {r['e2e_p50_ms']:.1f} ms{cpu}")


def write_outputs(out: str, meta: dict, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"meta": meta, "levels": rows}, f, indent=1)
    keys = [k for k in rows[0] if k != "failures"]
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib is missing; no plot", file=sys.stderr)
        return
    plot(meta, rows).savefig(out + ".png", dpi=90)


def plot(meta: dict, rows: list[dict]):
    """Four panels over concurrency: streamed tokens/s, TTFT, inter-token gap, and CPU-µs per
    streamed token (frontend + workers and each process with --launch; the load client always)."""
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(1, 4, figsize=(20, 4))
    ax[0].plot(xs, [r["tokens_per_s"] for r in rows], "o-")
    ax[0].set_title("streamed tokens/s")
    for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "s--")):
        ax[1].plot(xs, [r[key] for r in rows], style, label=key)
    ax[1].set_title("TTFT (ms)")
    for key, style in (("itl_p50_ms", "o-"), ("itl_p99_ms", "s--")):
        ax[2].plot(xs, [r[key] for r in rows], style, label=key)
    ax[2].set_title("inter-token gap (ms)")
    cpu = [("cpu_us_per_token", "frontend + workers", "o-")]
    cpu += [(k, k.removeprefix("cpu_us_per_token_"), ".:") for k in rows[0]
            if k.startswith("cpu_us_per_token_")]
    cpu += [("client_cpu_us_per_token", "load client", "s--")]
    for key, label, style in cpu:
        if all(key in r for r in rows):
            ax[3].plot(xs, [r[key] for r in rows], style, label=label)
    ax[3].set_title("CPU-µs per streamed token")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrency")
        a.grid(True, alpha=0.3)
    for a in ax[1:]:
        a.set_yscale("log")
        a.legend(fontsize="small")
    fig.suptitle(meta.get("title", ""))
    fig.tight_layout()
    return fig


API_KEY_ENV = "OPENAI_API_KEY"  # (the OpenAI clients' variable)


def api_key_header(keys: str) -> bytes:
    """The header line presenting the first key of `keys` (a key file's text, as the frontend's
    --api-key-file reads it); b"" for none."""
    if not keys.strip():
        return b""
    from tandem.frontend.apikeys import keys_in

    return f"Authorization: Bearer {keys_in(keys, API_KEY_ENV)[0]}\r\n".encode("ascii")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m perf.streaming.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="frontend URL (or --launch)")
    p.add_argument("--launch", choices=SHAPES, help="start a mock-engine cluster of this shape")
    p.add_argument("--model", default="models/tiny", help="model dir for --launch / served name")
    p.add_argument("--concurrency", default="1,8,64,256,1024",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream-interval", type=int, default=1)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--requests-per-level", type=int, default=512,
                   help="requests per level (at least the concurrency) (default: 512)")
    g.add_argument("--duration", type=float, default=0.0, help="seconds per level instead")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --requests-per-level: at least this many requests per slot, so a "
                        "level is not one burst (default: 1)")
    p.add_argument("--worker-args", default="--max-batch 4096",
                   help="extra worker flags for --launch (default: '--max-batch 4096')")
    p.add_argument("--frontend-args", default="", help="extra frontend flags for --launch")
    p.add_argument("--out", default="perf/results/sweep", help="output path without extension")
    args = p.parse_args(argv)
    if bool(args.url) == bool(args.launch):
        p.error("give exactly one of --url and --launch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cluster = None
    if args.launch:
        log_dir = tempfile.mkdtemp(prefix="tandem-sweep-")
        print(f"cluster logs in {log_dir}", file=sys.stderr)
        cluster = launch(args.launch, args.model, log_dir, args.worker_args.split(),
                         args.frontend_args.split())
        url = cluster.url
    else:
        url = args.url
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    spec = LoadSpec(host, int(port), api=args.api, model=served_name(args.model),
                    max_tokens=args.max_tokens, stream_interval=args.stream_interval,
                    headers=api_key_header(os.environ.get(API_KEY_ENV, "")))
    meta = {"argv": sys.argv, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "launch": args.launch,
            "api": args.api, "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "title": f"{args.launch or url} {args.api} max_tokens={args.max_tokens} "
                     f"interval={args.stream_interval}"}
    try:
        rows = run(sweep(args, spec, cluster))
    finally:
        if cluster is not None:
            cluster.stop()
    write_outputs(args.out, meta, rows)
    print(f"wrote {args.out}.json .csv .png")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
