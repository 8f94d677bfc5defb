"""Does the reference engine's cached path compute what a full prefill computes? For N random
prompts: the prompt prefilled at once into fresh pages, against its first k full pages prefilled
first (as an earlier request would have) and the rest prefilled after them (as a request that
found those pages cached does). Records the largest absolute difference of the last position's
logits and whether the greedy (argmax) token agrees; then, through two engines (cache on, cache
off), greedy completions of prompts sharing prefixes, token for token.

    .venv/bin/python -m perf.prefix.prefix_exactness --model models/tiny --prompts 1000 \\
        --out perf/results/prefix_exactness.md
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import torch


def logits_check(model_dir: str, n: int, page: int, seed: int) -> tuple[float, int, int]:
    from tandem.engines.reference.model import Llama

    model = Llama.from_checkpoint(model_dir)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    worst, disagree = 0.0, 0
    for _ in range(n):
        length = rng.randrange(page + 1, 400)
        ids = torch.tensor([rng.randrange(3, vocab) for _ in range(length)])
        k = rng.randrange(1, (length - 1) // page + 1) * page  # cached tokens: whole pages
        pages = torch.arange(-(-length // page))
        kv_a = model.new_kv_cache(len(pages), page)
        full = model.prefill(kv_a, ids, pages, 0)
        kv_b = model.new_kv_cache(len(pages), page)
        model.prefill(kv_b, ids[:k], pages, 0)
        cached = model.prefill(kv_b, ids[k:], pages, start_pos=k)
        worst = max(worst, float((full - cached).abs().max()))
        disagree += int(full.argmax()) != int(cached.argmax())
    return worst, disagree, n


async def engines_check(model_dir: str, n: int, page: int, seed: int) -> tuple[int, int, int]:
    from tandem.engines.reference import ReferenceEngine
    from tests.conformance.harness import Recorder, finished
    from tandem.runtime.wire import SamplingParams

    on = ReferenceEngine(Path(model_dir), page_size=page, num_pages=4096, max_batch=16)
    off = ReferenceEngine(Path(model_dir), page_size=page, num_pages=4096, max_batch=16,
                          prefix_cache=False)
    await on.start()
    await off.start()
    rng = random.Random(seed)
    vocab = on.spec.vocab_size
    systems = [[rng.randrange(3, vocab) for _ in range(rng.randrange(20, 300))]
               for _ in range(16)]
    same = hits = 0
    sp = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    try:
        for i in range(n):
            prompt = rng.choice(systems) + [rng.randrange(3, vocab)
                                            for _ in range(rng.randrange(1, 40))]
            a = await finished(Recorder(on).submit(on, f"a{i}", prompt, sp), 120)
            b = await finished(Recorder(off).submit(off, f"b{i}", prompt, sp), 120)
            same += a.ids == b.ids
            hits += a.cached > 0
    finally:
        await on.shutdown()
        await off.shutdown()
    return same, hits, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t0 = time.monotonic()
    worst, disagree, n = logits_check(args.model, args.prompts, args.page_size, args.seed)
    same, hits, m = asyncio.run(engines_check(args.model, args.prompts, args.page_size,
                                              args.seed))
    text = (f"# The reference engine's cached path against a full prefill\n\n"
            f"`python -m perf.prefix.prefix_exactness --model {args.model} --prompts {args.prompts} "
            f"--page-size {args.page_size}` ({time.strftime('%Y-%m-%d %H:%M')}, "
            f"{time.monotonic() - t0:.0f} s, float32 on the CPU)\n\n"
            f"- Model level, {n} random prompts (lengths {args.page_size + 1}-399, a random "
            f"number of whole pages computed first): largest |logit difference| at the last "
            f"position {worst:.3g}; greedy token differs in {disagree} of {n}.\n"
            f"- Engine level, {m} prompts drawn from 16 shared system prompts plus a random "
            f"question, 8 greedy tokens each, engine with the cache against engine without: "
            f"{same} of {m} completions equal token for token; {hits} of {m} used cached pages.\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
