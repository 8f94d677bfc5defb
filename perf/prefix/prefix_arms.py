"""The arms of perf/prefix/bench_prefix.py: a cluster started for one workload, every level of the ladder
sent to it through perf.prefix.prefix_drive, the cluster stopped (by PID); per level the client's figures
plus what the processes say: CPU per request (psutil), the workers' prefix-cache counters and the
router's own KV time (tandem), the routers' event counters (is the index fed at all?).

tandem: `perf.common.launch` (tandem.launcher) starts mock workers of a shape ("4agg", "2p2d") and one
frontend with `--router-policy POLICY`.

Dynamo 1.6.1 (its own venv, outside the repository): `python -m dynamo.mocker --num-workers N
--block-size 16 --num-gpu-blocks-override PAGES --max-num-seqs BATCH --planner-profile-data NPZ`
and `python -m dynamo.frontend --router-mode kv|round-robin`, with `--discovery-backend file
--event-plane zmq`. Dynamo's event-plane PUB sockets bind `tcp://0.0.0.0:0` whatever the
environment says (DYN_EVENT_PLANE_HOST only changes the address it advertises), so its processes
and the client run in a network namespace of their own with only loopback (`unshare -n`, then
`ip link set lo up`): nothing they bind is reachable from outside it. That is a child process
(`python -m perf.prefix.prefix_arms SPEC.json`) that regenerates the same sessions from the same seeds and
writes its rows to a JSON file. The NPZ is the mocker's latency table, written here from tandem's
mock timing model: prefill time = prefill_us_per_token x the tokens it computes, decode step time =
decode_step_us + decode_us_per_seq x the batch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psutil

from perf.prefix import prefix_workloads as W
from perf.streaming.load import run
from perf.prefix.prefix_drive import drive_level, summarize

Level = tuple[int, float, int]  # (index, offered rate in requests/s, seed)


def get_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def metric_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Prometheus text -> {name or name{part=...}: summed value} for the families asked for."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        for n in names:
            if line.startswith(n) and line[len(n):len(n) + 1] in ("{", " "):
                key = n
                if 'part="' in line:
                    key = n + "[" + line.split('part="')[1].split('"')[0] + "]"
                try:
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
    return out


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = float("nan")
    return out


def run_levels(host: str, port: int, args: dict, workload: str, levels: list[Level],
               probe: Callable[[], dict[str, Any]]) -> list[dict]:
    """Every level in turn; `probe()` reads the processes' counters before and after each."""
    p = W.Params(**args["params"])
    rows = []
    for li, rate, seed in levels:
        sessions = W.make(workload, p, rate, seed)
        before = probe()
        recs, unsent, wall = run(drive_level(host, port, args["model_name"], sessions,
                                             args["max_tokens"], args["timeout_s"]))
        time.sleep(0.7)  # the workers' next load reports carry the level's last counts
        after = probe()
        row = {"level": li, "rate": rate, "seed": seed, **summarize(recs, unsent, wall)}
        n = max(1, row["requests"])
        for k, v in after.items():
            d = v - before.get(k, 0.0)
            if k.startswith("cpu:"):
                row[f"cpu_us_per_req_{k[4:]}"] = d / n * 1e6
            elif k.startswith("tandem_router_kv_seconds_total["):
                row[f"router_kv_us_per_req_{k.split('[')[1][:-1]}"] = d / n * 1e6
            elif k == "dynamo_router_overhead_total_ms_sum":  # its own measure: wall time
                row["router_kv_us_per_req_total"] = d / n * 1e3
            else:
                row[f"delta_{k}"] = d
        q, h = row.get("delta_worker_queries", 0.0), row.get("delta_worker_hits", 0.0)
        row["worker_hit_rate"] = h / q if q else None
        rows.append(row)
        print(f"  {workload} level {li} ({rate:g} req/s): {row['requests']} req, "
              f"{row['rejected_503']} x 503, TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 "
              f"{row['ttft_p99_ms']:.0f}, hit {row['hit_rate']:.2f} (oracle "
              f"{row['oracle_hit_rate']:.2f}), {row['output_tok_s']:.0f} tok/s", flush=True)
    return rows


def warm(host: str, port: int, model_name: str) -> None:
    """One short request nobody shares, outside the figures (first-request setup costs)."""
    from perf.common.client import Connection

    async def go() -> None:
        c = Connection(host, port)
        body = json.dumps({"model": model_name, "prompt": [5, 6, 7, 8], "max_tokens": 2,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        try:
            r = await c.post_stream("/v1/completions", body, 60.0)
        finally:
            await c.close()
        if not r.ok:
            raise RuntimeError(f"warm-up request failed: {r.error}")

    run(go())


# -- tandem -----------------------------------------------------------------------------------

def tandem_arm(args: dict, shape: str, policy: str, workload: str, levels: list[Level],
               log_dir: str) -> list[dict]:
    from perf.common.launch import launch
    from tandem.launcher import get_json

    c = launch(shape, args["model"], log_dir, args["tandem_worker_args"],
               ["--router-policy", policy, *args.get("tandem_frontend_args", [])],
               keys=args.get("keys", ""))
    url = c.url
    pids = {("frontend" if n == "frontend" else "workers:" + n): p.pid
            for n, p in c.procs.items()}

    def probe() -> dict[str, Any]:
        cpu = cpu_s(pids)
        out: dict[str, Any] = {"cpu:frontend": cpu.pop("frontend")}
        out["cpu:workers"] = sum(cpu.values())
        rows = get_json(url + "/workers")
        rows = rows["workers"] if isinstance(rows, dict) else rows
        computing = [r for r in rows if r.get("role") in ("agg", "prefill")]
        out["worker_queries"] = float(sum(int(r.get("prefix_cache_queries", 0)) for r in computing))
        out["worker_hits"] = float(sum(int(r.get("prefix_cache_hits", 0)) for r in computing))
        out.update(metric_sums(get_text(url + "/metrics"), (
            "tandem_router_kv_seconds_total", "tandem_router_kv_events_applied_total")))
        return out

    try:
        warm("127.0.0.1", c.port, args["model_name"])
        return run_levels("127.0.0.1", c.port, args, workload, levels, probe)
    finally:
        c.stop()


# -- Dynamo -----------------------------------------------------------------------------------

DYNAMO_PORT = 18123  # inside the namespace: nothing else is there


def dynamo_arm(args: dict, mode: str, workload: str, levels: list[Level], log_dir: str,
               deadline_s: float) -> list[dict]:
    """Run one Dynamo arm in a loopback-only network namespace; its rows (RuntimeError on failure,
    with the reason)."""
    os.makedirs(log_dir, exist_ok=True)
    spec = os.path.join(log_dir, "spec.json")
    out = os.path.join(log_dir, "rows.json")
    with open(spec, "w") as f:
        json.dump({"args": args, "mode": mode, "workload": workload, "levels": levels,
                   "log_dir": log_dir, "out": out}, f)
    cmd = ["unshare", "-n", "sh", "-c",
           'ip link set lo up && exec "$0" -m perf.prefix.prefix_arms "$1"', sys.executable, spec]
    with open(os.path.join(log_dir, "child.log"), "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        try:
            rc = child.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGTERM)  # it stops Dynamo's processes by PID
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            raise RuntimeError(f"the Dynamo arm ran past its {deadline_s:.0f} s deadline")
    with open(os.path.join(log_dir, "child.log")) as f:
        tail = f.read()[-1500:]
    sys.stdout.write("".join(ln + "\n" for ln in tail.splitlines() if ln.startswith("  ")))
    if rc != 0 or not os.path.exists(out):
        raise RuntimeError(f"the Dynamo arm failed (exit {rc}): {tail[-600:]}")
    with open(out) as f:
        return list(json.load(f))


def _npz(dpy: str, path: str, timing: dict) -> None:
    code = ("import numpy as np, sys, json; t = json.loads(sys.argv[2]); "
            "isl = np.linspace(0, 65536, 1025); kv = np.linspace(0, 2_000_000, 201); "
            "ctx = np.linspace(1, 32768, 201); bs = np.maximum(1, kv[:, None] / ctx[None, :]); "
            "np.savez(sys.argv[1], prefill_isl=isl, prefill_ttft_ms=isl * t['prefill_us'] / 1e3,"
            " decode_active_kv_tokens=kv, decode_context_length=ctx, decode_itl=(t['step_us'] "
            "+ t['seq_us'] * bs) / 1e3)")
    subprocess.run([dpy, "-c", code, path, json.dumps(timing)], check=True, timeout=120)


@contextmanager
def dynamo_cluster(dpy: str, log_dir: str, *, model: str, model_name: str, workers: int,
                   page_size: int, num_pages: int, max_batch: int, timing: dict, port: int,
                   mode: str, mocker_args: Sequence[str] = (),
                   front_args: Sequence[str] = ()) -> Iterator[dict[str, int]]:
    """Dynamo 1.6.1's mocker (`workers` workers, tandem's mock `timing` as its latency table) and
    frontend (`--router-mode mode`) on `port`, ready: every worker registered, the model
    committed with all of them, a warm-up request answered. Run it inside a loopback-only
    namespace (the module docstring). Yields the processes' PIDs by name; stops them by PID."""
    npz = os.path.join(log_dir, "latency.npz")
    _npz(dpy, npz, timing)
    env = {**os.environ, "DYN_FILE_KV": tempfile.mkdtemp(prefix="dyn-kv-", dir=log_dir),
           "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
           "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1"}
    common = ["--discovery-backend", "file", "--event-plane", "zmq"]
    mocker = [dpy, "-m", "dynamo.mocker", "--model-path", model, "--model-name", model_name,
              "--num-workers", str(workers), "--block-size", str(page_size),
              "--num-gpu-blocks-override", str(num_pages), "--max-num-seqs", str(max_batch),
              "--max-num-batched-tokens", "65536", "--planner-profile-data", npz, *common,
              *mocker_args]
    front = [dpy, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
             str(port), "--router-mode", mode, *common, *front_args]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        def start(name: str, cmd: list[str]) -> None:
            # The mocker's per-request INFO lines cost CPU (tandem's run at WARNING); the
            # frontend's INFO line says when it has every worker.
            log = open(os.path.join(log_dir, f"{name}.log"), "wb")
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                           env={**env, "DYN_LOG": "warn" if name == "mocker"
                                                else "info"}, cwd=log_dir)

        def wait(what: str, done: Callable[[], bool], within_s: float = 120.0) -> None:
            t_end = time.monotonic() + within_s
            while not done():
                for n, p in procs.items():
                    if p.poll() is not None:
                        raise RuntimeError(f"dynamo {n} exited with {p.returncode}")
                if time.monotonic() > t_end:
                    raise RuntimeError(f"Dynamo: {what} not within {within_s:.0f} s")
                time.sleep(0.5)

        instances = os.path.join(env["DYN_FILE_KV"], "v1", "instances")
        # Every worker registered before the frontend starts: a frontend that starts while they
        # register may commit the model with fewer of them and route to those alone.
        start("mocker", mocker)
        wait(f"{workers} mocker workers registered", lambda: os.path.isdir(instances) and sum(
            f.startswith("dynamo%2Fbackend%2Fgenerate%2F") for f in os.listdir(instances))
            >= workers)
        start("frontend", front)
        want = f"members={workers}".encode()

        def committed() -> bool:
            with open(os.path.join(log_dir, "frontend.log"), "rb") as f:
                return want in re.sub(rb"\x1b\[[0-9;]*m", b"", f.read())

        wait(f"the frontend committing the model with {workers} workers", committed)
        warm("127.0.0.1", port, model_name)
        yield {n: p.pid for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _child(spec_path: str) -> None:
    """Inside the namespace: start the mocker and the frontend, run the levels, stop them."""
    with open(spec_path) as f:
        spec = json.load(f)
    args, mode, log_dir = spec["args"], spec["mode"], spec["log_dir"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    front = ["--router-session-affinity-ttl-secs", "300",
             "--router-session-affinity-mode", "soft"] if mode == "kv" else []
    with dynamo_cluster(args["dynamo_python"], log_dir, model=args["model"],
                        model_name=args["model_name"], workers=args["dynamo_workers"],
                        page_size=args["params"]["page_size"], num_pages=args["num_pages"],
                        max_batch=args["max_batch"], timing=args["timing"], port=DYNAMO_PORT,
                        mode=mode, front_args=front) as pids:
        url = f"http://127.0.0.1:{DYNAMO_PORT}"

        def probe() -> dict[str, Any]:
            cpu = cpu_s(pids)
            out: dict[str, Any] = {"cpu:frontend": cpu["frontend"], "cpu:workers": cpu["mocker"]}
            out.update(metric_sums(get_text(url + "/metrics"), (
                "dynamo_component_kv_cache_events_applied",
                "dynamo_router_overhead_total_ms_sum")))
            return out

        rows = run_levels("127.0.0.1", DYNAMO_PORT, args, spec["workload"],
                          [tuple(x) for x in spec["levels"]], probe)  # type: ignore[misc]
        with open(spec["out"], "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    _child(sys.argv[1])
