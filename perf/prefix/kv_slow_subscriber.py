"""What a KV event subscriber that never reads costs the worker's memory (issue 38, N6).

A publisher (tandem.worker.kv_events.KvEventPublisher, on real sockets on 127.0.0.1) publishes
batches of one BlockStored each (`--tokens` token ids: a prefill's worth) at `--rate` batches a
second for `--seconds`; a subscriber in another process connects, subscribes and never reads
(its receive queue: 1 message). This process's RSS is sampled before the subscriber connects and
every few seconds after; the figures go to stdout and, with --out, to a JSON file.

    python -m perf.prefix.kv_slow_subscriber --seconds 60 --out perf/results/kv_slow_subscriber
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time

from tandem.runtime.kv_events import BlockStored
from tandem.worker.kv_events import KvEventPublisher


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _never_reads(address: str, stop: multiprocessing.synchronize.Event) -> None:
    import zmq
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(address)
    stop.wait(600)
    sock.close()


async def run(args: argparse.Namespace) -> dict[str, object]:
    pub = KvEventPublisher("127.0.0.1")
    await pub.start()
    stop = multiprocessing.Event()
    sub = multiprocessing.Process(target=_never_reads, args=(pub.events_addr, stop), daemon=True)
    samples: list[tuple[float, float]] = []
    try:
        before = _rss_mb()
        sub.start()
        await asyncio.sleep(1.0)  # (the subscription joins)
        t0 = time.monotonic()
        n, next_sample = 0, 0.0
        while (elapsed := time.monotonic() - t0) < args.seconds:
            ev = [BlockStored(block_hashes=[n], parent_block_hash=None,
                              token_ids=[100_000 + n % 1000] * args.tokens,
                              block_size=args.tokens)]
            pub.publish(ev)
            n += 1
            if elapsed >= next_sample:
                samples.append((round(elapsed, 1), round(_rss_mb(), 1)))
                next_sample += args.seconds / 10
            await asyncio.sleep(1 / args.rate)
        samples.append((round(time.monotonic() - t0, 1), round(_rss_mb(), 1)))
    finally:
        stop.set()
        sub.join(5)
        await pub.close()
    return {"rss_before_mb": round(before, 1), "samples_s_mb": samples, "batches": n,
            "tokens_per_batch": args.tokens, "rate": args.rate, "seconds": args.seconds,
            "hwm": pub.hwm, "dropped": pub.counts.batches_dropped}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=500.0, help="batches a second")
    p.add_argument("--tokens", type=int, default=2048, help="token ids per batch")
    p.add_argument("--out", default="", help="write OUT.json")
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
