"""What the prefix cache's bookkeeping costs per cached page: a pool of N pages, every page
published under its key and released (so cached), measured with tracemalloc against the same pool
with the cache off and its pages allocated and freed. Also the per-request key list (one key per
full prompt page), and the time to compute keys per page.

    .venv/bin/python -m perf.prefix.prefix_memory --pages 100000 --out perf/results/prefix_memory.md
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from pathlib import Path

from tandem.engines.pages import PagePool
from tandem.engines.prefix import page_keys


def measure(pages: int, page: int, caching: bool) -> int:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool = PagePool(pages, page, caching=caching)
    tokens = list(range(pages * page))
    keys = page_keys(tokens, page)
    held = pool.take("a", [], pages)
    if caching:
        pool.publish(held, keys, 0, pages, lambda a, b: tokens[a:b])
        pool.take_events()
    pool.free("a")
    del tokens, keys, held
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert pool.num_cached == (pages if caching else 0)
    return used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    on = measure(args.pages, args.page_size, True)
    off = measure(args.pages, args.page_size, False)
    tokens = list(range(2048))
    t0 = time.perf_counter()
    for _ in range(200):
        page_keys(tokens, args.page_size)
    per_page_us = (time.perf_counter() - t0) / 200 / (2048 // args.page_size) * 1e6
    tracemalloc.start()
    keys = page_keys(tokens, args.page_size)
    key_list = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del keys
    text = (f"# The prefix cache's bookkeeping\n\n`python -m perf.prefix.prefix_memory --pages "
            f"{args.pages} --page-size {args.page_size}` ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
            f"- A pool of {args.pages:,} pages: {off / args.pages:.1f} bytes per page with the "
            f"cache off; with every page cached {on / args.pages:.1f} bytes per page, so "
            f"{(on - off) / args.pages:.1f} bytes of bookkeeping per cached page (its 128-bit "
            f"key, the key -> page and page -> key maps, the LRU entry). A worker with 100,000 "
            f"cached pages spends about {(on - off) * 100_000 / args.pages / 2**20:.0f} MiB on "
            f"it.\n"
            f"- A request's keys (one per full prompt page): {key_list / (2048 // args.page_size):.0f}"
            f" bytes per page ({key_list / 1024:.1f} KiB for a 2,048-token prompt); computing "
            f"them: {per_page_us:.2f} µs per page (BLAKE2b over {args.page_size} ids).\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
