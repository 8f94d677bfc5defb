"""tandem's overhead around SGLang's engine: the same SGLang CPU engine and model under SGLang's own
HTTP server (and, for 1P1D, SGLang's own router) and under tandem (frontend and `--engine sglang`
workers), side by side in one run, the same client (perf.load), prompts and levels as
perf.peers.bench_vllm: streamed tokens/s, TTFT and inter-token latency per concurrency.

    .venv/bin/python -m perf.peers.bench_sglang --router-python ~/peers/sglang-router/bin/python \\
        --model models/smollm2 --concurrency 1,4,16 --runs 3 \\
        --out perf/results/peers/sglang_overhead

Both systems get the engine flags tandem's adapter gives SGLang's CPU engine
(tandem.engines.sglang_cpu) plus `--engine-flags` (default: bfloat16, SGLang's fast path on a CPU,
and a 4,096-token pool). They never run at once: per run and shape one starts, serves every level
and stops, then the other; the order flips every run. Writes OUT.json and OUT.md (medians,
tandem / SGLang).
"""

from __future__ import annotations

import argparse
import os
import time

from perf.common.launch import launch as launch_tandem
from perf.peers import sglang
from perf.peers.bench_vllm import measure, side_by_side

PAGE_SIZE = 16  # tandem's default page size, given to SGLang's own server too


def one(system: str, shape: str, levels: list[int], args: argparse.Namespace,
        log_dir: str) -> list[dict]:
    t0 = time.monotonic()
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
    else:
        s = sglang.launch(shape, os.path.abspath(args.model),
                          os.path.join(log_dir, f"sglang-{shape}"),
                          ["--page-size", str(PAGE_SIZE), *flags], args.router_python)
        url, model, stop = s.url, os.path.abspath(args.model), s.stop
    print(f"  {system} {shape}: up in {time.monotonic() - t0:.0f} s", flush=True)
    try:
        return measure(url, model, levels, args)
    finally:
        stop()


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
    p.add_argument("--out", default="perf/results/peers/sglang_overhead")
    args = p.parse_args()
    if "1p1d" in args.shapes.split(",") and not args.router_python:
        p.error("1p1d needs --router-python (SGLang's router, in a venv of its own)")
    side_by_side(args, "sglang", "SGLang", one, "python -m perf.peers.bench_sglang",
                 "tandem around SGLang's CPU engine vs SGLang's own server, "
                 "SmolLM2-135M-Instruct", skip=("router_python",))


if __name__ == "__main__":
    main()
