"""CPU per request of tandem's aggregated worker alone, in one process: a WorkerServer over the mock
engine (zero costs) fed a closed loop of requests, as one frontend would send them, with the wire's
encode and decode on both sides but no socket. A fake frontend keeps `--concurrency` requests in
flight: it answers every Deltas message with a Credit, and each pass sends one Generates with a new
request for each that finished. The figure is the worker's main-thread work per request
(decode, validation, engine admission and steps, deltas, outboxes, encode) without ZMQ.

Run: .venv/bin/python perf/micro/bench_worker_inprocess.py [--requests 20000 --tokens 2 --concurrency 256]
     add --profile to print cProfile's top functions instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from typing import Any


async def _run(requests: int, tokens: int, concurrency: int, model_dir: str) -> float:
    from tandem.config import WorkerConfig
    from tandem.engines.mock import MockEngine
    from tandem.runtime import wire
    from tandem.runtime.wire import Credit, Deltas, Generate, Generates, SamplingParams, WorkerInfo
    from tandem.worker.server import WorkerServer

    loop = asyncio.get_running_loop()
    ident = b"fe-1"
    sent = [0]
    finished = [0]
    pending: list[Generate] = []
    done = loop.create_future()
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)

    def new_request() -> None:
        i = sent[0]
        sent[0] += 1
        pending.append(Generate(f"r{i}", [1, 2, 3, 4 + i % 64, 5, 6, 7, 8], sampling))
        if len(pending) == 1:
            loop.call_soon(flush_generates)

    def flush_generates() -> None:
        items = list(pending)
        pending.clear()
        payload = wire.encode(Generates(items))
        msg = wire.TO_WORKER.decode(payload)
        server.dispatch((ident, msg))

    class Frontend:
        """The worker's channel: what it sends reaches the fake frontend at once."""

        closed = False

        def send_nowait(self, to: bytes, msg: Any) -> None:
            payload = wire.encode(msg)
            back = wire.TO_FRONTEND.decode(payload)  # (the frontend's side of the wire)
            if isinstance(back, Deltas):
                loop.call_soon(server.dispatch, (to, Credit(1)))
                for d in back.items:
                    if d.finish_reason is not None:
                        finished[0] += 1
                        if sent[0] < requests:
                            new_request()
                        elif finished[0] == requests and not done.done():
                            done.set_result(None)

    cfg = WorkerConfig(engine="mock", max_batch=4096)
    engine = MockEngine(model_dir, max_batch=4096)
    await engine.start()
    server = WorkerServer(cfg, engine, WorkerInfo("w", "agg", "mock", "m", 16, engine.num_pages,
                                                  256), channel=Frontend())  # type: ignore[arg-type]
    try:
        start = time.process_time()
        for _ in range(concurrency):
            new_request()
        await asyncio.wait_for(done, 300)
        return (time.process_time() - start) / requests * 1e6
    finally:
        await engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print cProfile's top 30 functions")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump({"vocab_size": 32000, "max_position_embeddings": 256,
                       "eos_token_id": 2}, f)
        if args.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            asyncio.run(_run(args.requests, args.tokens, args.concurrency, d))
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            return
        for _ in range(args.repeats):
            us = asyncio.run(_run(args.requests, args.tokens, args.concurrency, d))
            print(f"{us:.2f} us CPU per request ({args.tokens} tokens, "
                  f"{args.concurrency} in flight)")


if __name__ == "__main__":
    main()
