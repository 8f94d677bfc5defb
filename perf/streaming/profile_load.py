"""Where the time goes under load: launch a mock-engine cluster, hold a fixed concurrency of streams,
and sample every process with py-spy (`pip install py-spy`; needs ptrace rights over our own
children). Prints the top functions by self and by inclusive samples per process and writes the
collapsed stacks under --out.

    python -m perf.streaming.profile_load --launch 1p1d --concurrency 256 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import subprocess
import sys
import tempfile

from perf.common.launch import SHAPES, launch
from perf.streaming.load import LoadSpec, check, run_level


def top(collapsed_path: str, n: int) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """(total samples, top self frames, top inclusive frames) from py-spy's raw format."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(collapsed_path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            k = int(count)
            total += k
            frames = stack.split(";")
            own[frames[-1]] += k
            for fr in set(frames):
                incl[fr] += k
    return total, own.most_common(n), incl.most_common(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.streaming.profile_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", choices=SHAPES, default="1p1d")
    p.add_argument("--model", default="models/tiny")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0, help="sampling time")
    p.add_argument("--rate", type=int, default=200, help="samples per second")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--worker-args", default="--max-batch 4096")
    p.add_argument("--out", default="perf/results/profile")
    p.add_argument("--perf", action="store_true",
                   help="sample with Linux `perf record` instead of py-spy: CPU time only, "
                        "kernel included; prints each process's split by shared object")
    args = p.parse_args(argv)
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(args.out, exist_ok=True)
    cluster = launch(args.launch, args.model, tempfile.mkdtemp(prefix="tandem-prof-"),
                     args.worker_args.split(), [])
    try:
        host, port = cluster.url.removeprefix("http://").split(":")
        spec = LoadSpec(host, int(port), model=os.path.basename(args.model.rstrip("/")),
                        max_tokens=args.max_tokens)

        async def go() -> list[str]:
            load = asyncio.create_task(run_level(spec, args.concurrency,
                                                 duration_s=args.seconds + 4))
            await asyncio.sleep(2)  # past the ramp
            if args.perf:
                spies = [await asyncio.create_subprocess_exec(
                    "perf", "record", "-F", "999", "-g", "-p", str(proc.pid),
                    "-o", os.path.join(args.out, f"{name}.perf"), "--", "sleep",
                    str(int(args.seconds)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for name, proc in cluster.procs.items()]
            else:
                spies = [await asyncio.create_subprocess_exec(
                    spy, "record", "--pid", str(proc.pid), "--duration", str(int(args.seconds)),
                    "--rate", str(args.rate), "--format", "raw", "--nonblocking",
                    "-o", os.path.join(args.out, f"{name}.txt"),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for name, proc in cluster.procs.items()]
            await asyncio.gather(*(s.wait() for s in spies))
            level = await load
            return [why for r in level.results if (why := check(r, spec, None))]

        failures = asyncio.run(go())
    finally:
        cluster.stop()
    print(f"{args.launch}, concurrency {args.concurrency}, {len(failures)} failed streams")
    if args.perf:
        for name in cluster.procs:
            report = subprocess.run(
                ["perf", "report", "-i", os.path.join(args.out, f"{name}.perf"), "--stdio",
                 "--no-children", "--sort", "dso", "-g", "none"],
                capture_output=True, text=True).stdout
            rows = [ln.strip() for ln in report.splitlines() if ln.strip()[:1].isdigit()]
            print(f"\n== {name}: CPU by shared object ==")
            print("\n".join(rows[:8]))
        return 0
    for name in cluster.procs:
        path = os.path.join(args.out, f"{name}.txt")
        if not os.path.exists(path):
            print(f"\n{name}: no samples (py-spy failed?)")
            continue
        total, own, incl = top(path, args.top)
        print(f"\n== {name}: {total} samples ==\n-- self --")
        for fr, k in own:
            print(f"{100 * k / total:5.1f}%  {fr}")
        print("-- inclusive --")
        for fr, k in incl:
            print(f"{100 * k / total:5.1f}%  {fr}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
