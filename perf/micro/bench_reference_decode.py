"""The reference engine's decode cost per token, short vs long outputs: does it grow with length?

The model's compute is replaced by a stub that samples a fixed token after `--step-ms` of sleep,
as a model step would take, but costing no CPU (the public `compute_hook`; on the pre-redesign
code, its `_compute`), so what is measured is everything around it: scheduling, postprocessing, the hand-over to the event loop, and delivery to a consumer
that does what the worker does with every output (DeltaMaker). `--streams` requests of `--tokens`
tokens each run at once; the figure is process CPU-µs per token (median of `--repeat` runs).
An engine that copies a request's whole id list into every output costs O(length) per token, so
its figure for 512 tokens is far above its figure for 16; one that hands out one growing list
(or only the new ids) costs the same per token at any length.

It runs against whichever tandem is first on sys.path, so the same command measures another
checkout side by side:

    .venv/bin/python perf/micro/bench_reference_decode.py
    git worktree add /tmp/tandem-base 7e51940
    PYTHONPATH=/tmp/tandem-base/runtime:/tmp/tandem-base/components \\
        .venv/bin/python perf/micro/bench_reference_decode.py --label before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

from tandem.engines.base import EngineOutput, EngineRequest
from tandem.engines.reference import ReferenceEngine, write_tiny_model
from tandem.worker.deltas import DeltaMaker

try:
    from tandem.runtime.wire import SamplingParams
except ImportError:  # the pre-redesign tree
    from tandem.runtime.protocol import SamplingParams  # type: ignore[no-redef]

TOKEN = 7
STEP_S = 0.001


def stub(batch: Any, compute: Any = None) -> list[int]:
    time.sleep(STEP_S)  # paced like a model step, so a consumer keeps up (one output per step)
    return [TOKEN] * (len(batch.prefill) + len(batch.decode))


async def run_new(engine: Any, reqs: list[EngineRequest], mode: str) -> int:
    makers = {r.rid: DeltaMaker(r.rid, mode) for r in reqs}  # type: ignore[arg-type]
    left = {r.rid for r in reqs}
    done = asyncio.Event()

    class Sink:
        def on_step(self, outputs: list[EngineOutput]) -> None:
            for out in outputs:
                makers[out.rid].make(out)
                if out.finish_reason is not None:
                    left.discard(out.rid)
            if not left:
                done.set()

    sink = Sink()
    for r in reqs:
        engine.submit(r, sink)
    await asyncio.wait_for(done.wait(), 300)
    return sum(m.sent for m in makers.values())


async def run_old(engine: Any, reqs: list[EngineRequest], mode: str) -> int:
    async def one(r: EngineRequest) -> int:
        maker = DeltaMaker(r.rid, mode)  # type: ignore[arg-type]
        async for out in engine.generate(r):
            maker.make(out)
        return maker.sent

    return sum(await asyncio.gather(*(one(r) for r in reqs)))


async def measure(model: str, mode: str, streams: int, tokens: int, repeat: int) -> float:
    engine = ReferenceEngine(model, page_size=16, max_batch=streams, output_mode=mode)  # type: ignore[arg-type]
    new = hasattr(engine, "submit")
    if new:
        engine.compute_hook = stub
    else:
        engine._compute = stub  # the pre-redesign engine has no public hook
    await engine.start()
    per_token: list[float] = []
    try:
        for rep in range(repeat + 1):  # rep 0 warms up
            sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
            reqs = [EngineRequest(f"r{rep}-{i}", [1, 2, 3, i + 4], sp) for i in range(streams)]
            c0 = time.process_time()
            n = await (run_new if new else run_old)(engine, reqs, mode)
            cpu = time.process_time() - c0
            assert n == streams * tokens, n
            if rep:
                per_token.append(cpu / n * 1e6)
    finally:
        await engine.shutdown()
    return statistics.median(per_token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 512, 2000])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["cumulative", "incremental"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--label", default="after")
    ap.add_argument("--step-ms", type=float, default=1.0)
    args = ap.parse_args()
    global STEP_S
    STEP_S = args.step_ms / 1e3
    with tempfile.TemporaryDirectory() as d:
        write_tiny_model(d, seed=0)
        for mode in args.modes:
            row: dict[str, Any] = {"label": args.label, "mode": mode, "streams": args.streams,
                                   "step_ms": args.step_ms}
            for n in args.tokens:
                row[f"cpu_us_per_token_{n}"] = round(
                    asyncio.run(measure(d, mode, args.streams, n, args.repeat)), 2)
            # Growth between the two longest (the shortest also carries the prefill's cost).
            lo, hi = (row[f"cpu_us_per_token_{n}"] for n in args.tokens[-2:])
            row["growth"] = round(hi / lo, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
