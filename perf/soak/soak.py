"""Soak: a mixed load on 1P2D for a while, with each role killed (SIGKILL) and restarted once.

    .venv/bin/python perf/soak/soak.py [--duration 600] [--engine mock] [--out perf/results/soak]

1. Starts a 1P2D cluster and one frontend on 127.0.0.1 (perf.soak.soak_cluster: tandem's launcher and
   `tandem up`'s supervision; the mock engine paced at 20 ms a decode step, so a stream lasts
   0.1-1.3 s; `--engine reference` runs the tiny torch model instead).
2. Draws a pool of request bodies from a seed (perf.soak.soak_mix: chat and completions, streamed and
   not, n > 1, logprobs, stop strings, greedy or seeded sampling, streams the client leaves), and
   runs each once, fault-free: its answer is the reference (the run also warms the processes up).
   Once idle, each process's RSS is its start.
3. For `--duration` seconds `--concurrency` clients send bodies from the pool one after another
   (each client its own seeded draw); every answer is compared with its reference (text,
   finish_reason, usage, logprobs entry by entry; a stream left on purpose must be a prefix;
   see `--logprob-tolerance` for the reference engine).
   Meanwhile a decode worker, the prefill worker and the frontend are killed in that order
   (at 15%, 35% and 55% of the duration, each after the one before is back), and each is waited
   for until the supervisor's replacement serves again: [kill, back] is its fault window.
4. Then: wait until idle, check that no page is held (the frontend's /workers and each worker's own
   in-flight count), read every process's RSS, stop everything by PID.

Writes OUT.json and OUT.md: the command, the counts by kind, mismatches, failures inside fault
windows and outside (none may follow the last restart), pages, and RSS per process. The exit
status is 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as `python perf/soak/soak.py`: the repository root is the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from perf.soak import soak_report  # noqa: E402
from perf.soak.soak_client import Connection, Outcome  # noqa: E402
from perf.soak.soak_cluster import SoakCluster, idle_state  # noqa: E402
from perf.soak.soak_mix import Body, finish, judge, make_pool, pilot_bodies  # noqa: E402
from tandem.launcher import get_json  # noqa: E402

FAULTS = ("decode-0", "prefill", "frontend")


@dataclass
class SoakConfig:
    duration_s: float = 600.0
    engine: str = "mock"
    out: str = "perf/results/soak"
    model: str = "models/tiny"
    concurrency: int = 12
    pool_size: int = 96
    seed: int = 27
    fault_at: tuple[float, ...] = (0.15, 0.35, 0.55)  # fractions of the duration
    min_gap_s: float = 3.0  # between one fault coming back and the next kill
    back_timeout_s: float = 90.0
    idle_timeout_s: float = 60.0
    request_timeout_s: float = 60.0
    decode_step_us: int = 20000
    prefill_us_per_token: int = 200
    rss_sample_s: float = 5.0
    num_pages: int = 0  # KV pages per worker (0: the engine's default) ...
    host_kv_pages: int = 0  # ... and a host tier of this many (0: none)
    # Logprob values may differ by this much (-1: 0 on the mock engine, whose values are exact;
    # 1e-4 on the reference engine, whose float results move by about 1e-6 with the batch a
    # sequence shares a step with, faults or not). Everything else is compared exactly.
    logprob_tolerance: float = -1.0
    log_dir: str = ""
    write: bool = True  # OUT.json and OUT.md
    argv: list[str] = field(default_factory=list)


@dataclass
class Record:
    """One request of the soak, compared and reduced (no answer kept)."""

    slot: int
    body: int
    started: float
    ended: float
    status: int
    kind: str  # "" = ok
    error: str
    mismatch: str
    closed_early: bool


@dataclass
class Fault:
    name: str
    old_pid: int
    killed: float
    back: float | None = None
    new_pid: int = 0
    rss_at_back: int = 0


def tolerance(cfg: SoakConfig) -> float:
    if cfg.logprob_tolerance >= 0:
        return cfg.logprob_tolerance
    return 0.0 if cfg.engine == "mock" else 1e-4


def worker_args(cfg: SoakConfig) -> list[str]:
    pages = ["--num-pages", str(cfg.num_pages)] if cfg.num_pages else []
    if cfg.host_kv_pages:
        pages += ["--host-kv-pages", str(cfg.host_kv_pages)]
    if cfg.engine != "mock":
        return pages
    return ["--mock-decode-step-us", str(cfg.decode_step_us),
            "--mock-prefill-us-per-token", str(cfg.prefill_us_per_token), *pages]


async def run_bodies(url: str, bodies: list[Body], concurrency: int,
                     timeout_s: float) -> dict[int, Outcome]:
    """Each body once, `concurrency` at a time, streams read to the end (no disconnects)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    todo = list(bodies)
    out: dict[int, Outcome] = {}

    async def worker() -> None:
        conn = Connection(host, int(port))
        try:
            while todo:
                b = todo.pop()
                out[b.id] = await conn.request(b.path, b.api, b.encoded or b.encode(), b.stream,
                                               0, timeout_s)
        finally:
            await conn.close()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def reference(cfg: SoakConfig, url: str, model: str) -> tuple[list[Body], dict]:
    """The pool, its stop strings filled in from pilot runs, and each body's fault-free answer."""
    pool = make_pool(cfg.pool_size, cfg.seed, model)
    pilots = await run_bodies(url, pilot_bodies(pool), cfg.concurrency, cfg.request_timeout_s)
    bad = {i: o.error for i, o in pilots.items() if o.error}
    if bad:
        raise RuntimeError(f"pilot requests failed with no fault injected: {bad}")
    finish(pool, {i: o.canonical["choices"][0][0] for i, o in pilots.items()}, cfg.seed)
    refs = await run_bodies(url, pool, cfg.concurrency, cfg.request_timeout_s)
    bad = {i: o.error for i, o in refs.items() if o.error}
    if bad:
        raise RuntimeError(f"reference requests failed with no fault injected: {bad}")
    return pool, {i: o.canonical for i, o in refs.items()}


async def load(cfg: SoakConfig, url: str, pool: list[Body], refs: dict, until: float,
               records: list[Record]) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    tol = tolerance(cfg)

    async def slot(i: int) -> None:
        rng = random.Random(cfg.seed * 1_000_003 + i)
        conn = Connection(host, int(port))
        try:
            while time.monotonic() < until:
                b = pool[rng.randrange(len(pool))]
                t = time.monotonic()
                o = await conn.request(b.path, b.api, b.encoded, b.stream, b.disconnect_after,
                                       cfg.request_timeout_s)
                why = "" if o.error else judge(b, o.canonical, refs[b.id], tol)
                records.append(Record(i, b.id, t, time.monotonic(), o.status, o.kind, o.error,
                                      why, o.closed_early))
                if o.error:
                    await asyncio.sleep(0.2)  # a client backs off a little after a failure
        finally:
            await conn.close()
    await asyncio.gather(*(slot(i) for i in range(cfg.concurrency)))


async def inject(cfg: SoakConfig, c: SoakCluster, t0: float, faults: list[Fault],
                 extra: dict) -> None:
    """Kill each role in turn and wait for its replacement to serve (module docstring, 3)."""
    after = t0
    for name, frac in zip(FAULTS, cfg.fault_at):
        at = max(t0 + frac * cfg.duration_s, after + cfg.min_gap_s)
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if name == "frontend":
            extra["migrations_before_frontend_kill"] = await asyncio.to_thread(
                c.frontend_metric, "tandem_request_migrations_total")
        f = Fault(name, 0, time.monotonic())
        f.old_pid = c.kill(name)
        faults.append(f)
        print(f"soak: [{f.killed - t0:6.1f}s] killed {name} (pid {f.old_pid})", flush=True)
        while not await asyncio.to_thread(c.serving, name, f.old_pid):
            if time.monotonic() - f.killed > cfg.back_timeout_s:
                print(f"soak: {name} not back after {cfg.back_timeout_s:g}s; no more faults",
                      flush=True)
                return
            await asyncio.sleep(0.1)
        f.back, f.new_pid = time.monotonic(), c.pid(name)
        f.rss_at_back = (await asyncio.to_thread(c.rss)).get(name, {}).get("rss", 0)
        after = f.back
        print(f"soak: [{f.back - t0:6.1f}s] {name} back (pid {f.new_pid}) after "
              f"{f.back - f.killed:.1f}s", flush=True)


async def sample_rss(c: SoakCluster, every_s: float, t0: float, samples: list) -> None:
    while True:
        samples.append([round(time.monotonic() - t0, 1), await asyncio.to_thread(c.rss)])
        await asyncio.sleep(every_s)


async def wait_idle(c: SoakCluster, timeout_s: float) -> tuple[bool, float, list, dict]:
    t = time.monotonic()
    while True:
        ok, rows, own = await asyncio.to_thread(idle_state, c)
        if ok or time.monotonic() - t > timeout_s:
            return ok, time.monotonic() - t, rows, own
        await asyncio.sleep(0.25)


async def progress(records: list[Record], t0: float, every_s: float = 10.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        bad = sum(1 for r in records if r.kind)
        wrong = sum(1 for r in records if r.mismatch)
        print(f"soak: [{time.monotonic() - t0:6.1f}s] {len(records)} requests, {bad} failed, "
              f"{wrong} mismatched", flush=True)


async def soak(cfg: SoakConfig, c: SoakCluster) -> dict:
    model = get_json(c.url + "/v1/models")["data"][0]["id"]
    t_ref = time.monotonic()
    pool, refs = await reference(cfg, c.url, model)
    ref_s = time.monotonic() - t_ref
    idle0, _, rows0, _ = await wait_idle(c, cfg.idle_timeout_s)
    if not idle0:
        raise RuntimeError(f"not idle after the fault-free reference run: {rows0}")
    rss_start = c.rss()
    print(f"soak: reference: {len(pool)} bodies in {ref_s:.1f}s; load for "
          f"{cfg.duration_s:g}s at concurrency {cfg.concurrency}", flush=True)
    records: list[Record] = []
    faults: list[Fault] = []
    extra: dict = {}
    samples: list = []
    t0 = time.monotonic()
    helpers = [asyncio.create_task(sample_rss(c, cfg.rss_sample_s, t0, samples)),
               asyncio.create_task(progress(records, t0))]
    injector = asyncio.create_task(inject(cfg, c, t0, faults, extra))
    try:
        await load(cfg, c.url, pool, refs, t0 + cfg.duration_s, records)
        load_s = time.monotonic() - t0
        if not injector.done():
            print("soak: the load ended before every fault came back", flush=True)
            injector.cancel()
        await asyncio.gather(injector, return_exceptions=True)
    finally:
        for h in (*helpers, injector):
            h.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
    idle, idle_s, rows, own = await wait_idle(c, cfg.idle_timeout_s)
    rss_end = c.rss()
    extra["migrations_at_end"] = c.frontend_metric("tandem_request_migrations_total")
    result = soak_report.summarize(
        cfg=cfg, pool=pool, records=records, faults=faults, t0=t0, load_s=load_s, ref_s=ref_s,
        refs=refs, restarts=c.restarts, supervise_error=c.supervise_error, idle=idle,
        idle_s=idle_s, rows=rows, own=own, rss_start=rss_start, rss_end=rss_end, samples=samples,
        extra=extra)
    result["logprob_tolerance"] = tolerance(cfg)
    return result


def run(cfg: SoakConfig) -> dict:
    """The whole soak; every process it started is stopped by PID before it returns or raises."""
    import uvloop

    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="tandem-soak-")
    c = SoakCluster(cfg.model, log_dir, cfg.engine, worker_args(cfg))

    def stop_on_term(sig: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(sig).name)

    old = signal.signal(signal.SIGTERM, stop_on_term) \
        if _main_thread() else None
    try:
        c.start()
        print(f"soak: 1P2D up at {c.url} ({cfg.engine} engine), pids {c.pids()}, logs {log_dir}",
              flush=True)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(soak(cfg, c))
    finally:
        c.stop()
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    result["log_dir"] = log_dir
    if cfg.write:
        soak_report.write(result, cfg.out)
    return result


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def parse_args(argv: list[str] | None) -> SoakConfig:
    d = SoakConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    ap.add_argument("--engine", default=d.engine, choices=("mock", "reference"))
    ap.add_argument("--out", default=d.out, help="writes OUT.json and OUT.md")
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--pool", type=int, default=d.pool_size, help="distinct request bodies")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--decode-step-us", type=int, default=d.decode_step_us,
                    help="mock engine: µs per decode step (paces the streams)")
    ap.add_argument("--logprob-tolerance", type=float, default=d.logprob_tolerance,
                    help="how far logprob values may differ (default: 0 on mock, 1e-4 on "
                    "reference)")
    ap.add_argument("--log-dir", default="", help="the processes' logs (default: a temp dir)")
    ap.add_argument("--num-pages", type=int, default=d.num_pages, help="KV pages per worker "
                    "(default 0: the engine's own)")
    ap.add_argument("--host-kv-pages", type=int, default=d.host_kv_pages, help="a host tier "
                    "of this many pages per worker (default 0: none)")
    a = ap.parse_args(argv)
    return SoakConfig(duration_s=a.duration, engine=a.engine, out=a.out, model=a.model,
                      concurrency=a.concurrency, pool_size=a.pool, seed=a.seed,
                      decode_step_us=a.decode_step_us, log_dir=a.log_dir,
                      logprob_tolerance=a.logprob_tolerance, num_pages=a.num_pages,
                      host_kv_pages=a.host_kv_pages, argv=list(sys.argv[1:] if argv is None else argv))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        result = run(cfg)
    except KeyboardInterrupt:
        print("soak: interrupted; every process stopped", file=sys.stderr)
        return 130
    print(soak_report.verdict(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
