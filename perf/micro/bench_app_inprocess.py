"""CPU per streamed token of tandem's FrontendApp alone, in one process: the app of
perf/streaming/bench_http_app.py (its fake pool hands out one-token deltas) driven through ASGI directly, with
a `send` that only counts, so the figure is the app's own work per chunk (response loop,
detokenizer, SSE encoding, metrics) without an HTTP server or a socket.

Run: .venv/bin/python perf/micro/bench_app_inprocess.py [--requests 2000 --tokens 200 --concurrency 64]
Point PYTHONPATH at another checkout's runtime/ and components/ to measure it the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "streaming"))  # (bench_http_app)


class _Calls:
    """The server's calls beside ASGI, as tandem's uvicorn protocol offers them (one object)."""

    def __init__(self, body_nowait: Any) -> None:
        self.body_nowait = body_nowait

    def start_nowait(self, status: int, headers: Any, body: bytes) -> bool:
        return False

    def on_gone(self, callback: Any) -> bool:
        return True


async def _one(app: Any, body: bytes, tokens: int, nowait: bool = False) -> int:
    """One streamed request through the app's ASGI interface; the body writes it made. `nowait`:
    the server offers the body_nowait and on_gone extensions (as tandem's uvicorn protocol does);
    body_nowait's writes are counted too."""
    chunks = 0
    sent = [False]

    async def receive() -> dict[str, Any]:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    async def send(msg: Any) -> None:
        nonlocal chunks
        if msg["type"] == "http.response.body":
            chunks += 1

    def body_nowait(data: bytes) -> bool:
        nonlocal chunks
        chunks += 1
        return True

    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/completions",
                             "headers": []}
    if nowait:  # (and a disconnect callback, as tandem's uvicorn protocol offers: never called)
        # Both forms, so that checkouts before the one extension object are measured the same way.
        scope["extensions"] = {"tandem.body_nowait": body_nowait,
                               "tandem.on_gone": lambda callback: True,
                               "tandem.server": _Calls(body_nowait)}
    await app(scope, receive, send)
    return chunks


async def main(args: argparse.Namespace) -> None:
    from bench_http_app import _frontend_app  # type: ignore[import-not-found]

    app = _frontend_app()
    body = json.dumps({"prompt": "the", "max_tokens": args.tokens, "stream": True,
                       "ignore_eos": True}).encode()
    sem = asyncio.Semaphore(args.concurrency)

    async def slot() -> int:
        async with sem:
            return await _one(app, body, args.tokens, args.nowait)

    await asyncio.gather(*(slot() for _ in range(args.concurrency)))  # warm up
    c0, t0 = time.process_time(), time.perf_counter()
    chunks = sum(await asyncio.gather(*(slot() for _ in range(args.requests))))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    n = args.requests * args.tokens
    print(json.dumps({"tokens": n, "body_writes": chunks, "cpu_s": round(cpu, 3),
                      "cpu_us_per_token": round(cpu * 1e6 / n, 3), "wall_s": round(wall, 3)}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--nowait", action="store_true",
                    help="offer the scope extensions tandem's uvicorn protocol offers (body_nowait, "
                         "on_gone); a checkout without them ignores them")
    import uvloop

    uvloop.run(main(ap.parse_args()))
