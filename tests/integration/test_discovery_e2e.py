"""Worker discovery end to end.

In process (no sockets): the WorkerPool follows add/remove — a removed worker takes nothing new and
its link is dropped once its requests end; one that comes back first keeps its link; a draining
worker takes nothing new; round-robin copes with workers added later.

Real processes on loopback: four mock workers on 127.0.0.2-5 (one port), a frontend given
`--workers dns://workers.test:PORT` whose resolver reads a hosts file (the `TANDEM_DISCOVERY_HOSTS`
test seam of tandem.router.discovery). While streams run, a worker is added, one is removed (its
streams finish normally), and one is removed because it died (SIGKILL): only streams on the dead one
may fail, each with a clear error; every page is free at the end.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from tandem.router.discovery import Change
from tandem.runtime import wire
from tandem.runtime.wire import Delta, Deltas, SamplingParams, Usage, WorkerInfo
from tests.cluster import ENV, Proc
from tests.fakes import memory_pool
from tests.integration.streaming import Load, idle, until, workers
from tandem.launcher import spawn, stop_all, wait_ready

SP = SamplingParams(max_tokens=4)


def hello(pool, address: str, role: str = "agg", pages: int = 100) -> None:
    link = pool.link(address)
    link.on_message(wire.HelloReply(wire.PROTOCOL_VERSION, True, WorkerInfo(
        address, role, "mock", "m", 4, pages, 4096)))  # type: ignore[arg-type]
    link.on_message(wire.LoadReport(0, wire.Load(pages_free=pages, pages_total=pages)))


async def placed_on(pool, ids: list[int]) -> tuple[object, str]:
    h = pool.open(ids, SP)
    await asyncio.wait_for(h.__aenter__(), 2)
    return h, h.workers[0]


# --- in process -----------------------------------------------------------------------------------

async def test_pool_follows_discovery_changes() -> None:
    pool, _ = memory_pool(["agg"])
    await pool.apply(Change(added=("tcp://w1",)))
    hello(pool, "tcp://w1")
    assert [w.address for w in pool.links] == ["tcp://w0", "tcp://w1"]
    h0, a0 = await placed_on(pool, [1])
    h1, a1 = await placed_on(pool, [2])
    assert {a0, a1} == {"tcp://w0", "tcp://w1"}  # least-loaded spreads over both
    busy = pool.link("tcp://w0")
    await pool.apply(Change(removed=("tcp://w0",)))
    assert busy in pool.links and busy.legs  # its request goes on
    for i in range(4):  # nothing new lands on it
        _, a = await placed_on(pool, [10 + i])
        assert a == "tcp://w1"
    (h_w0,) = [h for h, a in ((h0, a0), (h1, a1)) if a == "tcp://w0"]
    busy.on_deltas(Deltas([Delta(h_w0.rid, 0, [7], "length", Usage(1, 1))]))  # it ends
    assert busy not in pool.links  # dropped once its last request ended
    async with asyncio.timeout(10):  # closed once its last messages had LEAVE_GRACE_S to leave
        while not busy.channel.closed:
            await asyncio.sleep(0.01)
    snap = {r["address"] for r in await pool.snapshot()}
    assert snap == {"tcp://w1"}
    await pool.close()


async def test_an_address_back_before_its_link_dropped_keeps_it() -> None:
    pool, _ = memory_pool(["agg"])
    link = pool.link("tcp://w0")
    h, _ = await placed_on(pool, [1])
    await pool.remove("tcp://w0")
    assert not pool.ready()
    await pool.add("tcp://w0")
    assert pool.ready() and pool.link("tcp://w0") is link and link.legs
    await pool.close()


async def test_removing_the_last_worker_fails_queued_requests_at_once() -> None:
    pool, _ = memory_pool(["agg"], max_inflight_per_worker=1)
    await placed_on(pool, [1])
    waiting = pool.open([2], SP)
    entering = asyncio.ensure_future(waiting.__aenter__())
    await asyncio.sleep(0.01)
    await pool.remove("tcp://w0")
    with pytest.raises(Exception, match="no worker"):
        await asyncio.wait_for(entering, 2)
    await pool.close()


async def test_a_draining_worker_takes_nothing_new() -> None:
    pool, _ = memory_pool(["agg", "agg"])
    pool.link("tcp://w0").on_message(wire.LoadReport(0, wire.Load(pages_free=100, pages_total=100, draining=True)))
    for i in range(4):
        _, a = await placed_on(pool, [i])
        assert a == "tcp://w1"
    assert [r["draining"] for r in await pool.snapshot()] == [True, False]
    pool.link("tcp://w1").on_message(wire.LoadReport(0, wire.Load(pages_free=100, pages_total=100, draining=True)))
    assert not pool.ready()
    await pool.close()


async def test_round_robin_takes_workers_added_later() -> None:
    pool, _ = memory_pool(["agg"], policy="round-robin")
    await pool.add("tcp://w1")
    hello(pool, "tcp://w1")
    got = []
    for i in range(4):
        h, a = await placed_on(pool, [i])
        got.append(a)
        h.release()
    assert got == ["tcp://w0", "tcp://w1", "tcp://w0", "tcp://w1"]
    await pool.close()


# --- real processes ---------------------------------------------------------------------------------

IPS = [f"127.0.0.{i}" for i in (2, 3, 4, 5)]
NAME = "workers.test"
MAX_TOKENS = 40  # at 20 ms per step: about 0.8 s per stream


def port_free_on_all(ips: list[str]) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for ip in ips:
                with socket.socket() as s:
                    s.bind((ip, port))
            return int(port)
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


def write_hosts(path: Path, ips: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# test seam for tandem.router.discovery\n" +
                   "".join(f"{ip} {NAME}\n" for ip in ips))
    os.replace(tmp, path)  # readers never see half a file


async def test_dns_workers_added_and_removed_while_streaming(tiny_model: str,
                                                             tmp_path: Path) -> None:
    port = port_free_on_all(IPS)
    addr = {ip: f"tcp://{ip}:{port}" for ip in IPS}
    hosts = tmp_path / "hosts"
    write_hosts(hosts, IPS[:2])
    logs = str(tmp_path)
    procs: dict[str, Proc] = {}
    for i, ip in enumerate(IPS):
        procs[ip] = spawn(f"worker{i}", [
            "worker", "--model", tiny_model, "--engine", "mock", "--host", ip, "--port", str(port),
            "--step-delay-ms", "20", "--log-level", "WARNING", "--no-auth"], log_dir=logs, env=ENV)
    http = port_free_on_all(["127.0.0.1"])
    url = f"http://127.0.0.1:{http}"
    fe = spawn("frontend", ["frontend", "--model", tiny_model, "--workers",
                            f"dns://{NAME}:{port}", "--port", str(http), "--log-level", "INFO",
                            "--no-auth"],
               log_dir=logs, env=ENV | {"TANDEM_DISCOVERY_HOSTS": str(hosts)})
    all_procs = [fe, *procs.values()]
    load: Load | None = None
    try:
        await asyncio.to_thread(wait_ready, url, all_procs, 60.0)
        rows = await until("the two listed workers up", lambda: _up(url, IPS[:2], port), 15)
        assert set(rows) == {addr[ip] for ip in IPS[:2]}

        load = Load(url, clients=8, max_tokens=MAX_TOKENS)
        await asyncio.sleep(1.0)

        t = time.monotonic()
        write_hosts(hosts, IPS[:3])  # a worker appears
        await until("the added worker serving",
                    lambda: _placed_on(url, addr[IPS[2]]), 10)
        added_after = time.monotonic() - t

        t = time.monotonic()
        write_hosts(hosts, IPS[1:3])  # a worker leaves DNS (still alive): its streams finish
        await until("the removed worker dropped",
                    lambda: _gone(url, addr[IPS[0]]), 12)
        removed_after = time.monotonic() - t

        rows = await workers(url)
        dead = addr[IPS[1]]
        placed_before = rows[dead]["placed"]
        on_dead = rows[dead]["in_flight"]
        procs[IPS[1]].kill()  # a worker dies, then leaves DNS; another joins
        rows = await workers(url)
        may_fail = on_dead + rows.get(dead, {"placed": placed_before})["placed"] - placed_before
        write_hosts(hosts, [IPS[2], IPS[3]])
        await until("the dead worker dropped", lambda: _gone(url, dead), 12)
        await until("the last worker serving", lambda: _placed_on(url, addr[IPS[3]]), 10)
        await asyncio.sleep(1.0)
        outcomes = await load.stop()
        load = None

        failed = [o for o in outcomes if not o.ok]
        ok = [o for o in outcomes if o.ok]
        print(f"\n{len(outcomes)} streams, {len(failed)} failed (at most {may_fail} were on the "
              f"killed worker); added worker serving after {added_after:.1f}s, removed one "
              f"dropped after {removed_after:.1f}s")
        assert len(failed) <= may_fail, [o.error for o in failed]
        for o in failed:  # clear errors, all about the lost worker: mid-stream, or before a token
            assert (o.status == 200 and o.done or o.status == 502) and "worker" in o.error, o
        assert all(o.completion_tokens == MAX_TOKENS and o.finish == "length" for o in ok)
        assert len(ok) >= 20
        rows = await until("every page free", lambda: _idle(url), 10)
        assert set(rows) == {addr[IPS[2]], addr[IPS[3]]}
        assert procs[IPS[0]].alive()  # removed from DNS, never stopped by anyone
    finally:
        if load is not None:
            await load.stop(10)
        await asyncio.to_thread(stop_all, all_procs, 15.0)


async def _up(url: str, ips: list[str], port: int) -> dict | None:
    rows = await workers(url)
    want = {f"tcp://{ip}:{port}" for ip in ips}
    return rows if set(rows) == want and all(r["state"] == "up" for r in rows.values()) else None


async def _placed_on(url: str, address: str) -> bool:
    row = (await workers(url)).get(address)
    return bool(row and row["state"] == "up" and row["placed"] > 0)


async def _gone(url: str, address: str) -> bool:
    return address not in await workers(url)


async def _idle(url: str) -> dict | None:
    rows = await workers(url)
    return rows if idle(rows) else None
