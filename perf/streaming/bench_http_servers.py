"""Which HTTP server should carry the frontend's SSE streams? Side by side in one run.

Each server, in its own process, serves the same SSE stream: a fake generator emitting N small
`chat.completion.chunk`-like events per request (one write and one event-loop yield per event, as
a real stream interleaves with its engine), then `data: [DONE]`. A client in another process
(aiohttp, a fixed number of requests at a fixed concurrency) counts the events. Reported per server:
streamed tokens/s and server CPU-µs per token (psutil CPU time of the server's process tree).

  (a) uvicorn + httptools + uvloop, a minimal raw ASGI app (what tandem's app is)
  (b) aiohttp web server on uvloop, the same stream through StreamResponse
  (c) granian, ASGI interface, the same raw ASGI app, uvloop

`--suite app` runs tandem's real FrontendApp (over a fake in-process pool, see bench_http_app.py)
on each of tandem's two server adapters: uvicorn, and granian's embedded server. There the column
that matters most is CPU per token on the Python thread: it is the ceiling of one frontend process.

Run:  .venv/bin/python perf/streaming/bench_http_servers.py            (about 1-2 minutes)
Writes perf/results/http_servers.json and perf/results/http_servers.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
SERVERS = ("uvicorn", "aiohttp", "granian")
APP_SERVERS = ("app-uvicorn", "app-granian")  # --suite app: the real FrontendApp

CHUNK = (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
         b'"model":"tiny","choices":[{"index":0,"delta":{"content":" tok"},"logprobs":null,'
         b'"finish_reason":null}]}\n\n')
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


# --- the servers ----------------------------------------------------------------------------------


def _tokens_of(query: bytes) -> int:
    for part in query.split(b"&"):
        if part.startswith(b"n="):
            return int(part[2:])
    return 100


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The minimal raw ASGI SSE app: served by uvicorn and by granian."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    n = _tokens_of(scope.get("query_string", b""))
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    for _ in range(n):
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await asyncio.sleep(0)
    await send({"type": "http.response.body", "body": DONE, "more_body": False})


def serve_uvicorn(port: int) -> None:
    import uvicorn

    config = uvicorn.Config(asgi_app, host="127.0.0.1", port=port, loop="uvloop",
                            http="httptools", ws="none", lifespan="off", access_log=False,
                            log_level="warning")
    uvicorn.Server(config).run()


def serve_aiohttp(port: int) -> None:
    import uvloop
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        n = int(request.query.get("n", "100"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream",
                                           "cache-control": "no-cache"})
        await resp.prepare(request)
        for _ in range(n):
            await resp.write(CHUNK)
            await asyncio.sleep(0)
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b"ok")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/stream", stream)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_granian(port: int) -> None:
    from granian import Granian
    from granian.constants import Interfaces, Loops

    Granian("bench_http_servers:asgi_app", address="127.0.0.1", port=port,
            interface=Interfaces.ASGI, workers=1, loop=Loops.uvloop, websockets=False,
            log_enabled=False, working_dir=HERE).serve()


def serve_app(kind: str, port: int) -> None:
    from bench_http_app import serve_app as serve

    serve(kind.removeprefix("app-"), port)


# --- the client -----------------------------------------------------------------------------------


async def run_client(port: int, requests: int, tokens: int, concurrency: int,
                     app: bool) -> dict[str, Any]:
    import aiohttp

    if app:
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": tokens, "stream": True})
    else:
        url = f"http://127.0.0.1:{port}/stream?n={tokens}"
    left = requests
    counted = 0

    async def one_lane(session: aiohttp.ClientSession) -> None:
        nonlocal left, counted
        while left > 0:
            left -= 1
            req = session.post(url, data=body, headers={"content-type": "application/json"}) \
                if app else session.get(url)
            async with req as resp:
                async for data in resp.content.iter_any():
                    counted += data.count(b"data: {")

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_lane(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"tokens": counted, "seconds": wall}


def client_main(args: argparse.Namespace) -> None:
    import uvloop

    out = uvloop.run(run_client(args.port, args.requests, args.tokens, args.concurrency,
                                args.app))
    print(json.dumps(out))


# --- the driver -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("server did not start")


def _tree_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the server's process tree, and of the thread that runs Python in it (the
    main thread of the process that serves: a granian standalone worker is a child process)."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    python = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
            for th in p.threads():
                if th.id == p.pid:
                    python = max(python, th.user_time + th.system_time)
        except psutil.NoSuchProcess:
            pass
    return total, python


def _client(port: int, requests: int, tokens: int, concurrency: int,
            app: bool) -> tuple[dict[str, Any], float]:
    import psutil

    cmd = [sys.executable, __file__, "client", "--port", str(port), "--requests", str(requests),
           "--tokens", str(tokens), "--concurrency", str(concurrency)] + (["--app"] if app else [])
    proc = psutil.Popen(cmd, stdout=subprocess.PIPE)
    cpu = 0.0
    while proc.poll() is None:  # sample the client's CPU while it lives
        try:
            t = proc.cpu_times()
            cpu = t.user + t.system
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError("client failed")
    return json.loads(out), cpu


def measure(server: str, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, __file__, "server", server, "--port", str(port)],
                            env=env)
    try:
        _wait_ready(port, proc)
        app = server.startswith("app-")
        _client(port, args.concurrency, 20, args.concurrency, app)  # warm up
        cpu0, py0 = _tree_cpu(proc.pid)
        res, client_cpu = _client(port, args.requests, args.tokens, args.concurrency, app)
        cpu1, py1 = _tree_cpu(proc.pid)
        cpu, py = cpu1 - cpu0, py1 - py0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    expected = args.requests * args.tokens
    if res["tokens"] != expected:
        raise RuntimeError(f"{server}: counted {res['tokens']} events, expected {expected}")
    return {"server": server, "tokens": res["tokens"], "seconds": round(res["seconds"], 3),
            "tokens_per_s": round(res["tokens"] / res["seconds"]),
            "server_cpu_us_per_token": round(cpu * 1e6 / res["tokens"], 2),
            "python_thread_cpu_us_per_token": round(py * 1e6 / res["tokens"], 2),
            "client_cpu_s": round(client_cpu, 2)}


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("uvicorn", "httptools", "uvloop", "aiohttp", "granian")}


def driver_main(args: argparse.Namespace) -> None:
    command = "cd " + str(HERE.parents[1]) + " && " + shlex.join(
        [".venv/bin/python", "perf/streaming/bench_http_servers.py", *sys.argv[1:]])
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):  # interleaved rounds, so drift hits every server alike
        for server in args.servers:
            row = measure(server, args)
            row["round"] = r
            runs.append(row)
            print(f"round {r} {server:12s} {row['tokens_per_s']:>9,} tok/s "
                  f"{row['server_cpu_us_per_token']:>7.2f} server CPU-µs/token "
                  f"{row['python_thread_cpu_us_per_token']:>7.2f} on its Python thread",
                  flush=True)
    summary = []
    for server in args.servers:
        mine = [x for x in runs if x["server"] == server]
        summary.append({
            "server": server,
            "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in mine)),
            "server_cpu_us_per_token": round(
                statistics.median(x["server_cpu_us_per_token"] for x in mine), 2),
            "python_thread_cpu_us_per_token": round(
                statistics.median(x["python_thread_cpu_us_per_token"] for x in mine), 2),
            "best_tokens_per_s": max(x["tokens_per_s"] for x in mine),
            "best_server_cpu_us_per_token": min(x["server_cpu_us_per_token"] for x in mine)})
    base = summary[0]
    for row in summary:
        row["tokens_per_s_vs_first"] = round(row["tokens_per_s"] / base["tokens_per_s"], 2)
        row["cpu_per_token_vs_first"] = round(
            row["server_cpu_us_per_token"] / base["server_cpu_us_per_token"], 2)
    result = {"command": command, "params": {"requests": args.requests, "tokens": args.tokens,
                                             "concurrency": args.concurrency,
                                             "rounds": args.rounds},
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
                          "platform": platform.platform()},
              "versions": _versions(), "runs": runs, "summary": summary}
    header = ("| server | streamed tokens/s (median) | server CPU-µs/token (median) | Python-thread "
              "CPU-µs/token (median) | best tok/s | best CPU-µs/token | tok/s vs first "
              "| CPU vs first |")
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary:
        lines.append(f"| {row['server']} | {row['tokens_per_s']:,} | "
                     f"{row['server_cpu_us_per_token']:.2f} | "
                     f"{row['python_thread_cpu_us_per_token']:.2f} | {row['best_tokens_per_s']:,} | "
                     f"{row['best_server_cpu_us_per_token']:.2f} | "
                     f"{row['tokens_per_s_vs_first']} | {row['cpu_per_token_vs_first']} |")
    table = "\n".join(lines)
    print("\n" + table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "http_servers" if args.suite == "servers" else "http_servers_app"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (f"# HTTP servers for SSE streaming\n\n`{command}`\n\n"
          f"{args.requests} requests x {args.tokens} events, concurrency {args.concurrency}, "
          f"median and best of {args.rounds} interleaved rounds; {os.cpu_count()} CPUs "
          f"(load average {os.getloadavg()[0]:.1f} at the end: other work shared them), Python "
          f"{platform.python_version()}; versions: "
          + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + "\n\n" + table
          + "\n\nThe choice these figures led to, and why: the docstring of "
            "components/tandem/frontend/server.py.\n")
    (RESULTS / f"{stem}.md").write_text(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="role")
    s = sub.add_parser("server")
    s.add_argument("kind", choices=SERVERS + APP_SERVERS)
    s.add_argument("--port", type=int, required=True)
    c = sub.add_parser("client")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--app", action="store_true")
    for p in (ap, c):
        p.add_argument("--requests", type=int, default=1024)
        p.add_argument("--tokens", type=int, default=200, help="events per request")
        p.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--suite", choices=("servers", "app"), default="servers",
                    help="servers: the raw stream on each server; app: tandem's FrontendApp "
                         "over a fake pool on uvicorn vs embedded granian")
    ap.add_argument("--servers", nargs="+", choices=SERVERS + APP_SERVERS)
    args = ap.parse_args()
    if args.role == "server":
        if args.kind in APP_SERVERS:
            serve_app(args.kind, args.port)
        else:
            {"uvicorn": serve_uvicorn, "aiohttp": serve_aiohttp,
             "granian": serve_granian}[args.kind](args.port)
    elif args.role == "client":
        client_main(args)
    else:
        if not args.servers:
            args.servers = list(APP_SERVERS if args.suite == "app" else SERVERS)
        driver_main(args)


if __name__ == "__main__":
    main()
