"""A noisy tenant and a quiet one on one mock-engine cluster: what fair admission buys the quiet
one (README, "Priorities and fair admission"; results: perf/results/tenants.md).

One aggregated mock worker (`--max-batch 16`, a decode step of 10 ms plus 0.1 ms per running
request, prefill 20 us per token, a KV cache small enough to evict) behind one frontend
(`--max-inflight-per-worker 32 --max-queue 64`). Tenants are API keys (`--tenant-by`'s default).

- **quiet**: one request at a time (a 256-token system prompt shared by all of its requests, then
  a 16-token question of its own; 16 tokens out, streamed), 50 ms apart;
- **noisy**: open loop at `--load` times the cluster's capacity (measured first: requests of 32
  tokens out, each with a 512-token prompt of its own, so its prompts fill the KV cache;
  `--noisy-prompt-tokens` changes it), sent
  from a process of its own, as another client would be: its client's work does not delay the
  quiet client's clock (it did when both shared one event loop).

Phases, each `--seconds` long: the quiet tenant alone (its unloaded TTFT), then both. Reported:
the quiet tenant's TTFT p50/p99 alone and under load and their ratio (the target: p99 at most
1.5x), its prefix-cache hit rate (cached prompt tokens over prompt tokens: N7, a system prompt
evicted by another tenant's unique prompts, shows as a low rate), the noisy tenant's outcomes
(served, 503 by reason), and Jain's fairness index over the two tenants' throughput, each
normalised by its max-min fair share of the capacity measured in the same run, and the CPU each
process took through the loaded phase (in cores: the two clients, the frontend, the worker).
With `--timeline DIR`, where the quiet tenant's first tokens waited, hop by hop (hops.py).

    nice -n 10 .venv/bin/python perf/streaming/bench_tenants.py --seconds 20 --runs 3
    TANDEM_SERVER_PYTHONPATH=BASE/runtime:BASE/components .venv/bin/python perf/streaming/bench_tenants.py
    .venv/bin/python perf/streaming/bench_tenants.py --pool A.json B.json ...

(the second: the servers of another checkout, BASE, under this load generator: the baseline.)
Besides each run's figures and their medians, `pooled` is the p99 ratio over every run's requests
together (as `--pool` computes it over the runs of several `--out` files, from arms run in turn):
one run's p99 is its 2nd-3rd slowest quiet request, and moves with one slow request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from perf.common.launch import launch  # noqa: E402
from perf.common.stats import quantile  # noqa: E402
from perf.streaming import hops  # noqa: E402

WORKER = ["--max-batch", "16", "--num-pages", "400", "--page-size", "16",
          "--mock-decode-step-us", "10000", "--mock-decode-us-per-seq", "100",
          "--mock-prefill-us-per-token", "20"]
FRONTEND = ["--max-inflight-per-worker", "32", "--max-queue", "64", "--queue-timeout", "10"]
SYSTEM = list(range(600, 856))  # the quiet tenant's system prompt (16 full pages)


@dataclass
class Outcomes:
    ttft: list[float] = field(default_factory=list)
    done: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    times: list[str] | None = None  # (--timeline: "T0 T1 RID" per request, for hops.py)


async def one(client: httpx.AsyncClient, key: str, prompt: list[int], max_tokens: int,
              out: Outcomes) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode()
                reason = "over_share" if "share" in text else f"http_{r.status_code}"
                out.refused[reason] = out.refused.get(reason, 0) + 1
                return
            first = True
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first and chunk.get("choices"):
                    t1 = time.perf_counter()
                    out.ttft.append(t1 - t0)
                    first = False
                    if out.times is not None:  # (the frontend's rid: the id after "cmpl-")
                        out.times.append(f"{t0:.6f} {t1:.6f} {chunk['id'].split('-', 1)[1]}")
                usage = chunk.get("usage")
                if usage:
                    out.prompt_tokens += usage["prompt_tokens"]
                    out.cached_tokens += (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0)
            out.done += 1
    except httpx.HTTPError as e:
        out.refused[type(e).__name__] = out.refused.get(type(e).__name__, 0) + 1


async def quiet(client: httpx.AsyncClient, until: float, out: Outcomes) -> None:
    i = 0
    while time.perf_counter() < until:
        i += 1
        await one(client, "quiet", SYSTEM + [(7 * i + j) % 900 for j in range(16)], 16, out)
        await asyncio.sleep(0.05)


async def noisy(client: httpx.AsyncClient, until: float, rate: float, out: Outcomes,
                prompt_tokens: int) -> None:
    tasks: set[asyncio.Task[None]] = set()
    i, t = 0, time.perf_counter()
    while t < until:
        i += 1
        prompt = [(i * 613 + j * 7) % 997 for j in range(prompt_tokens)]
        task = asyncio.create_task(one(client, "noisy", prompt, 32, out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        t += 1.0 / rate
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
    await asyncio.gather(*tasks)


async def capacity(client: httpx.AsyncClient, seconds: float, prompt_tokens: int) -> float:
    """Requests per second the cluster completes when kept full (64 at a time)."""
    out = Outcomes()
    until = time.perf_counter() + seconds

    async def loop(k: int) -> None:
        while time.perf_counter() < until:
            await one(client, f"cap{k}", [(k * 31 + j) % 997 for j in range(prompt_tokens)], 32,
                      out)
    t0 = time.perf_counter()
    await asyncio.gather(*(loop(k) for k in range(64)))
    return out.done / (time.perf_counter() - t0)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


LIMITS = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)


async def noisy_child(url: str, rate: float, seconds: float, prompt_tokens: int) -> None:
    """The noisy tenant's load, in a process of its own (`--noisy-child`): its client's work
    (hundreds of requests and SSE events a second) does not delay the quiet client's clock. Says
    `ready` when it starts sending, and its outcomes and the CPU seconds it took sending as JSON
    when done."""
    out = Outcomes()
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=LIMITS) as client:
        print("ready", flush=True)
        cpu0 = time.process_time()
        await noisy(client, time.perf_counter() + seconds, rate, out, prompt_tokens)
        cpu = time.process_time() - cpu0
    print(json.dumps({"done": out.done, "refused": out.refused, "cpu_s": cpu}), flush=True)


async def run_once(url: str, seconds: float, load: float,
                   servers_cpu: Callable[[], dict[str, float]], timeline: str = "",
                   noisy_prompt_tokens: int = 512) -> dict[str, Any]:
    """`timeline`: the servers' TANDEM_TIMELINE directory (the quiet tenant's hops are read
    from it: perf/streaming/hops.py)."""
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=LIMITS) as client:
        cap = await capacity(client, seconds / 2, noisy_prompt_tokens)
        if not cap:
            raise SystemExit("bench_tenants: no request completed in the capacity phase")
        alone = Outcomes(times=[] if timeline else None)
        t0 = time.perf_counter()
        await quiet(client, t0 + seconds, alone)
        alone_rate = alone.done / (time.perf_counter() - t0)
        if not alone.done:
            raise SystemExit(f"bench_tenants: no quiet request completed alone ({alone.refused})")
        loud, calm = Outcomes(), Outcomes(times=[] if timeline else None)
        child = await asyncio.create_subprocess_exec(
            sys.executable, os.path.abspath(__file__), "--noisy-child", url, str(load * cap),
            str(seconds), str(noisy_prompt_tokens), stdout=asyncio.subprocess.PIPE)
        try:
            assert child.stdout is not None
            ready = await asyncio.wait_for(child.stdout.readline(), 30)
            assert ready.strip() == b"ready", ready
            t0, cpu0, servers0 = time.perf_counter(), time.process_time(), servers_cpu()
            await quiet(client, t0 + seconds, calm)
            quiet_cpu, servers = time.process_time() - cpu0, servers_cpu()
            result, _ = await asyncio.wait_for(child.communicate(), seconds + 120)
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
        took = time.perf_counter() - t0
        noisy_out = json.loads(result.decode().strip().splitlines()[-1])
        loud.done, loud.refused = noisy_out["done"], noisy_out["refused"]
    # CPU through the loaded phase, in cores: is the 2-core machine short of it?
    cores = {"noisy client": noisy_out["cpu_s"] / took, "quiet client": quiet_cpu / took,
             **{name: (servers[name] - servers0[name]) / took for name in servers}}
    served = {"quiet": calm.done / took, "noisy": loud.done / took}
    fair_quiet = min(alone_rate, cap / 2)
    fair = {"quiet": fair_quiet, "noisy": max(cap - fair_quiet, 1e-9)}
    extra: dict[str, Any] = {}
    if timeline:
        extra["quiet_hops"] = quiet_hops(timeline, {"alone": alone, "loaded": calm})
    return {
        **extra,
        "capacity_rps": cap, "noisy_offered_rps": load * cap,
        "quiet_alone": {"ttft_p50_ms": quantile(alone.ttft, 0.5) * 1e3,
                        "ttft_p99_ms": quantile(alone.ttft, 0.99) * 1e3,
                        "requests": alone.done,
                        "ttfts_ms": sorted(round(t * 1e3, 1) for t in alone.ttft),
                        "cache_hit": alone.cached_tokens / max(1, alone.prompt_tokens)},
        "quiet_loaded": {"ttft_p50_ms": quantile(calm.ttft, 0.5) * 1e3,
                         "ttft_p99_ms": quantile(calm.ttft, 0.99) * 1e3, "requests": calm.done,
                         "refused": calm.refused,
                         "ttfts_ms": sorted(round(t * 1e3, 1) for t in calm.ttft),
                         "cache_hit": calm.cached_tokens / max(1, calm.prompt_tokens)},
        "noisy": {"served": loud.done, "refused": loud.refused},
        "p99_ratio": quantile(calm.ttft, 0.99) / quantile(alone.ttft, 0.99),
        "served_rps": served, "fair_share_rps": fair, "loaded_cpu_cores": cores,
        "jain": jain([served[t] / fair[t] for t in served]),
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The quiet tenant's p99 TTFT alone and loaded over every run's requests together, and their
    ratio: a p99 of a few hundred requests is their 2nd-3rd largest, so one run's p99 moves with
    a single slow request; over several runs' it is the 1% tail of all of them."""
    alone = [t for r in runs for t in r["quiet_alone"]["ttfts_ms"]]
    loaded = [t for r in runs for t in r["quiet_loaded"]["ttfts_ms"]]
    a, b = quantile(alone, 0.99), quantile(loaded, 0.99)
    return {"alone_p99_ms": a, "loaded_p99_ms": b, "p99_ratio": b / a,
            "requests_alone": len(alone), "requests_loaded": len(loaded)}


def quiet_hops(directory: str, phases: dict[str, Outcomes]) -> dict[str, Any]:
    """Each phase's quiet requests' hops (perf/streaming/hops.py): quantiles, and the slowest
    five; the loaded phase's table printed (each phase's client times are kept in the directory,
    for hops.py)."""
    tl = hops.read(directory)
    out: dict[str, Any] = {}
    for phase, o in phases.items():
        lines = o.times or []
        with open(os.path.join(directory, f"quiet-{phase}.txt"), "w") as f:
            f.write("".join(line + "\n" for line in lines))
        client = hops.client_times(lines)
        table = hops.rows(tl, list(client), client)
        out[phase] = {"requests": len(table), "hops_ms": hops.summary(table),
                      "slowest": sorted(table, key=lambda r: r["ttft"])[-5:]}
        if phase == "loaded":
            print(hops.render(table, 10), flush=True)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--noisy-child"]:  # (run_once's noisy tenant: URL RATE SECONDS TOKENS)
        url, rate, seconds = sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
        asyncio.run(noisy_child(url, rate, seconds, int(sys.argv[5])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="each phase's length")
    ap.add_argument("--runs", type=int, default=3, help="runs (a fresh cluster each); medians")
    ap.add_argument("--load", type=float, default=3.0, help="noisy load, times the capacity")
    ap.add_argument("--out", default="", help="write the runs and medians here (JSON)")
    ap.add_argument("--timeline", default="", metavar="DIR",
                    help="record the servers' request timelines (TANDEM_TIMELINE) in DIR/runN "
                    "and report where the quiet tenant's first tokens waited, hop by hop "
                    "(hops.py; the quiet client's own times are kept there as quiet-PHASE.txt)")
    ap.add_argument("--noisy-prompt-tokens", type=int, default=512,
                    help="each noisy request's prompt (and the capacity run's): 512 fills the KV "
                    "cache with prompts of its own; a short one (16) leaves decode steps alone, "
                    "the floor a step-synchronous engine sets on the quiet tenant's TTFT")
    ap.add_argument("--max-prefill-tokens", type=int, default=0,
                    help="the worker's prefill budget per step (0: not passed, the mock's own)")
    ap.add_argument("--pool", nargs="+", metavar="OUT", default=None,
                    help="run nothing: print the quiet tenant's p99 ratio over the runs of these "
                    "earlier --out files taken together (arms run in turn)")
    args = ap.parse_args()
    if args.pool:
        earlier: list[dict[str, Any]] = []
        for path in args.pool:
            with open(path) as f:
                earlier += json.load(f)["runs"]
        print(json.dumps(pooled(earlier), indent=1))
        return
    from tandem.engines.reference.checkpoint import write_tiny_model

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        write_tiny_model(model, seed=0)
        for i in range(args.runs):
            budget = ["--max-prefill-tokens", str(args.max_prefill_tokens)] \
                if args.max_prefill_tokens else []
            timeline = os.path.join(os.path.abspath(args.timeline), f"run{i}") \
                if args.timeline else ""
            env = {**os.environ, "TANDEM_TIMELINE": timeline} if timeline else None
            c = launch("agg", model, os.path.join(tmp, f"logs{i}"), [*WORKER, *budget], FRONTEND,
                       env=env)
            try:
                runs.append(asyncio.run(run_once(c.url, args.seconds, args.load, c.cpu_s,
                                                 timeline, args.noisy_prompt_tokens)))
            finally:
                c.stop()
            print(json.dumps(runs[-1]), flush=True)
    keys = [("quiet_alone", "ttft_p99_ms"), ("quiet_loaded", "ttft_p99_ms"), ("p99_ratio",),
            ("quiet_alone", "cache_hit"), ("quiet_loaded", "cache_hit"), ("jain",)]
    med = {}
    for k in keys:
        vals = []
        for r in runs:
            v: Any = r
            for part in k:
                v = v[part]
            vals.append(v)
        med[".".join(k)] = statistics.median(vals)
    pool = pooled(runs)
    print(json.dumps({"medians": med, "pooled": pool, "load_avg": os.getloadavg()}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "medians": med, "pooled": pool, "args": vars(args),
                       "server": os.environ.get("TANDEM_SERVER_PYTHONPATH", "this tree")}, f,
                      indent=1)


if __name__ == "__main__":
    main()
