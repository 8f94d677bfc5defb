"""What a message costs through tandem's transport against pyzmq's asyncio sockets, on one event
loop: a DEALER sends wire messages (a Credit, and a 32-delta Deltas) over loopback TCP to a ROUTER
whose receive loop decodes them, in bursts of 16 per loop pass, as a frontend and a worker do.

- `pyzmq-asyncio`: what tandem did before: `send_multipart(..., NOBLOCK)` on a zmq.asyncio socket
  and a receive loop awaiting `recv_multipart()` per message.
- `tandem`: tandem.runtime.transport: raw non-blocking sends, and a receive loop that reads what is
  queued without a future per message and waits on the descriptor only when nothing is.

Reports the process's CPU (every thread: the loop and ZMQ's I/O thread) per message, medians of
interleaved repeats, and the ratio. Writes perf/results/zmq_io.md and .json.

    .venv/bin/python perf/transfer/bench_zmq_io.py [--messages 40000 --repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from typing import Any

import zmq
import zmq.asyncio

from tandem.runtime import transport, wire

BURST = 16
log = logging.getLogger("bench")


def _messages() -> dict[str, wire.Message]:
    deltas = wire.Deltas([wire.Delta(f"req-{i}", 10, [1000 + i]) for i in range(32)])
    return {"credit": wire.Credit(1), "deltas_32": deltas}


async def _pyzmq(msg: wire.Message, n: int) -> float:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    decoder = wire.TO_WORKER if not isinstance(msg, wire.Deltas) else wire.TO_FRONTEND

    async def receive(count: int) -> None:
        for _ in range(count):
            parts = await router.recv_multipart()
            decoder.decode(parts[1])

    async def send(count: int) -> None:
        for i in range(count):
            payload = wire.encode(msg)
            fut: Any = dealer.send_multipart([payload], flags=zmq.NOBLOCK, copy=True)
            if fut.done() and fut.exception() is not None:
                raise fut.exception()
            if i % BURST == BURST - 1:
                await asyncio.sleep(0)

    await send(1)
    await receive(1)  # connected
    start = time.process_time()
    await asyncio.gather(receive(n), send(n))
    cpu = time.process_time() - start
    dealer.close(0)
    router.close(0)
    ctx.term()
    return cpu / n * 1e6


async def _tandem(msg: wire.Message, n: int) -> float:
    router = transport._socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = transport.dealer(f"tcp://127.0.0.1:{port}", b"bench")
    decoder = wire.TO_WORKER if not isinstance(msg, wire.Deltas) else wire.TO_FRONTEND
    messages = transport.router_messages(router, decoder, log)

    async def receive(count: int) -> None:
        for _ in range(count):
            await messages.__anext__()

    async def send(count: int) -> None:
        for i in range(count):
            transport.send_nowait(dealer, msg)
            if i % BURST == BURST - 1:
                await asyncio.sleep(0)

    await send(1)
    await receive(1)
    start = time.process_time()
    await asyncio.gather(receive(n), send(n))
    cpu = time.process_time() - start
    await messages.aclose()
    transport.close(dealer)
    transport.close(router)
    return cpu / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=40000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(__file__)), "results",
                                         "zmq_io"))
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    # The Deltas message goes the other way in tandem (worker to frontend); the cost of one
    # message does not depend on the direction, so both ride DEALER -> ROUTER here.
    results: dict[str, dict[str, list[float]]] = {}
    for name, msg in _messages().items():
        runs: dict[str, list[float]] = {"pyzmq-asyncio": [], "tandem": []}
        for _ in range(args.repeats):  # interleaved
            runs["pyzmq-asyncio"].append(asyncio.run(_pyzmq(msg, args.messages)))
            runs["tandem"].append(asyncio.run(_tandem(msg, args.messages)))
        results[name] = runs
    lines = ["# One ZMQ message: tandem's transport against pyzmq's asyncio sockets", "",
             f"`.venv/bin/python perf/transfer/bench_zmq_io.py --messages {args.messages} --repeats "
             f"{args.repeats}` on {os.cpu_count()} cores; process CPU (all threads) per message, "
             f"median of {args.repeats} interleaved runs, sent in bursts of {BURST} per loop "
             "pass and decoded by the receiving loop.", "",
             "| message | pyzmq asyncio (us) | tandem (us) | ratio |", "|---|---:|---:|---:|"]
    for name, runs in results.items():
        a, b = statistics.median(runs["pyzmq-asyncio"]), statistics.median(runs["tandem"])
        lines.append(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump({"messages": args.messages, "burst": BURST, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
