"""Prefix-aware routing, measured: tandem's router policies (round-robin, least-loaded, prefix, kv)
on identical mock workers (4 aggregated, and 2P2D), and NVIDIA Dynamo 1.6.1's frontend (kv and
round-robin) over its mocker, side by side in one run: the same client, the same requests at the
same times, across a load ladder from light load to past saturation.

    .venv/bin/python -m perf.prefix.bench_prefix --runs 2 --out perf/results/prefix_routing

(Dynamo from its own venv, outside the repository: `python3.11 -m venv /work/dynamo-venv &&
/work/dynamo-venv/bin/pip install --no-deps ai-dynamo==1.6.1 && /work/dynamo-venv/bin/pip install
ai-dynamo-runtime==1.6.1 'aiohttp<4,>=3.14.3' 'kubernetes<33,>=32.0.1' msgspec prometheus-client
pyzmq 'redis<9,>=6.2' tqdm 'transformers>=4.56' typing-extensions zstandard uvloop`; its arms need
root or user namespaces for `unshare -n`; without either they are skipped and the reason recorded.)

Workloads (perf/prefix/prefix_workloads.py): `shared` (G groups of long system prompts, short questions,
interleaved), `multiturn` (sessions whose history grows each turn, think time between turns, the
session in X-Session-ID / X-Dynamo-Session-ID / `user`), `uniform` (no shared prefix: the control).
Load: open loop, Poisson arrivals at each offered rate (requests/s; multi-turn sessions start at
rate / mean turns): a user population does not wait for the server, and only an open loop can
push past saturation, fill the router's queue and show 503s; a closed loop would slow down with
the server and hide its queueing (coordinated omission).

Per arm, workload and level: TTFT p50/p90/p99, ITL p50, output tok/s, cache hit rate (usage's
cached_tokens / prompt tokens, and tandem's workers' own counters), the oracle hit rate (shared),
the 503 rate (counted, never retried), the frontend's CPU per request (psutil), the router's own KV
time per request (tandem: tandem_router_kv_seconds_total by part; Dynamo:
dynamo_router_overhead_total_ms). Writes OUT.json (every run's rows), OUT.md (medians, the targets
checked) and OUT.png; `--report OUT.json` rewrites the last two from a saved OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields

import psutil

from perf.prefix import prefix_report as R
from perf.prefix import prefix_workloads as W
from perf.prefix.prefix_arms import dynamo_arm, tandem_arm

POLICIES = ("round-robin", "least-loaded", "prefix", "kv")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m perf.prefix.bench_prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="models/tiny", help="model directory (tokenizer; served name = its "
      "last part) (default: models/tiny; `tandem model init models/tiny` makes it)")
    a("--workloads", default="shared,multiturn,uniform", help="comma-separated, of "
      f"{','.join(W.WORKLOADS)} (default: all)")
    a("--rates", default="8,32,56,72,88", help="the load ladder: offered requests/s per level, "
      "lightest first (the first is the light-load reference) (default: 8,32,56,72,88)")
    a("--runs", type=int, default=2, help="runs of every arm, interleaved: run 1 of every arm, "
      "then run 2, ...; each run takes the arms in a rotated order (default: 2)")
    a("--shapes", default="4agg,2p2d", help="tandem cluster shapes (default: 4agg,2p2d)")
    a("--policies", default=",".join(POLICIES), help="tandem --router-policy arms (default: "
      "round-robin,least-loaded,prefix,kv; kv is skipped, said so, where this tree lacks it)")
    a("--pd-workloads", default="shared,multiturn,uniform",
      help="workloads the 2P2D shape runs (default: all)")
    a("--dynamo-modes", default="kv,round-robin", help="Dynamo frontend --router-mode arms, "
      "4 mocker workers; '' for none (default: kv,round-robin)")
    a("--dynamo-python", default="/work/dynamo-venv/bin/python",
      help="python of the venv holding ai-dynamo 1.6.1 (default: /work/dynamo-venv/bin/python)")
    a("--dynamo-workloads", default="shared,multiturn,uniform",
      help="workloads the Dynamo arms run (default: all)")
    a("--max-tokens", type=int, default=32, help="completion tokens per request (ignore_eos) "
      "(default: 32)")
    a("--num-pages", type=int, default=600, help="KV pages (blocks) per worker, tandem's "
      "--num-pages and the mocker's --num-gpu-blocks-override: small enough that a worker holds "
      "about half the groups' prefixes (default: 600)")
    a("--frontend-args", default="", help="more flags for tandem's frontend, as one string "
      "(e.g. '--kv-decode-weight 16': the kv policy's knobs) (default: none)")
    a("--max-batch", type=int, default=64, help="running requests per worker: tandem's "
      "--max-batch, the mocker's --max-num-seqs (default: 64)")
    a("--prefill-us-per-token", type=float, default=50.0, help="mock timing: µs per computed "
      "prompt token (both systems) (default: 50)")
    a("--decode-step-us", type=float, default=10000.0, help="mock timing: µs per decode step "
      "(default: 10000)")
    a("--decode-us-per-seq", type=float, default=100.0, help="mock timing: µs per running "
      "sequence per decode step (default: 100)")
    a("--timeout", type=float, default=120.0, help="client deadline per request, s (default: 120)")
    a("--seed", type=int, default=1, help="workload seed (each level's is derived from it)")
    d = W.Params()
    for f in fields(W.Params):
        if f.name in ("vocab", "mock_vocab", "mock_eos"):
            continue
        a("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)),
          default=getattr(d, f.name), help=f"workload: {f.name} (default: {getattr(d, f.name)})")
    a("--out", default="perf/results/prefix_routing", help="output path without extension")
    a("--report", default="", help="only rewrite OUT.md and OUT.png from this saved OUT.json")
    return p.parse_args(argv)


def machine_snapshot() -> dict:
    """What else was using this machine: load average and the busiest processes not ours."""
    mine = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    procs = [p for p in psutil.process_iter(["pid", "name", "cmdline"]) if p.pid not in mine]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(1.0)
    busy = []
    for p in procs:
        try:
            c = p.cpu_percent(None)
        except psutil.Error:
            continue
        if c >= 5:
            busy.append({"pid": p.pid, "cpu_pct": c,
                         "cmd": " ".join(p.info["cmdline"] or [p.info["name"] or ""])[:120]})
    return {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg": os.getloadavg(),
            "cpus": os.cpu_count(), "busy_others": sorted(busy, key=lambda x: -x["cpu_pct"])}


def tree() -> str:
    """The commit this tree is at, and whether its files differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "-uno"], check=True,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return head + (" with uncommitted changes" if dirty else "")


def plan(args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[str]]:
    """[(arm, workload)] to run each run, and what is skipped and why."""
    from tandem.config import ROUTER_POLICIES

    wls = [w for w in args.workloads.split(",") if w]
    skipped, arms = [], []
    for shape in [s for s in args.shapes.split(",") if s]:
        for pol in [x for x in args.policies.split(",") if x]:
            if pol not in ROUTER_POLICIES:
                skipped.append(f"tandem {shape} {pol}: this tree's frontend has no "
                               f"--router-policy {pol} (choices: {', '.join(ROUTER_POLICIES)})")
                continue
            for wl in wls:
                if shape.endswith("agg") or wl in args.pd_workloads.split(","):
                    arms.append((f"tandem:{shape}:{pol}", wl))
    modes = [m for m in args.dynamo_modes.split(",") if m]
    why = ""
    if modes and not os.access(args.dynamo_python, os.X_OK):
        why = f"no Dynamo venv at {args.dynamo_python}"
    elif modes and not shutil.which("unshare"):
        why = "no `unshare` (Dynamo's event sockets bind 0.0.0.0: run only in a private netns)"
    for m in modes:
        if why:
            skipped.append(f"dynamo {m}: {why}")
            continue
        arms += [(f"dynamo:4agg:{m}", wl) for wl in wls if wl in args.dynamo_workloads.split(",")]
    return arms, skipped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        write(args.report.removesuffix(".json"), saved)
        return 0
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    params = W.Params(vocab=vocab, answer_tokens=args.max_tokens,
                      **{f.name: getattr(args, f.name) for f in fields(W.Params)
                         if f.name not in ("vocab", "answer_tokens")})
    rates = [float(x) for x in args.rates.split(",")]
    # a SIGTERM unwinds (each arm's `finally` stops its cluster) instead of orphaning the cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    arms, skipped = plan(args)
    for s in skipped:
        print("skipped:", s, flush=True)
    worker_args = ["--mock-prefill-us-per-token", f"{args.prefill_us_per_token:g}",
                   "--mock-decode-step-us", f"{args.decode_step_us:g}",
                   "--mock-decode-us-per-seq", f"{args.decode_us_per_seq:g}",
                   "--max-batch", str(args.max_batch), "--num-pages", str(args.num_pages)]
    spec = {"model": os.path.abspath(args.model),
            "model_name": args.model.rstrip("/").rsplit("/", 1)[-1],
            "params": asdict(params), "max_tokens": args.max_tokens, "timeout_s": args.timeout,
            "tandem_worker_args": worker_args,
            "tandem_frontend_args": shlex.split(args.frontend_args), "num_pages": args.num_pages,
            "max_batch": args.max_batch, "dynamo_python": args.dynamo_python,
            "dynamo_workers": 4, "tree": tree(),
            "timing": {"prefill_us": args.prefill_us_per_token, "step_us": args.decode_step_us,
                       "seq_us": args.decode_us_per_seq}}
    saved = {"argv": sys.argv[1:] if argv is None else argv, "spec": spec,
             "machine_before": machine_snapshot(), "skipped": skipped, "runs": []}
    print("others on this machine:", saved["machine_before"], flush=True)
    logs = tempfile.mkdtemp(prefix="tandem-bench-prefix-")
    print(f"logs in {logs}", flush=True)
    for run in range(args.runs):
        k = run % max(1, len(arms))
        for i, (arm, wl) in enumerate(arms[k:] + arms[:k]):
            levels = [(li, rate, W.level_seed(args.seed, wl, li)) for li, rate in enumerate(rates)]
            system, shape, policy = arm.split(":")
            print(f"== run {run + 1}/{args.runs}: {arm} {wl}", flush=True)
            log_dir = os.path.join(logs, f"{run}-{i}-{arm.replace(':', '-')}-{wl}")
            t0 = time.monotonic()
            try:
                if system == "tandem":
                    rows = tandem_arm(spec, shape, policy, wl, levels, log_dir)
                else:
                    budget = sum(W.level_requests(params, r) / r for r in rates) + \
                        len(rates) * (params.turns_max * params.think_s * 3 + 60) + 180
                    rows = dynamo_arm(spec, policy, wl, levels, log_dir, budget)
            except Exception as e:  # one arm failing is recorded, the rest still run
                print(f"   failed: {e}", flush=True)
                saved.setdefault("failures", []).append(f"run {run + 1} {arm} {wl}: {e}"[:800])
                continue
            saved["runs"].append({"run": run + 1, "arm": arm, "workload": wl, "rows": rows,
                                  "seconds": time.monotonic() - t0})
            with open(args.out + ".json", "w") as f:
                json.dump(saved, f, indent=1)
    saved["machine_after"] = machine_snapshot()
    write(args.out, saved)
    return 0


def write(out: str, saved: dict) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(saved, f, indent=1)
    spec = saved["spec"]
    mb = saved.get("machine_before", {})
    header = [
        "# Prefix-aware routing: tandem's policies and Dynamo 1.6.1's, same client, same traffic",
        "", f"`python -m perf.prefix.bench_prefix {' '.join(saved['argv'])}`", "",
        f"(tandem at {spec.get('tree', '?')}; {mb.get('when', '?')}, {mb.get('cpus', '?')} CPUs, "
        f"load average before "
        f"{tuple(round(x, 2) for x in mb.get('loadavg', ()))}; other busy processes before: "
        f"{_others(mb)}; after: {_others(saved.get('machine_after', {}))})", "",
        f"Workers: mock timing {spec['timing']}, {spec['num_pages']} KV pages of "
        f"{spec['params']['page_size']} tokens and {spec['max_batch']} running requests per "
        f"worker; {spec['max_tokens']} output tokens per request; workload {spec['params']}.",
    ]
    if spec.get("tandem_frontend_args"):
        flags = " ".join(spec["tandem_frontend_args"])
        header.append(f"tandem's frontend also ran with `{flags}`.")
    header += [f"Failed: {x}" for x in saved.get("failures", [])]
    text = R.markdown(saved["runs"], header, saved.get("skipped", []))
    with open(out + ".md", "w") as f:
        f.write(text)
    print(text)
    if saved["runs"]:
        import matplotlib

        matplotlib.use("Agg")
        R.plot(saved["runs"]).savefig(out + ".png", dpi=80)
        print(f"wrote {out}.json .md .png")


def _others(m: dict) -> str:
    b = m.get("busy_others")
    if b is None:
        return "?"
    return "; ".join(f"{x['cmd'][:60]} ({x['cpu_pct']:.0f}%)" for x in b[:4]) or "none"


if __name__ == "__main__":
    sys.exit(main())
