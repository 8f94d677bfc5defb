"""Markdown tables from perf.streaming.sweep JSON files, with the §7 targets checked:

    python -m perf.streaming.report perf/results/sweep_agg.json perf/results/sweep_1p1d.json
"""

from __future__ import annotations

import json
import sys

COLUMNS = [("concurrency", "conc"), ("requests", "req"), ("failed", "failed"),
           ("tokens_per_s", "tok/s"), ("below_peak_pct", "% below peak"),
           ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
           ("itl_p50_ms", "gap p50 ms"), ("itl_p99_ms", "gap p99 ms"),
           ("chunks_per_token", "chunks/tok"),
           ("cpu_us_per_token", "CPU µs/tok (fe+workers)"),
           ("cpu_us_per_token_frontend", "of it frontend"),
           ("cpu_us_per_chunk", "CPU µs/chunk"),
           ("client_cpu_us_per_token", "client µs/tok"), ("machine_busy_pct", "machine busy %")]


def table(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    rows = data["levels"]
    cols = [(k, h) for k, h in COLUMNS if k in rows[0]]
    out = [f"### {data['meta'].get('title', path)}", "",
           "| " + " | ".join(h for _, h in cols) + " |",
           "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(k, "")) for k, _ in cols) + " |")
    by_c = {r["concurrency"]: r for r in rows}
    peak = max(rows, key=lambda r: r["tokens_per_s"])
    worst_after = max((r for r in rows if r["concurrency"] > peak["concurrency"]),
                      key=lambda r: r["below_peak_pct"], default=None)
    out.append("")
    out.append(f"- peak {peak['tokens_per_s']:.0f} tok/s at concurrency {peak['concurrency']}")
    if worst_after is None:
        out.append("- no level past the peak: no fall")
    else:
        ok = "meets" if worst_after["below_peak_pct"] <= 20 else "MISSES"
        out.append(f"- largest fall past the peak: {worst_after['below_peak_pct']}% at "
                   f"{worst_after['concurrency']} ({ok} the <= 20% target)")
    if 256 in by_c and 2048 in by_c:
        ratio = by_c[2048]["ttft_p50_ms"] / by_c[256]["ttft_p50_ms"]
        ok = "meets" if ratio <= 4 else "MISSES"
        out.append(f"- TTFT p50 at 2048 / at 256: {ratio:.1f}x ({ok} the <= 4x target)")
    if 256 in by_c and "cpu_us_per_token" in by_c[256]:
        cpu = by_c[256]["cpu_us_per_token"]
        ok = "meets" if cpu <= 40 else "MISSES"
        out.append(f"- CPU-µs per streamed token at 256: {cpu} ({ok} the <= 40 µs target)")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    for path in argv if argv is not None else sys.argv[1:]:
        print(table(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
