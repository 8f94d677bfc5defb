"""KV beyond the device on a real trace: Mooncake's FAST'25 conversation trace (every line a
request: `timestamp` in ms, `input_length`, `output_length`, and `hash_ids`, one per 512-token
block of the prompt, equal ids meaning equal blocks) replayed by AIPerf 0.13 (`--custom-dataset-type
mooncake_trace --fixed-schedule`) against 4 mock workers with a small device KV pool, with and
without a host tier 10x larger, and against NVIDIA Dynamo 1.6.1's mocker (`--num-host-blocks`)
under its kv router, with the same trace, client, pool sizes, timing model and host bandwidth.

    python -m perf.prefix.bench_trace --trace PATH/conversation_trace.jsonl --out perf/results/trace_mooncake

LMCache's multi-round QA shape runs the same way from a trace perf.prefix.qa_trace writes
(`--trace qa_trace.jsonl`).

The trace is scaled to this machine, the same way for every arm (`scaled`): its first
`--requests` lines, each block `--block-tokens` tokens instead of 512 (AIPerf's `--isl-block-size`),
at most `--max-blocks` blocks (a prompt keeps its leading ones, so what it shares is kept) and
`--max-output` output tokens, and the timestamps divided by each level's speedup
(`--speedups`: one load below saturation, one near it).

Arms (`--arms`), each a fresh cluster per level and run, in turn, the order rotated per run:
`tandem-host` / `tandem` (mock workers, `--router-policy kv`, host tier on / off) and
`dynamo-host` / `dynamo` (Dynamo's mocker with its vLLM-style G2 host offload on / off, its
frontend with `--router-mode kv`, its host-hit weight its default). Timing: tandem's mock model
(prefill µs per uncomputed token, decode step µs + µs per sequence), given to Dynamo's mocker as
its latency table (perf.prefix.prefix_arms); the host tier's load bandwidth `--h2d-gbps` both
sides (Dynamo's `--host-offload-h2d-bandwidth-gbps`; tandem's `--mock-h2d-bytes-per-s`), the
copy into the host off the request's path both sides (Dynamo's offload is write-through, off the
path; tandem's mock charges none: `--mock-d2h-bytes-per-s 0`), KV bytes per token those of the
model's config.

Every arm runs in a network namespace of its own with only loopback (`unshare -n`; Dynamo's
event sockets bind 0.0.0.0): the servers, AIPerf and nothing else; processes are stopped by PID.
Figures per arm and level, from AIPerf's own export (the same for every system): TTFT p50/p90,
requests completed and failed, prompt tokens and cached prompt tokens (usage's
`prompt_tokens_details.cached_tokens`), so prompt tokens computed = prompt - cached; for tandem also
the workers' hits by tier (`/workers`). OUT.json holds every row, OUT.md the medians and the
targets: prompt tokens computed at most 0.8x Dynamo's (each with its host tier), and tandem's TTFT
p90 gain from its host tier (off / on) at least Dynamo's from its own.

Needs: AIPerf 0.13 in a venv outside the repository (`--aiperf`), a Hugging Face cache holding the
model's tokenizer under a repo name (`--hf-home`, `--tokenizer`: AIPerf 0.13's workers load a
tokenizer by repo name only, offline), Dynamo 1.6.1's venv (`--dynamo-python`), `unshare`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARMS = ("tandem-host", "tandem", "dynamo-host", "dynamo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m perf.prefix.bench_trace",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--trace", required=True, help="Mooncake's conversation_trace.jsonl (FAST25-release/traces)")
    a("--out", default="perf/results/trace_mooncake", help="OUT.json and OUT.md")
    a("--requests", type=int, default=600, help="the trace's first N lines")
    a("--speedups", default="2,4", help="levels: the timestamps divided by each")
    a("--runs", type=int, default=3, help="runs per arm and level (medians)")
    a("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    a("--block-tokens", type=int, default=64, help="tokens per trace block (AIPerf's "
      "--isl-block-size; the trace's are 512)")
    a("--max-blocks", type=int, default=80, help="blocks per prompt at most (its leading ones)")
    a("--max-output", type=int, default=64, help="output tokens per request at most")
    a("--model", default=os.path.join(ROOT, "models", "smollm2"), help="model directory (the "
      "mock reads its config; Dynamo's mocker too)")
    a("--model-name", default="smollm2")
    a("--workers", type=int, default=4)
    a("--page-size", type=int, default=16)
    a("--num-pages", type=int, default=384, help="device KV pages per worker")
    a("--host-pages", type=int, default=3840, help="host tier pages per worker (the host arms)")
    a("--max-batch", type=int, default=32)
    a("--prefill-us", type=float, default=150.0, help="mock prefill µs per computed token")
    a("--step-us", type=float, default=10_000.0, help="mock decode step µs")
    a("--seq-us", type=float, default=100.0, help="mock decode µs per sequence in a step")
    a("--h2d-gbps", type=float, default=32.0, help="host tier load bandwidth, GB/s (Dynamo's "
      "default)")
    a("--tandem-frontend-args", default="", help="more flags for tandem's frontend, one string "
      "(the kv policy's knobs)")
    a("--aiperf", default="/work/peers/aiperf/bin/aiperf")
    a("--hf-home", default="/work/peers/hf-home")
    a("--tokenizer", default="local/smollm2", help="the tokenizer's repo name in --hf-home")
    a("--dynamo-python", default="/work/dynamo-venv/bin/python")
    a("--arm-timeout-s", type=float, default=900.0)
    a("--report", default="", help="only write OUT.md again from this saved OUT.json")
    return p.parse_args(argv)


def scaled(lines: list[dict], block_tokens: int, max_blocks: int, max_output: int,
           speedup: float) -> list[dict]:
    """The trace at this machine's scale (module docstring): blocks of `block_tokens`, at most
    `max_blocks` of them, outputs capped, timestamps divided by `speedup` (from 0)."""
    t0 = lines[0]["timestamp"]
    out = []
    for ln in lines:
        ids = list(ln["hash_ids"])[:max_blocks]
        n_in = min(len(ids) * block_tokens, max(
            (len(ids) - 1) * block_tokens + 1,
            round(ln["input_length"] * block_tokens / 512)))
        out.append({"timestamp": int((ln["timestamp"] - t0) / speedup), "input_length": n_in,
                    "output_length": max(1, min(max_output, int(ln["output_length"]))),
                    "hash_ids": ids})
    return out


def oracle_reuse(lines: list[dict], block_tokens: int) -> float:
    """The share of the scaled trace's prompt tokens an infinite cache with perfect routing would
    not compute: each prompt's leading blocks that an earlier prompt had (the same chain of
    hash ids), a block's tokens each (the prompts' own tokens, before any chat template)."""
    seen: set[tuple[int, ...]] = set()
    reused = total = 0
    for ln in lines:
        total += ln["input_length"]
        chain: tuple[int, ...] = ()
        shared = True
        for h in ln["hash_ids"]:
            chain += (h,)
            if shared and chain in seen:
                reused += min(block_tokens, ln["input_length"] - (len(chain) - 1) * block_tokens)
            else:
                shared = False
            seen.add(chain)
    return reused / total if total else 0.0


def kv_bytes_per_token(model: str) -> int:
    """What the mock charges a page by (tandem.engines.pages.page_bytes, float32) per token."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    heads = int(cfg.get("num_attention_heads", 8))
    head_dim = int(cfg.get("head_dim", int(cfg.get("hidden_size", 512)) // heads))
    return int(cfg.get("num_hidden_layers", 2)) * 2 * int(
        cfg.get("num_key_value_heads", heads)) * head_dim * 4


# -- one arm, inside its namespace ---------------------------------------------------------------

def _aiperf(spec: dict, port: int, trace: str, out_dir: str) -> dict:
    env = {**os.environ, "HF_HOME": spec["hf_home"], "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    cmd = [spec["aiperf"], "profile", "-m", spec["model_name"], "--tokenizer",
           spec["tokenizer"], "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "chat",
           "--streaming", "--input-file", trace, "--custom-dataset-type", "mooncake_trace",
           "--fixed-schedule", "--isl-block-size", str(spec["block_tokens"]), "--artifact-dir",
           out_dir, "--no-gpu-telemetry", "--ui", "none", "--workers-max", "2",
           "--record-processors", "1", "--request-timeout-seconds", "300"]
    with open(os.path.join(out_dir, "aiperf.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            timeout=spec["arm_timeout_s"]).returncode
    path = os.path.join(out_dir, "profile_export_aiperf.json")
    if rc != 0 or not os.path.exists(path):
        raise RuntimeError(f"aiperf exited {rc}; see {out_dir}/aiperf.log")
    with open(path) as f:
        d = json.load(f)

    def v(name: str, stat: str = "avg") -> float:
        return float((d.get(name) or {}).get(stat) or 0.0)

    prompt, cached = v("total_usage_prompt_tokens"), v("total_usage_prompt_cache_read_tokens")
    return {"ttft_p50_ms": v("time_to_first_token", "p50"),
            "ttft_p90_ms": v("time_to_first_token", "p90"),
            "completed": v("completed_request_count"), "requests": v("request_count"),
            "error_rate_pct": v("request_error_rate"), "prompt_tokens": prompt,
            "cached_tokens": cached, "computed_tokens": prompt - cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "output_tok_s": v("output_token_throughput"), "duration_s": v("benchmark_duration")}


def _tandem(spec: dict, host: bool, trace: str, out_dir: str) -> dict:
    from perf.common.launch import launch
    from perf.prefix.prefix_arms import warm
    from tandem.launcher import get_json

    w = ["--page-size", str(spec["page_size"]), "--num-pages", str(spec["num_pages"]),
         "--max-batch", str(spec["max_batch"]), "--mock-prefill-us-per-token",
         str(spec["prefill_us"]), "--mock-decode-step-us", str(spec["step_us"]),
         "--mock-decode-us-per-seq", str(spec["seq_us"])]
    if host:
        w += ["--host-kv-pages", str(spec["host_pages"]), "--mock-h2d-bytes-per-s",
              str(spec["h2d_gbps"] * 1e9)]
    c = launch(f"{spec['workers']}agg", spec["model"], os.path.join(out_dir, "logs"), w,
               ["--router-policy", "kv", *spec["tandem_frontend_args"].split()])
    try:
        warm("127.0.0.1", c.port, spec["model_name"])
        row = _aiperf(spec, c.port, trace, out_dir)
        time.sleep(1.0)  # (the workers' next load reports carry the last counts)
        rows = get_json(c.url + "/workers")
        rows = rows["workers"] if isinstance(rows, dict) else rows
        hits = sum(int(r.get("prefix_cache_hits", 0)) for r in rows)
        host_hits = sum(int(r.get("prefix_cache_host_hits", 0)) for r in rows)
        queries = sum(int(r.get("prefix_cache_queries", 0)) for r in rows)
        row.update(worker_queries=queries, worker_hits=hits, worker_host_hits=host_hits,
                   worker_device_hit_rate=(hits - host_hits) / queries if queries else 0.0,
                   worker_host_hit_rate=host_hits / queries if queries else 0.0)
        return row
    finally:
        c.stop()


def _dynamo(spec: dict, host: bool, trace: str, out_dir: str) -> dict:
    from perf.prefix.prefix_arms import dynamo_cluster

    port = 18124
    mocker = ["--kv-bytes-per-token", str(spec["kv_bytes_per_token"])]
    if host:
        mocker += ["--num-host-blocks", str(spec["host_pages"]),
                   "--host-offload-h2d-bandwidth-gbps", str(spec["h2d_gbps"])]
    with dynamo_cluster(spec["dynamo_python"], out_dir, model=spec["model"],
                        model_name=spec["model_name"], workers=spec["workers"],
                        page_size=spec["page_size"], num_pages=spec["num_pages"],
                        max_batch=spec["max_batch"], port=port, mode="kv",
                        timing={"prefill_us": spec["prefill_us"], "step_us": spec["step_us"],
                                "seq_us": spec["seq_us"]}, mocker_args=mocker):
        return _aiperf(spec, port, trace, out_dir)


def _child(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    arm, trace, out_dir = spec["arm"], spec["trace_file"], spec["dir"]
    run = _tandem if arm.startswith("tandem") else _dynamo
    row = run(spec, arm.endswith("-host"), trace, out_dir)
    with open(os.path.join(out_dir, "row.json"), "w") as f:
        json.dump(row, f)


def arm_run(spec: dict) -> dict:
    """One arm at one level in a loopback-only namespace; its row (RuntimeError: why not)."""
    os.makedirs(spec["dir"], exist_ok=True)
    path = os.path.join(spec["dir"], "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    cmd = ["unshare", "-n", "sh", "-c",
           'ip link set lo up && exec "$0" -m perf.prefix.bench_trace --child "$1"',
           sys.executable, path]
    with open(os.path.join(spec["dir"], "child.log"), "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            rc = child.wait(timeout=spec["arm_timeout_s"] + 120)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            raise RuntimeError("past its deadline")
    row_path = os.path.join(spec["dir"], "row.json")
    if rc != 0 or not os.path.exists(row_path):
        with open(os.path.join(spec["dir"], "child.log")) as f:
            raise RuntimeError(f"exit {rc}: {f.read()[-800:]}")
    with open(row_path) as f:
        return dict(json.load(f))


# -- the report ------------------------------------------------------------------------------------

def medians(rows: list[dict]) -> dict[tuple[str, float], dict[str, float]]:
    out: dict[tuple[str, float], dict[str, float]] = {}
    for key in sorted({(r["arm"], r["speedup"]) for r in rows}):
        mine = [r for r in rows if (r["arm"], r["speedup"]) == key and "error" not in r]
        if mine:
            out[key] = {k: statistics.median(r[k] for r in mine) for k in mine[0]
                        if isinstance(mine[0][k], (int, float)) and k not in ("run", "speedup")}
            out[key]["n"] = len(mine)
    return out


def report(args: argparse.Namespace, rows: list[dict], meta: dict) -> str:
    med = medians(rows)
    lines = [
        f"# {_trace_title(args.trace)}: tandem's host tier and kv router against Dynamo 1.6.1's",
        "",
        f"`python -m perf.prefix.bench_trace {' '.join(meta['argv'])}`",
        "",
        f"{meta['date']}, {meta['machine']}; tree {meta['tree']}. Trace: the first "
        f"{args.requests} requests of {os.path.basename(args.trace)}, blocks of {args.block_tokens} "
        f"tokens (the trace's are 512), at most {args.max_blocks} blocks and {args.max_output} "
        f"output tokens; timestamps / speedup. {args.workers} workers, {args.num_pages} device "
        f"pages of {args.page_size} tokens each, host tier {args.host_pages} pages (the -host "
        f"arms); mock timing {args.prefill_us:g} µs per computed prompt token, decode step "
        f"{args.step_us:g} µs + {args.seq_us:g} µs per sequence; host loads at "
        f"{args.h2d_gbps:g} GB/s, {meta['kv_bytes_per_token']} KV bytes per token. "
        f"Medians of {args.runs} runs, arms in turn. AIPerf 0.13.0 as the client. An infinite "
        f"cache with perfect routing would not compute {meta['oracle_reuse']:.3f} of the "
        f"prompts' own tokens (the hit rate's ceiling here, before the chat template's "
        f"tokens).",
        "",
        "| arm | speedup | n | completed | failed % | TTFT p50 ms | TTFT p90 ms | prompt tokens "
        "| computed | hit rate | device hits | host hits | out tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (arm, sp), m in med.items():
        dev = f"{m['worker_device_hit_rate']:.3f}" if "worker_device_hit_rate" in m else "n/a"
        hst = f"{m['worker_host_hit_rate']:.3f}" if "worker_host_hit_rate" in m else "n/a"
        lines.append(
            f"| {arm} | {sp:g} | {m['n']:.0f} | {m['completed']:.0f} | {m['error_rate_pct']:.1f} "
            f"| {m['ttft_p50_ms']:.0f} | {m['ttft_p90_ms']:.0f} | {m['prompt_tokens']:.0f} | "
            f"{m['computed_tokens']:.0f} | {m['hit_rate']:.3f} | {dev} | {hst} | "
            f"{m['output_tok_s']:.0f} |")
    lines += ["", "Targets (medians):", ""]
    for sp in sorted({r["speedup"] for r in rows}):
        t, d = med.get(("tandem-host", sp)), med.get(("dynamo-host", sp))
        t0, d0 = med.get(("tandem", sp)), med.get(("dynamo", sp))
        if t and d and d["computed_tokens"]:
            r = t["computed_tokens"] / d["computed_tokens"]
            lines.append(f"- speedup {sp:g}: prompt tokens computed, tandem / Dynamo (host tiers "
                         f"on): {r:.2f} (target <= 0.8: {'met' if r <= 0.8 else 'NOT met'})")
        if t and d and t0 and d0 and t["ttft_p90_ms"] and d["ttft_p90_ms"]:
            gt, gd = t0["ttft_p90_ms"] / t["ttft_p90_ms"], d0["ttft_p90_ms"] / d["ttft_p90_ms"]
            lines.append(f"- speedup {sp:g}: TTFT p90 gain from the host tier (off / on): tandem "
                         f"{gt:.2f}x, Dynamo {gd:.2f}x (target: tandem's >= Dynamo's: "
                         f"{'met' if gt >= gd else 'NOT met'})")
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "Runs that failed:", ""]
        lines += [f"- {r['arm']} speedup {r['speedup']:g} run {r['run']}: {r['error'][:300]}"
                  for r in failed]
    return "\n".join(lines) + "\n"


def _trace_title(path: str) -> str:
    name = os.path.basename(path)
    if name == "conversation_trace.jsonl":
        return "Mooncake's conversation trace"
    if name.startswith("qa_trace"):
        return "LMCache's multi-round QA shape (perf.prefix.qa_trace)"
    return name


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        meta, ran = saved["meta"], argparse.Namespace(**saved["args"])
        if "oracle_reuse" not in meta:
            with open(args.trace) as f:
                lines = [json.loads(ln) for _, ln in zip(range(ran.requests), f)]
            meta["oracle_reuse"] = oracle_reuse(scaled(
                lines, ran.block_tokens, ran.max_blocks, ran.max_output, 1.0),
                ran.block_tokens)
        with open(args.out + ".md", "w") as f:
            f.write(report(ran, saved["rows"], meta))
        return
    with open(args.trace) as f:
        lines = [json.loads(ln) for _, ln in zip(range(args.requests), f)]
    work = tempfile.mkdtemp(prefix="bench-trace-")
    levels = [float(s) for s in args.speedups.split(",") if s]
    traces = {}
    for sp in levels:
        traces[sp] = os.path.join(work, f"trace_x{sp:g}.jsonl")
        with open(traces[sp], "w") as f:
            for ln in scaled(lines, args.block_tokens, args.max_blocks, args.max_output, sp):
                f.write(json.dumps(ln) + "\n")
    arms = [a for a in args.arms.split(",") if a]
    reuse = oracle_reuse(scaled(lines, args.block_tokens, args.max_blocks, args.max_output, 1.0),
                         args.block_tokens)
    meta = {"argv": sys.argv[1:] if argv is None else argv,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} cores", "oracle_reuse": reuse, "kv_bytes_per_token":
            kv_bytes_per_token(args.model), "tree": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                text=True).stdout.strip()}
    base = {k: getattr(args, k) for k in (
        "model", "model_name", "workers", "page_size", "num_pages", "host_pages", "max_batch",
        "prefill_us", "step_us", "seq_us", "h2d_gbps", "aiperf", "hf_home", "tokenizer",
        "dynamo_python", "block_tokens", "arm_timeout_s", "tandem_frontend_args")}
    base["kv_bytes_per_token"] = meta["kv_bytes_per_token"]
    rows: list[dict] = []
    for run in range(args.runs):
        order = arms[run % len(arms):] + arms[:run % len(arms)]
        for sp in levels:
            for arm in order:
                d = os.path.join(work, f"{arm}_x{sp:g}_r{run}")
                t0 = time.monotonic()
                try:
                    row = arm_run({**base, "arm": arm, "trace_file": traces[sp], "dir": d})
                except RuntimeError as e:
                    row = {"error": str(e)}
                row.update(arm=arm, speedup=sp, run=run)
                rows.append(row)
                print(f"{arm} x{sp:g} run {run} ({time.monotonic() - t0:.0f} s): " + (
                    row.get("error", "")[:200] or
                    f"TTFT p50 {row['ttft_p50_ms']:.0f} p90 {row['ttft_p90_ms']:.0f} ms, "
                    f"computed {row['computed_tokens']:.0f} of {row['prompt_tokens']:.0f}, "
                    f"completed {row['completed']:.0f}, failed {row['error_rate_pct']:.1f}%"),
                    flush=True)
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out + ".json", "w") as f:
                    json.dump({"meta": meta, "args": vars(args), "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(report(args, rows, meta))
    print(f"logs: {work}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        main()
