"""The frontend's own CPU per streamed token, one process, no sockets: the real FrontendApp over a
real WorkerPool whose one worker link runs over an in-memory channel. `--concurrency` streamed
completions are opened through ASGI (a `send` and a body_nowait extension that only count, so
tokens take the push path of a uvicorn-served frontend), then the "worker" hands the link
one `Deltas` message per step carrying one delta per stream (one token each, as a paced engine
does), and the event loop runs until the responses have taken them. What is timed is the process
CPU of those steps: the link's routing, the request handles, the collectors, the response loop,
the detokenizer, SSE encoding and metrics; not the HTTP server, the socket writes, nor ZMQ.

    .venv/bin/python perf/micro/bench_frontend_step.py [--concurrency 256 --steps 200]
    .venv/bin/python perf/micro/bench_frontend_step.py --profile   # cProfile of the steps

Point PYTHONPATH at another checkout's runtime/ and components/ to measure it the same way (its
tests/fakes.py must have memory_pool).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf" / "micro"))

from bench_app_inprocess import _one  # noqa: E402  (one streamed request through ASGI)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.config import FrontendConfig
    from tandem.engines.reference.checkpoint import write_tiny_model
    from tandem.frontend.app import FrontendApp
    from tandem.frontend.preprocess import Preprocessor
    from tandem.runtime import wire
    from tests.fakes import memory_pool

    model = Path(tempfile.mkdtemp(prefix="tandem-bench-")) / "tiny"
    write_tiny_model(model, seed=0)
    pre = Preprocessor(str(model), "tiny")
    pool, workers = memory_pool(["agg"], pages=1 << 20, page_size=16, max_context=1 << 16)
    app = FrontendApp(FrontendConfig(model=str(model), served_model_name="tiny"), pool, pre)
    link = pool.links[0]
    steps = args.steps
    body = json.dumps({"prompt": "the cat", "max_tokens": steps, "stream": True,
                       "ignore_eos": True}).encode()
    open_cpu0, open_wall0 = time.process_time(), time.perf_counter()
    tasks = [asyncio.ensure_future(_one(app, body, steps, nowait=True)) for _ in range(args.concurrency)]
    for _ in range(5):
        await asyncio.sleep(0)
    rids = [g.rid for m in workers.sent(link.address) if isinstance(m, wire.Generates)
            for g in m.items]
    assert len(rids) == args.concurrency, f"{len(rids)} requests placed"
    vocab = pre.vocab_size
    ids = [(7 * k + 3) % (vocab - 10) + 5 for k in range(steps)]
    msgs = [wire.Deltas([wire.Delta(rid, k, [ids[k]],
                                    "length" if k == steps - 1 else None,
                                    wire.Usage(3, steps) if k == steps - 1 else None)
                         for rid in rids]) for k in range(steps)]
    prof = cProfile.Profile() if args.profile else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    if args.whole:  # the requests' opening too
        cpu0, wall0 = open_cpu0, open_wall0
    for msg in msgs:
        link.on_message(msg)
        for _ in range(3):  # the pushes, the credit, the finishing responses
            await asyncio.sleep(0)
    done, _ = await asyncio.wait(tasks, timeout=10)
    if prof:
        prof.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    tokens = steps * args.concurrency
    out = {"concurrency": args.concurrency, "steps": steps, "tokens": tokens,
           "body_writes": sum(t.result() for t in done), "cpu_us_per_token": round(cpu * 1e6 / tokens, 2),
           "wall_us_per_token": round(wall * 1e6 / tokens, 2)}
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200, help="tokens per stream")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the steps")
    ap.add_argument("--whole", action="store_true",
                    help="time the requests' opening (parse, validate, tokenize, place) too")
    args = ap.parse_args()
    import uvloop
    print(json.dumps(uvloop.run(run(args))))


if __name__ == "__main__":
    main()
