"""tandem's overhead around SGLang's engine: the same SGLang CPU engine and model under SGLang's own
HTTP server (and, for 1P1D, SGLang's own router) and under tandem (frontend and `--engine sglang`
workers), side by side in one run, the same client (perf.load), prompts and levels as
perf.peers.bench_vllm: streamed tokens/s, TTFT and inter-token latency per concurrency.

    .venv/bin/python -m perf.peers.bench_sglang --router-python ~/peers/sglang-router/bin/python \\
        --model models/smollm2 --concurrency 1,4,16 --runs 3 \\
        --out perf/results/peers/sglang_overhead

Both systems get the engine flags tandem's adapter gives SGLang's CPU engine
(tandem.engines.sglang_cpu) plus `--engine-flags` (default: bfloat16, SGLang's fast path on a CPU,
and a 4,096-token pool). They never serve at once: per run and shape one starts, serves every
level and stops, then the other; the order flips every run. Writes OUT.json and OUT.md (medians,
tandem / SGLang).

With `--interleave` both stay up (an idle one takes about 0.01 of a core) and each level is
measured in `--windows` windows of `--seconds-per-level`, the systems in turn; OUT.md adds the
median of the ratios of windows side by side in time. On this shared host the machine's speed
drifts by 20-30% over minutes, more than the difference measured, so pairs close in time are
the comparison that holds:

    .venv/bin/python -m perf.peers.bench_sglang --shapes agg --interleave --windows 6 \
        --seconds-per-level 15 --out perf/results/peers/sglang_overhead_interleaved
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import psutil

from perf.common.launch import launch as launch_tandem
from perf.peers import sglang
from perf.peers.bench_vllm import METRICS, bodies, measure, report, run_meta, side_by_side
from perf.streaming.load import LoadSpec, run, run_level
from perf.streaming.sweep import summarize

PAGE_SIZE = 16  # tandem's default page size, given to SGLang's own server too


def up(system: str, shape: str, args: argparse.Namespace,
       log_dir: str) -> tuple[str, str, Callable[[], None], dict[str, int]]:
    """One system serving `shape`: its URL, the model name it serves, how to stop it and its
    processes (name -> PID; SGLang's are children of them)."""
    flags = args.engine_flags.split()
    tokens = int(flags[flags.index("--max-total-tokens") + 1])
    if system == "tandem":
        os.environ.update(sglang.ENV)
        engine_flags = [f for i, f in enumerate(flags) if f != "--max-total-tokens"
                        and (i == 0 or flags[i - 1] != "--max-total-tokens")]
        c = launch_tandem(shape, args.model, os.path.join(log_dir, f"tandem-{shape}"),
                          worker_args=["--device", "cpu", "--num-pages", str(tokens // PAGE_SIZE),
                                       *engine_flags],
                          frontend_args=[], ready_timeout_s=600, engine="sglang")
        url, model, stop = c.url, os.path.basename(args.model.rstrip("/")), c.stop
        roots = {f"tandem {name}": p.pid for name, p in c.procs.items()}
    else:
        s = sglang.launch(shape, os.path.abspath(args.model),
                          os.path.join(log_dir, f"sglang-{shape}"),
                          ["--page-size", str(PAGE_SIZE), *flags], args.router_python)
        url, model, stop = s.url, os.path.abspath(args.model), s.stop
        roots = {f"sglang {name}": p.pid for name, p in s.procs.items()}
    return url, model, stop, roots


def cpu_s(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process under `roots`, a child named by its
    process name under its root's (SGLang titles its own: sglang::scheduler, ...)."""
    out: dict[str, float] = {}
    for name, pid in roots.items():
        try:
            root = psutil.Process(pid)
            procs = [(name, root), *((f"{name}/{p.name()}", p)
                                     for p in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            continue
        for label, p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            out[label] = out.get(label, 0.0) + t.user + t.system
    return out


def one(system: str, shape: str, levels: list[int], args: argparse.Namespace,
        log_dir: str) -> list[dict]:
    t0 = time.monotonic()
    url, model, stop, _ = up(system, shape, args, log_dir)
    print(f"  {system} {shape}: up in {time.monotonic() - t0:.0f} s", flush=True)
    try:
        return measure(url, model, levels, args)
    finally:
        stop()


def interleaved(args: argparse.Namespace) -> list[dict]:
    """Both systems up at once (an idle SGLang scheduler sleeps: --sleep-on-idle), and per shape
    and level `--windows` windows of `--seconds-per-level` each, the systems in turn (the order
    flips every window). The machine's speed drifts over minutes on a shared host; two windows
    side by side in time see the same machine, so the ratio of each pair is what is compared
    (the median of the pairs), beside the medians of each system's windows."""
    levels = [int(x) for x in args.concurrency.split(",")]
    log_dir = tempfile.mkdtemp(prefix="bench-sglang-")
    meta = run_meta(args, "python -m perf.peers.bench_sglang",
                    ("router_python", "runs", "requests_per_level"), log_dir)
    rows: list[dict] = []
    for shape in args.shapes.split(","):
        served: dict[str, tuple[LoadSpec, list[bytes], dict[str, int]]] = {}
        stops = []
        try:
            for system in ("tandem", "sglang"):
                t0 = time.monotonic()
                url, model, stop, roots = up(system, shape, args, log_dir)
                stops.append(stop)
                print(f"  {system} {shape}: up in {time.monotonic() - t0:.0f} s", flush=True)
                host, port = url.removeprefix("http://").split(":")
                served[system] = (LoadSpec(host, int(port), api="chat", model=model,
                                           max_tokens=args.max_tokens, timeout_s=600),
                                  bodies(model, args.max_tokens), roots)

            async def go() -> None:
                for spec, each, _ in served.values():
                    await run_level(spec, 2, requests=4, bodies=each)  # warm-up
                for c in levels:
                    for w in range(args.windows):
                        order = ("tandem", "sglang") if w % 2 == 0 else ("sglang", "tandem")
                        for system in order:
                            spec, each, roots = served[system]
                            before, t0 = cpu_s(roots), time.monotonic()
                            level = await run_level(spec, c, duration_s=args.seconds_per_level,
                                                    bodies=each)
                            wall = time.monotonic() - t0
                            used = {k: v - before.get(k, 0.0) for k, v in cpu_s(roots).items()}
                            row = summarize(level, spec, None)
                            rows.append({**row, "system": system, "shape": shape, "run": w,
                                         "cpu_cores": {k: v / wall for k, v in used.items()}})
                            print(f"    {shape} c={c:<3} window {w + 1} {system:7s} "
                                  f"{row['tokens_per_s']:7.1f} tok/s  TTFT p50 "
                                  f"{row['ttft_p50_ms']:7.1f} ms  ITL p50 "
                                  f"{row['itl_p50_ms']:6.1f} ms  failed {row['failed']}",
                                  flush=True)
                        with open(args.out + ".json", "w") as f:
                            json.dump({"meta": meta, "rows": rows}, f, indent=1)

            run(go())
        finally:
            for stop in reversed(stops):
                stop()
    shapes = args.shapes.split(",")
    table = report(rows, levels, shapes, "sglang", "SGLang")
    pairs = paired(rows, levels, shapes)
    cpu = cpu_table(rows, levels, shapes)
    with open(args.out + ".md", "w") as f:
        f.write(f"# tandem around SGLang's CPU engine vs SGLang's own server, interleaved\n\n"
                f"`{meta['command']}`\n\n{args.windows} windows of {args.seconds_per_level:g} s "
                f"per system and level, the systems in turn. Medians of each system's windows "
                f"(ratio = tandem / SGLang):\n\n{table}\n\nThe median of the ratios of "
                f"windows side by side in time (each pair saw the same machine):\n\n{pairs}\n"
                f"\nCPU of each process while its system served (cores, the median of the "
                f"windows; processes under 0.005 left out):\n\n{cpu}\n")
    print(table, pairs, cpu, sep="\n\n")
    return rows


def cpu_table(rows: list[dict], levels: list[int], shapes: list[str]) -> str:
    out = ["| shape | c | process | cores |", "|---|---|---|---|"]
    for shape in shapes:
        for c in levels:
            mine = [r for r in rows if r["shape"] == shape and r["concurrency"] == c]
            for name in sorted({k for r in mine for k in r.get("cpu_cores", {})}):
                cores = statistics.median(r["cpu_cores"].get(name, 0.0) for r in mine
                                          if name.split()[0] == r["system"])
                if cores >= 0.005:
                    out.append(f"| {shape} | {c} | {name} | {cores:.3f} |")
    return "\n".join(out)


def paired(rows: list[dict], levels: list[int], shapes: list[str]) -> str:
    """Per shape and level, the median over windows of tandem / SGLang (with the range)."""
    out = ["| shape | c | " + " | ".join(label for _, label, _ in METRICS) + " |",
           "|---|---|" + "---|" * len(METRICS)]
    for shape in shapes:
        for c in levels:
            cells = []
            for key, _, _ in METRICS:
                by = {(r["system"], r["run"]): r[key] for r in rows
                      if r["shape"] == shape and r["concurrency"] == c}
                ratios = [by["tandem", w] / by["sglang", w] for (s, w) in by
                          if s == "tandem" and ("sglang", w) in by and by["sglang", w]]
                cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-"
                             f"{max(ratios):.2f})" if ratios else "-")
            out.append(f"| {shape} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router-python", default="",
                   help="python of the venv sglang-router is installed in (1P1D only)")
    p.add_argument("--model", default="models/smollm2", help="checkpoint directory both serve")
    p.add_argument("--engine-flags", default="--dtype bfloat16 --max-total-tokens 4096",
                   help="SGLang flags both systems' engines get (--max-total-tokens required: "
                   "tandem's workers take it as --num-pages)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--shapes", default="agg,1p1d")
    p.add_argument("--runs", type=int, default=3, help="runs (medians are over these)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-level", type=int, default=16,
                   help="requests per level (at least 2 x concurrency)")
    p.add_argument("--seconds-per-level", type=float, default=0.0,
                   help="instead: each level issues requests for this long")
    p.add_argument("--interleave", action="store_true",
                   help="both systems up at once, each level measured in --windows windows of "
                   "--seconds-per-level, the systems in turn (instead of --runs runs)")
    p.add_argument("--windows", type=int, default=6, help="windows per level (--interleave)")
    p.add_argument("--out", default="perf/results/peers/sglang_overhead")
    args = p.parse_args()
    if "1p1d" in args.shapes.split(",") and not args.router_python:
        p.error("1p1d needs --router-python (SGLang's router, in a venv of its own)")
    if args.interleave:
        if args.seconds_per_level <= 0:
            p.error("--interleave needs --seconds-per-level (each window's length)")
        interleaved(args)
        return
    side_by_side(args, "sglang", "SGLang", one, "python -m perf.peers.bench_sglang",
                 "tandem around SGLang's CPU engine vs SGLang's own server, "
                 "SmolLM2-135M-Instruct", skip=("router_python",))


if __name__ == "__main__":
    main()
