"""Drain: SIGTERM to a worker under load (two aggregated mock workers, 20 ms per step, one
frontend, eight clients streaming one request after another).

- The signalled worker turns not-ready on its health port at once.
- It reports `draining` in its load, and the router places nothing new on it from the moment it
  knows (the frontend's per-worker placement counter stops); new requests go to the other worker.
- Its in-flight streams finish (a generous drain deadline), or the drain deadline ends them and
  the frontend moves them to the other worker (a deadline shorter than the streams), and it exits
  within the deadline.
- A request can still reach it in the instant between the signal and the frontend hearing of it
  (one engine step, at most); the worker refuses it as draining, and the frontend moves it too.
  No stream fails.
- Every page is free afterwards on the worker that stayed.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tandem.launcher import stop_all, wait_ready
from tests.cluster import Cluster, free_port, spawn
from tests.integration.streaming import Load, idle, until, workers


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0  # not listening (any more)


@pytest.mark.parametrize("drain_s, max_tokens, in_flight_end", [
    (8.0, 40, "complete"),  # streams of ~0.8 s, a deadline of 8 s: they all finish
    (2.0, 400, "moved"),  # streams of ~8 s, a deadline of 2 s: they move to the other worker
])
async def test_sigterm_under_load(tiny_model: str, tmp_path: Path, drain_s: float,
                                  max_tokens: int, in_flight_end: str) -> None:
    c = Cluster(tiny_model, str(tmp_path))
    hports = [free_port(), free_port()]
    for hp in hports:
        c.add_worker("mock", ["--step-delay-ms", "20", "--health-port", str(hp),
                              "--drain-timeout", str(drain_s)])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fe = spawn("frontend", ["frontend", "--model", tiny_model, "--workers",
                            ",".join(w.address for w in c.workers), "--port", str(port),
                            "--log-level", "WARNING"], str(tmp_path))
    victim, other = c.workers
    load: Load | None = None
    try:
        await asyncio.to_thread(wait_ready, url, [fe, *c.workers], 60.0)
        assert health(hports[0]) == 200
        load = Load(url, clients=8, max_tokens=max_tokens, timeout=60)
        await until("streams on the victim", lambda: _in_flight(url, victim.address), 10)
        on_victim = (await workers(url))[victim.address]["in_flight"]

        t_sig = time.monotonic()
        victim.popen.send_signal(signal.SIGTERM)
        # Not ready at once, not at its exit: its health port answers 503 while it drains. With
        # streams longer than the deadline it drains for all of drain_s; when they all finish
        # first it may be gone (0) before we look, as a worker with nothing left to do should.
        (code,) = await until("victim not ready", lambda: _not_ready(hports[0]), 10.0, every=0.01)
        not_ready_after = time.monotonic() - t_sig
        row = await until("the frontend sees it draining",
                          lambda: _draining_or_gone(url, victim.address), 5, every=0.02)
        placed_seen = row["placed"] if isinstance(row, dict) else None

        await asyncio.to_thread(victim.popen.wait, drain_s + 10)
        exited_after = time.monotonic() - t_sig
        if placed_seen is not None:  # nothing placed on it since the router knew
            row = (await workers(url)).get(victim.address)
            assert row is None or row["placed"] == placed_seen, (row, placed_seen)
        await asyncio.sleep(1.0)  # the other worker carries on alone
        outcomes = await load.stop(timeout=max_tokens * 0.05 + 30)
        load = None

        failed = [o for o in outcomes if not o.ok]
        moved = _metric(url, "tandem_request_migrations_total")
        print(f"\n{len(outcomes)} streams ({on_victim} on the victim at SIGTERM); not ready "
              f"after {not_ready_after * 1000:.0f} ms, exited after {exited_after:.2f}s; "
              f"{moved:g} moved to the other worker")
        assert code == 503 or (in_flight_end == "complete" and code == 0), code
        # Exits by its deadline (the bound leaves seconds for a loaded machine's exit; that the
        # deadline cut the streams is shown by the moves below).
        assert victim.returncode == 0 and exited_after < drain_s + 5.0
        assert not failed, [(o.status, o.error) for o in failed]
        if in_flight_end == "moved":
            assert moved >= 1
        done = [o for o in outcomes if o.ok]
        assert done and all(o.completion_tokens == max_tokens for o in done)
        assert other.alive() and fe.alive()
        await until("every page free", lambda: _idle(url), 10)
    finally:
        if load is not None:
            await load.stop(10)
        await asyncio.to_thread(stop_all, [fe, *c.workers], 15.0)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as f:
        for line in f.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def _in_flight(url: str, address: str) -> bool:
    return (await workers(url))[address]["in_flight"] > 0


def _not_ready(port: int) -> tuple[int] | None:
    """(its health code) once it is not 200: 503 while it drains, 0 once it is gone."""
    code = health(port)
    return None if code == 200 else (code,)


async def _draining_or_gone(url: str, address: str) -> dict | bool:
    row = (await workers(url)).get(address)
    if row is None or row["state"] != "up":
        return True
    return row if row["draining"] else False


async def _idle(url: str) -> bool:
    return idle(await workers(url))
