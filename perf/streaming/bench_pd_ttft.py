"""TTFT of disaggregated (1P1D, KV over NIXL) against aggregated serving for a long prompt, side by
side in one run: both clusters run at once (reference engine, CPU, the tiny model) and requests
alternate between them, one at a time, so both see the same machine. Writes
perf/results/pd_ttft.{json,md}.

    .venv/bin/python perf/streaming/bench_pd_ttft.py [--prompt-tokens 1900] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.common.stats import quantile  # noqa: E402
from tests.cluster import Cluster, free_port  # noqa: E402
from tests.sse import Stream  # noqa: E402


def start(model: str, log_dir: str, roles: list[str]) -> Cluster:
    c = Cluster(model, log_dir)
    for role in roles:
        extra = ["--role", role, "--num-pages", "1024"]
        if role == "prefill":
            extra += ["--bootstrap-port", str(free_port())]
        c.add_worker("reference", extra)
    c.start_frontend()
    return c


def ttft(url: str, model: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    s = Stream(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2,
                                        "temperature": 0, "stream": True, "ignore_eos": True})
    assert s.result.status == 200, s.result.body
    ev = s.next_event()
    first = time.perf_counter() - t0
    assert ev is not None and "error" not in ev, ev
    r = s.read_all()
    assert r.done and r.error is None
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1900)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "perf/results/pd_ttft"))
    args = ap.parse_args()
    from tandem.engines.reference.checkpoint import write_tiny_model

    tmp = tempfile.mkdtemp(prefix="tandem-ttft-")
    model = os.path.join(tmp, "tiny")
    write_tiny_model(model, seed=0)
    os.makedirs(os.path.join(tmp, "agg"))
    os.makedirs(os.path.join(tmp, "pd"))
    agg = start(model, os.path.join(tmp, "agg"), ["agg"])
    pd = start(model, os.path.join(tmp, "pd"), ["prefill", "decode"])
    name = os.path.basename(model)
    prompt = [10 + (i * 7) % 900 for i in range(args.prompt_tokens)]
    times: dict[str, list[float]] = {"agg": [], "pd": []}
    try:
        for c in (agg, pd):  # warm up: first transfer to a peer sets up the connection
            ttft(c.url, name, prompt)
        for i in range(args.repeats):
            for label, c in (("agg", agg), ("pd", pd)) if i % 2 == 0 else (("pd", pd), ("agg", agg)):
                times[label].append(ttft(c.url, name, prompt))
            print(f"\r{i + 1}/{args.repeats}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        agg.assert_idle()
        pd.assert_idle()
    finally:
        agg.stop()
        pd.stop()

    res = {
        "command": "python perf/streaming/bench_pd_ttft.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPUs, {platform.python_version()}",
        "prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
        "kv_bytes": 0,
        "ttft_ms": {k: {"p50": 1000 * statistics.median(v), "p90": 1000 * quantile(v, 0.9),
                        "min": 1000 * min(v)} for k, v in times.items()},
    }
    res["ratio_p50_pd_over_agg"] = res["ttft_ms"]["pd"]["p50"] / res["ttft_ms"]["agg"]["p50"]
    page_bytes = 2 * 2 * 16 * 2 * 16 * 4
    res["kv_bytes"] = -(-args.prompt_tokens // 16) * page_bytes
    Path(args.out + ".json").write_text(json.dumps(res, indent=2))
    lines = [
        "# TTFT: disaggregated (1P1D, NIXL) vs aggregated, long prompt", "",
        f"`{res['command']}`", "",
        f"{res['machine']}; reference engine on CPU, tiny model (2 layers, hidden 64); prompt "
        f"{args.prompt_tokens} tokens = {res['kv_bytes'] / 1e6:.2f} MB of KV; {args.repeats} "
        "requests each, alternating, one at a time, both clusters up at once.", "",
        "| serving | TTFT p50 ms | p90 ms | min ms |", "|---|---:|---:|---:|",
    ]
    for k in ("agg", "pd"):
        t = res["ttft_ms"][k]
        lines.append(f"| {k} | {t['p50']:.1f} | {t['p90']:.1f} | {t['min']:.1f} |")
    lines += ["", f"PD / agg TTFT p50: **{res['ratio_p50_pd_over_agg']:.2f}x**", ""]
    Path(args.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
