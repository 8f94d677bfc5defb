"""What streaming costs end to end, side by side in one run: output mode and stream_interval.

A real frontend and one mock-engine worker (no delays: every cost measured is tandem's own), as
child processes on loopback, started and stopped by PID. A load client in a separate process (raw
asyncio streams on uvloop, one keep-alive connection per slot, verifying that every stream ends with
`data: [DONE]` and carries no error event) runs streamed completions with `ignore_eos` and a fixed
`max_tokens` at a fixed concurrency. Four configs:

  cumulative  / stream_interval 1     incremental / stream_interval 1
  cumulative  / stream_interval 10    incremental / stream_interval 10

(`--output-mode` on the worker; `stream_interval` as the request's extension field.) Reported:
streamed tokens/s (usage.completion_tokens over the load's wall time) and CPU-µs per token (psutil
CPU time of the frontend + worker processes during the load, over the tokens streamed).

Run:  .venv/bin/python perf/streaming/bench_streaming.py     (about 1-2 minutes)
Writes perf/results/streaming.json and perf/results/streaming.md (`--out` for another path).

With `--baseline COMMIT` every config also runs against that commit's servers (checked out with
`git worktree`, run with that tree first on PYTHONPATH) under this tree's load client, interleaved
run by run (baseline, current, baseline, ...), and the report adds current/baseline ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
INTERVALS = (1, 10)
MODES = ("cumulative", "incremental")


# --- the load client (its own process) ------------------------------------------------------------


async def _one_slot(port: int, body: bytes, n: int, out: dict[str, int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        for _ in range(n):
            writer.write(head)
            status = await reader.readuntil(b"\r\n\r\n")
            if not status.startswith(b"HTTP/1.1 200"):
                out["bad"] += 1
                return
            parts: list[bytes] = []
            while True:  # chunked body
                size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
                if size == 0:
                    await reader.readexactly(2)
                    break
                parts.append((await reader.readexactly(size + 2))[:-2])
            data = b"".join(parts)
            if not data.endswith(b"data: [DONE]\n\n") or b'"error"' in data:
                out["bad"] += 1
                continue
            usage = json.loads(data[:-len(b"data: [DONE]\n\n")].rsplit(b"data: ", 1)[1])
            out["tokens"] += usage["usage"]["completion_tokens"]
            out["ok"] += 1
    finally:
        writer.close()


async def _load(port: int, concurrency: int, requests: int, max_tokens: int,
                interval: int) -> dict[str, Any]:
    body = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True, "stream_interval": interval,
                       "stream_options": {"include_usage": True}}).encode()
    out = {"ok": 0, "bad": 0, "tokens": 0}
    per = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    t0 = time.perf_counter()
    await asyncio.gather(*(_one_slot(port, body, n, out) for n in per if n))
    out["wall_s"] = time.perf_counter() - t0  # type: ignore[assignment]
    return out


def client_main(args: argparse.Namespace) -> None:
    import uvloop
    res = uvloop.run(_load(args.port, args.concurrency, args.requests, args.max_tokens,
                           args.interval))
    print(json.dumps(res))


# --- the cluster ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keyless(tree: str | None) -> list[str]:
    """--no-auth, for a tree whose hand-started processes need it said (older ones refuse it;
    this script runs alone, so perf.common.launch's `keyless` is not imported)."""
    cli = Path(tree or HERE.parent, "components", "tandem", "cli.py")
    return ["--no-auth"] if "resolve_keys_dir" in cli.read_text() else []


def _spawn(argv: list[str], log: Path, tree: str | None = None) -> subprocess.Popen[bytes]:
    """A tandem process; `tree`: run that checkout's code instead of this one's."""
    env = None
    if tree is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.join(tree, "runtime"), os.path.join(tree, "components")])}
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "tandem.cli", *argv], stdout=f,
                                stderr=subprocess.STDOUT, env=env)


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(5)


def _cpu_s(procs: list[subprocess.Popen[bytes]]) -> list[float]:
    """CPU seconds (user + system, all threads) each process has used so far."""
    import psutil
    out = []
    for p in procs:
        t = psutil.Process(p.pid).cpu_times()
        out.append(t.user + t.system)
    return out


def _start(model: str, mode: str, concurrency: int, logs: Path,
           tree: str | None = None, tag: str = "") -> list[subprocess.Popen[bytes]]:
    wport, hport = _free_port(), _free_port()
    pages = concurrency * 24
    worker = _spawn(["worker", "--model", model, "--engine", "mock", "--port", str(wport),
                     "--output-mode", mode, "--max-batch", str(concurrency), "--num-pages",
                     str(pages), "--log-level", "WARNING", *_keyless(tree)],
                    logs / f"worker-{mode}{tag}.log",
                    tree)
    front = _spawn(["frontend", "--model", model, "--workers", f"tcp://127.0.0.1:{wport}",
                    "--port", str(hport), "--log-level", "WARNING", *_keyless(tree)],
                   logs / f"frontend-{mode}{tag}.log", tree)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for p in (worker, front):
            if p.poll() is not None:
                raise RuntimeError(f"a process exited: see {logs}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{hport}/health", timeout=2) as r:
                if r.status == 200:
                    front.port = hport  # type: ignore[attr-defined]
                    return [front, worker]
        except OSError:
            pass
        time.sleep(0.1)
    for p in (front, worker):
        _stop(p)
    raise TimeoutError("cluster not ready in 60s")


def _run_load(port: int, args: argparse.Namespace, interval: int, requests: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--client", "--port", str(port), "--concurrency",
           str(args.concurrency), "--requests", str(requests), "--max-tokens",
           str(args.max_tokens), "--interval", str(interval)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _worktree(commit: str) -> str:
    path = tempfile.mkdtemp(prefix="tandem-baseline-")
    subprocess.run(["git", "-C", str(HERE.parents[1]), "worktree", "add", "--detach", path, commit],
                   check=True, capture_output=True)
    return path


def bench_main(args: argparse.Namespace) -> None:
    from tandem.engines.reference.checkpoint import write_tiny_model
    rows: list[dict[str, Any]] = []
    trees: list[tuple[str, str | None]] = [("current", None)]
    if args.baseline:
        trees.insert(0, ("baseline", _worktree(args.baseline)))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = str(Path(tmp) / "tiny")
            write_tiny_model(model, seed=0)
            for mode in MODES:
                clusters: dict[str, list[subprocess.Popen[bytes]]] = {}
                try:
                    for name, tree in trees:
                        clusters[name] = _start(model, mode, args.concurrency, Path(tmp), tree,
                                                f"-{name}")
                        _run_load(clusters[name][0].port,  # type: ignore[attr-defined]
                                  args, 1, args.concurrency)  # warm-up
                    for rep in range(args.repeats):  # 1, 10, 1, 10, ...: drift hits all alike
                        for interval in INTERVALS:
                            for name, _ in trees:
                                procs = clusters[name]
                                port = procs[0].port  # type: ignore[attr-defined]
                                rows.append(_measure(procs, port, args, mode, interval, rep))
                                rows[-1]["tree"] = name
                                print(_row_text(rows[-1]), flush=True)
                finally:
                    for procs in clusters.values():
                        for p in procs:
                            _stop(p)
    finally:
        for name, tree in trees:
            if tree is not None:
                subprocess.run(["git", "-C", str(HERE.parents[1]), "worktree", "remove", "--force",
                                tree], capture_output=True)
    report(rows, args)


def _measure(procs: list[subprocess.Popen[bytes]], port: int, args: argparse.Namespace,
             mode: str, interval: int, rep: int) -> dict[str, Any]:
    cpu0 = _cpu_s(procs)
    res = _run_load(port, args, interval, args.requests)
    front_cpu, worker_cpu = (b - a for a, b in zip(cpu0, _cpu_s(procs)))
    tokens = max(res["tokens"], 1)
    return {
        "output_mode": mode, "stream_interval": interval, "repeat": rep,
        "requests_ok": res["ok"], "requests_bad": res["bad"], "tokens": res["tokens"],
        "wall_s": round(res["wall_s"], 2),
        "tokens_per_s": round(res["tokens"] / res["wall_s"]),
        "cpu_us_per_token": round((front_cpu + worker_cpu) / tokens * 1e6, 2),
        "frontend_cpu_us_per_token": round(front_cpu / tokens * 1e6, 2),
        "worker_cpu_us_per_token": round(worker_cpu / tokens * 1e6, 2),
    }


def _mean_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per tree and config: the mean over repeats (counts summed)."""
    out: list[dict[str, Any]] = []
    trees = list(dict.fromkeys(r.get("tree", "current") for r in rows))
    for mode in MODES:
        for interval in INTERVALS:
            for tree in trees:
                rs = [r for r in rows if (r["output_mode"], r["stream_interval"],
                                          r.get("tree", "current")) == (mode, interval, tree)]
                row: dict[str, Any] = {"tree": tree, "output_mode": mode,
                                       "stream_interval": interval}
                for k in ("requests_ok", "requests_bad", "tokens"):
                    row[k] = sum(r[k] for r in rs)
                for k in ("tokens_per_s", "cpu_us_per_token", "frontend_cpu_us_per_token",
                          "worker_cpu_us_per_token"):
                    row[k] = round(sum(r[k] for r in rs) / len(rs), 2 if "cpu" in k else None)
                out.append(row)
    return out


def _row_text(r: dict[str, Any]) -> str:
    return (f"| {r.get('tree', 'current'):<8} | {r['output_mode']:<11} | "
            f"{r['stream_interval']:>8} | {r['tokens_per_s']:>9} | "
            f"{r['cpu_us_per_token']:>14} | {r['frontend_cpu_us_per_token']:>10} | "
            f"{r['worker_cpu_us_per_token']:>9} | {r['requests_ok']:>4}/{r['requests_bad']:<3} |")


def _ratios(rows: list[dict[str, Any]]) -> list[str]:
    """current / baseline per config (mean rows), as table lines; none without a baseline."""
    by = {(r["tree"], r["output_mode"], r["stream_interval"]): r for r in rows}
    lines = []
    for mode in MODES:
        for interval in INTERVALS:
            b, c = by.get(("baseline", mode, interval)), by.get(("current", mode, interval))
            if b is None or c is None:
                continue
            cells = [f"{c[k] / b[k]:.2f}" if b[k] else "n/a"
                     for k in ("tokens_per_s", "cpu_us_per_token", "frontend_cpu_us_per_token",
                               "worker_cpu_us_per_token")]
            lines.append(f"| {mode} | {interval} | " + " | ".join(cells) + " |")
    if lines:
        lines[:0] = ["| output mode | interval | tok/s | CPU-µs/tok | (frontend) | (worker) |",
                     "|---|---:|---:|---:|---:|---:|"]
    return lines


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    rows = _mean_rows(runs)
    opts = [f"--concurrency={args.concurrency}", f"--requests={args.requests}",
            f"--max-tokens={args.max_tokens}", f"--repeats={args.repeats}"]
    if args.baseline:
        opts.append(f"--baseline={args.baseline}")
    if args.out != str(RESULTS / "streaming"):
        opts.append(f"--out={args.out}")
    cmd = ".venv/bin/python perf/streaming/bench_streaming.py " + shlex.join(opts)
    by = {(r["output_mode"], r["stream_interval"]): r for r in rows if r["tree"] == "current"}
    ratios = {m: round(by[(m, 10)]["tokens_per_s"] / by[(m, 1)]["tokens_per_s"], 2)
              for m in MODES}
    env = {"python": platform.python_version(), "cpus": os.cpu_count(),
           "machine": platform.machine()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"command": cmd, "env": env, "concurrency": args.concurrency, "requests": args.requests,
         "max_tokens": args.max_tokens, "repeats": args.repeats, "baseline": args.baseline,
         "rows": rows, "runs": runs, "interval_10_over_1_tokens_per_s": ratios}, indent=2) + "\n")
    head = ("| tree     | output mode | interval |  tokens/s | CPU-µs / token | (frontend) "
            "| (worker) | ok/bad |\n|----------|-------------|---------:|----------:|"
            "---------------:|-----------:|---------:|--------|")
    table = "\n".join([head, *(_row_text(r) for r in rows)])
    cmp = _ratios(rows)
    cmp_md = ("\n\nCurrent over baseline (" + str(args.baseline) + "), means of the runs above "
              "(below 1 is better for CPU, above 1 for tok/s):\n\n" + "\n".join(cmp)) if cmp else ""
    md = (f"# Streaming: output mode x stream_interval\n\nCommand: `{cmd}`\n\n"
          f"Mock engine (no delays), one worker, one frontend, concurrency {args.concurrency}, "
          f"{args.requests} streamed completions of {args.max_tokens} tokens per config "
          f"(ignore_eos), each the mean of {args.repeats} runs alternating interval 1 and 10 "
          f"(every run is in {out.with_suffix('.json').name}). Env: {env}.\n\n{table}{cmp_md}\n\n"
          f"stream_interval 10 over 1, tokens/s (current): {ratios}\n")
    out.with_suffix(".md").write_text(md)
    print(table)
    print("\n".join(cmp))
    print(f"stream_interval 10 / 1 tokens/s: {ratios}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--interval", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, default=512, help="streamed requests per config")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2, help="runs per config (alternating)")
    ap.add_argument("--baseline", default="",
                    help="also run every config against this commit's servers, interleaved")
    ap.add_argument("--out", default=str(RESULTS / "streaming"),
                    help="output path without extension (.json and .md are written)")
    args = ap.parse_args()
    if args.client:
        client_main(args)
    else:
        bench_main(args)


if __name__ == "__main__":
    main()
