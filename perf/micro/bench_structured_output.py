"""The per-token cost of constrained output on the reference engine: the same requests with a JSON
schema (xgrammar's mask before every token, the matcher's accept after it) and without one.

Both sides run the real tiny model on the CPU, `--streams` requests of exactly `--tokens` tokens
each at once: the unconstrained side ignores EOS, the constrained side's schema (an array of at
least 100000 small integers) cannot end before max_tokens, so both sides make the same number of
tokens. The sides alternate, `--runs` times each after a warm-up; the figures are medians: the
wall time per token of one stream (ms, the inter-token latency a client sees) and the process CPU
per generated token (us, all threads), and the grammar's own work alone per token (mask and
accept, no model: `grammar_us_per_token`, steadier than a difference of two noisy walls). It
also times the schema's compile, the first (cold, as
the engine's compile thread runs it) and a repeat (from the engine's cache of compiled grammars).

    nice -n 19 .venv/bin/python perf/micro/bench_structured_output.py --streams 1 8 --tokens 128 --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

import torch

from tandem.engines.base import EngineOutput, EngineRequest
from tandem.engines.grammars import Deferred
from tandem.engines.reference import ReferenceEngine, write_tiny_model
from tandem.engines.reference.grammar import GrammarState
from tandem.runtime.wire import SamplingParams

SCHEMA = json.dumps({"type": "array", "minItems": 100000,
                     "items": {"type": "integer", "minimum": 0, "maximum": 999}})


async def one_run(engine: ReferenceEngine, streams: int, tokens: int, constrained: bool,
                  tag: str) -> tuple[float, float]:
    """(wall ms per token of one stream, CPU us per generated token)."""
    sp = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1,
                        **({"json_schema": SCHEMA} if constrained else {"ignore_eos": True}))
    left = {f"{tag}-{i}" for i in range(streams)}
    counts = dict.fromkeys(left, 0)
    done = asyncio.Event()

    class Sink:
        def on_step(self, outputs: list[EngineOutput]) -> None:
            for out in outputs:
                counts[out.rid] = out.completion_tokens
                if out.finish_reason is not None:
                    assert out.finish_reason == "length", out
                    left.discard(out.rid)
            if not left:
                done.set()

    w0, c0 = time.perf_counter(), time.process_time()
    for i in range(streams):
        engine.submit(EngineRequest(f"{tag}-{i}", [0, 5, 100 + i, 200, 7], sp), Sink())
    await asyncio.wait_for(done.wait(), 600)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n = sum(counts.values())
    assert n == streams * tokens, n
    return wall / tokens * 1e3, cpu / n * 1e6


async def measure(model: str, streams: int, tokens: int, runs: int) -> dict[str, Any]:
    engine = ReferenceEngine(model, page_size=16, max_batch=streams)
    await engine.start()
    try:
        grammars = engine.grammars  # (waits for xgrammar's import, beside the model's load)
        req = EngineRequest("compile", [1], SamplingParams(json_schema=SCHEMA))
        t0 = time.perf_counter()
        first = grammars.constraint(req, "reference")
        assert isinstance(first, Deferred)
        first.compile(60.0)  # (what a compile slot runs)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert isinstance(grammars.constraint(req, "reference"), GrammarState)  # (the cache)
        warm = time.perf_counter() - t0
        sides: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for r in range(runs + 1):  # run 0 of each side warms up
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                got = await one_run(engine, streams, tokens, constrained, f"{r}{constrained}")
                if r:
                    sides[constrained].append(got)
    finally:
        await engine.shutdown()
    row: dict[str, Any] = {"streams": streams, "tokens": tokens, "runs": runs,
                           "compile_cold_ms": round(cold * 1e3, 2),
                           "compile_cached_ms": round(warm * 1e3, 3)}
    for constrained, name in ((False, "free"), (True, "json")):
        row[f"{name}_ms_per_token"] = round(statistics.median(x for x, _ in sides[constrained]), 3)
        row[f"{name}_cpu_us_per_token"] = round(
            statistics.median(y for _, y in sides[constrained]), 1)
    row["extra_ms_per_token"] = round(row["json_ms_per_token"] - row["free_ms_per_token"], 3)
    row["grammar_us_per_token"] = round(grammar_work(grammars, req, streams, tokens), 1)
    row["ratio"] = round(row["json_ms_per_token"] / row["free_ms_per_token"], 3)
    return row


def grammar_work(grammars: Any, req: EngineRequest, streams: int, tokens: int) -> float:
    """The grammar's own work alone, in us per token: a step's mask over `streams` rows of
    random logits, the token each row's argmax picks, each matcher accepting it (no model)."""
    rows = [(i, grammars.constraint(req, "reference")) for i in range(streams)]
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = torch.randn(streams, grammars.vocab_size, generator=gen)
        grammars.mask(logits, rows)
        for (_, c), t in zip(rows, logits.argmax(dim=-1).tolist()):
            assert c.accept(t)
    return (time.perf_counter() - t0) / (streams * tokens) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        write_tiny_model(d, seed=0)
        for streams in args.streams:
            print(json.dumps(asyncio.run(measure(d, streams, args.tokens, args.runs))),
                  flush=True)


if __name__ == "__main__":
    main()
