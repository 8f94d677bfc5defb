"""A worker's request channel against hostile or broken frontends (in memory through the wire
encoding, as frontends played by the test; on real ZMQ where the socket layer is the point): bad
requests get an error delta and never reach the engine, bad credit cannot close the window, a
frontend may abort only its own requests, a draining worker says so and takes nothing new, the
refusals are counted on the health port's /metrics, and a receive loop that dies takes the process
down with status 1 (so a supervisor restarts it) instead of leaving a deaf worker up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tandem.config import MockTiming, WorkerConfig
from tandem.engines.base import EngineRequest, Handle, OutputSink
from tandem.engines.mock import MockEngine
from tandem.runtime import transport, wire
from tandem.runtime.channel import MemoryChannel, MemoryRouter
from tandem.runtime.wire import (
    Abort, Credit, Deltas, ErrorKind, Generate, Generates, Hello, HelloReply, LoadQuery,
    LoadReport, SamplingParams, WorkerInfo,
)
from tandem.worker.health import HealthServer
from tandem.worker.metrics import worker_registry
from tandem.worker.server import WorkerServer
from tests.cluster import ENV, free_port, spawn
from tests.waits import until

VOCAB = 500


@pytest.fixture
def mock_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": VOCAB, "max_position_embeddings": 4096, "eos_token_id": 2}))
    return str(tmp_path)


class SpyEngine(MockEngine):
    """The mock engine, remembering every request that reached it."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.seen: list[str] = []

    def submit(self, req: EngineRequest, sink: OutputSink) -> Handle:
        self.seen.append(req.rid)
        return super().submit(req, sink)


class Peer:
    """The frontend's side of the protocol, played by the test: on the worker's in-memory router,
    or as a raw ZMQ DEALER to an address."""

    def __init__(self, where: MemoryRouter | str, identity: bytes) -> None:
        self.sock: zmq.asyncio.Socket | None = None
        self.end: MemoryChannel | None = None
        if isinstance(where, str):
            self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.IDENTITY, identity)
            self.sock.connect(where)
        else:
            self.end = where.connect(identity)

    async def send(self, msg: wire.Message) -> None:
        if self.end is not None:
            self.end.send_nowait(msg)
        else:
            assert self.sock is not None
            await self.sock.send_multipart([wire.encode(msg)])

    async def recv(self, timeout: float = 5.0) -> wire.ToFrontend:
        if self.end is not None:
            return await asyncio.wait_for(anext(aiter(self.end)), timeout)
        assert self.sock is not None
        parts = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        return wire.TO_FRONTEND.decode(parts[0])

    def close(self) -> None:
        if self.end is not None:
            self.end.close()
        if self.sock is not None:
            self.sock.close(0)

    async def hello(self) -> None:
        await self.send(Hello(wire.PROTOCOL_VERSION, "raw"))
        assert isinstance(await self.recv(), HelloReply)

    async def until_finished(self, rids: set[str], timeout: float = 10.0,
                             credit: bool = True) -> dict[str, wire.Delta]:
        """Read (crediting each Deltas message) until every rid has its last delta."""
        last: dict[str, wire.Delta] = {}
        async with asyncio.timeout(timeout):
            while not rids <= set(last):
                msg = await self.recv(timeout)
                if isinstance(msg, Deltas):
                    last.update({d.rid: d for d in msg.items if d.finish_reason})
                    if credit:
                        await self.send(Credit(1))
        return last


@contextlib.asynccontextmanager
async def worker(mock_dir: str, zmq_socket: bool = False, **cfg: Any) -> AsyncIterator[
        tuple[WorkerServer, SpyEngine, MemoryRouter | str]]:
    """A worker on an in-memory router (`zmq_socket`: on a ZMQ ROUTER bound to a free port)."""
    port = free_port() if zmq_socket else 7100
    config = WorkerConfig(engine="mock", model=mock_dir, port=port, **cfg)
    engine = SpyEngine(mock_dir, page_size=16, num_pages=256, max_batch=16,
                       timing=MockTiming(step_delay_ms=2))
    await engine.start()
    router: MemoryRouter | None = None
    if not zmq_socket:
        router = MemoryRouter(decoders=(wire.TO_WORKER, wire.TO_FRONTEND))
    server = WorkerServer(config, engine, WorkerInfo("w", "agg", "mock", "m", 16, 256, 4096),
                          channel=router)
    stop = asyncio.Event()
    task = asyncio.create_task(server.run(stop))
    try:
        yield server, engine, router if router is not None else f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await engine.shutdown()
        assert engine.pool.idle()  # every page came back (free or cached)
        engine.pool.check()


BAD = {
    "out-of-vocab": Generate("b1", [1, VOCAB], SamplingParams()),
    "negative-id": Generate("b2", [-5, 1], SamplingParams()),
    "huge-id": Generate("b3", [2**40], SamplingParams()),
    "empty": Generate("b4", [], SamplingParams()),
    "neg-max-tokens": Generate("b5", [1], SamplingParams(max_tokens=-1)),
    "neg-top-k": Generate("b6", [1], SamplingParams(top_k=-1)),
    "nan-temperature": Generate("b7", [1], SamplingParams(temperature=math.nan)),
    "inf-top-p": Generate("b8", [1], SamplingParams(top_p=math.inf)),
    "neg-seed": Generate("b9", [1], SamplingParams(seed=-1)),
    "stop-list": Generate("b10", [1], SamplingParams(stop_token_ids=tuple(range(100_000)))),
    "bootstrap-port": Generate("b11", [1], SamplingParams(),
                               wire.Bootstrap("127.0.0.1", 0, 1)),
}


async def test_bad_requests_get_bad_request_and_never_reach_the_engine(mock_dir: str) -> None:
    async with worker(mock_dir) as (_, engine, address):
        fe = Peer(address, b"fe")
        await fe.hello()
        before = transport.protocol_errors[("worker", "bad request")]
        good = Generate("good", [3, 4, 5], SamplingParams(max_tokens=8))
        await fe.send(Generates([*BAD.values(), good]))  # one batch: the good one still runs
        last = await fe.until_finished({g.rid for g in BAD.values()} | {"good"})
        for name, g in BAD.items():
            d = last[g.rid]
            assert (d.finish_reason, d.error_kind) == ("error", ErrorKind.BAD_REQUEST), name
        assert last["good"].finish_reason == "length" and last["good"].usage is not None
        assert engine.seen == ["good"]
        assert transport.protocol_errors[("worker", "bad request")] - before == len(BAD)
        fe.close()


async def test_bad_credit_cannot_close_the_window(mock_dir: str) -> None:
    async with worker(mock_dir, delta_window=2) as (_, _engine, address):
        fe = Peer(address, b"fe")
        await fe.hello()
        await fe.send(Credit(-1000))  # as if 1000 more messages were in flight
        await fe.send(Credit(0))
        await fe.send(Generates([Generate("r", [7, 8], SamplingParams(max_tokens=60,
                                                                      ignore_eos=True))]))
        last = await fe.until_finished({"r"})
        assert last["r"].finish_reason == "length"
        assert transport.protocol_errors[("worker", "credit not positive")] >= 2
        fe.close()


async def test_a_frontend_aborts_only_its_own_requests(mock_dir: str) -> None:
    async with worker(mock_dir) as (server, _engine, address):
        a, b = Peer(address, b"frontend-a"), Peer(address, b"frontend-b")
        await a.hello()
        await b.hello()
        before = transport.protocol_errors[("worker", "abort of another frontend's request")]
        await a.send(Generates([Generate("a-1", [9, 9], SamplingParams(max_tokens=300,
                                                                       ignore_eos=True)),
                                Generate("a-2", [9, 8], SamplingParams(max_tokens=300,
                                                                       ignore_eos=True))]))
        await until(lambda: server.num_requests == 2)
        await b.send(Abort(["a-1", "a-2"]))  # not b's: ignored, counted
        await a.send(Abort(["a-2"]))  # a's own: ends it
        last = await a.until_finished({"a-1"}, timeout=20)
        assert last["a-1"].finish_reason == "length"
        assert last["a-1"].usage is not None and last["a-1"].usage.completion_tokens == 300
        assert "a-2" not in last and server.num_requests == 0
        after = transport.protocol_errors[("worker", "abort of another frontend's request")]
        assert after - before == 2
        a.close()
        b.close()


async def test_a_draining_worker_says_so_and_takes_no_new_work(mock_dir: str) -> None:
    async with worker(mock_dir, drain_timeout_s=30.0) as (server, engine, address):
        fe = Peer(address, b"fe")
        await fe.hello()
        await fe.send(LoadQuery(1))
        assert isinstance(r := await fe.recv(), LoadReport) and not r.load.draining
        await fe.send(Generates([Generate("long", [5], SamplingParams(max_tokens=150,
                                                                      ignore_eos=True))]))
        await until(lambda: engine.seen == ["long"])
        drain = asyncio.create_task(server.drain(30.0))
        await asyncio.sleep(0)
        assert not server.ready
        await fe.send(Generates([Generate("new", [5], SamplingParams(max_tokens=4))]))
        await fe.send(LoadQuery(2))
        reports, last = [], {}
        async with asyncio.timeout(10):
            while "long" not in last or not reports:
                msg = await fe.recv()
                if isinstance(msg, LoadReport):
                    reports.append(msg.load)
                elif isinstance(msg, Deltas):
                    if any(d.rid == "new" for d in msg.items):  # sent after the drain began
                        assert msg.load is not None and msg.load.draining
                    last.update({d.rid: d for d in msg.items if d.finish_reason})
                    await fe.send(Credit(1))
        assert reports[0].draining
        assert last["new"].error_kind == ErrorKind.DRAINING
        assert last["long"].finish_reason == "length"  # in-flight work still finishes
        assert engine.seen == ["long"]
        await drain
        fe.close()


async def test_refusals_are_on_the_health_port_metrics(mock_dir: str) -> None:
    async with worker(mock_dir, zmq_socket=True) as (server, _engine, address):
        fe = Peer(address, b"fe")
        await fe.hello()
        assert fe.sock is not None  # (raw bytes: through the real socket)
        await fe.sock.send_multipart([bytes([0x93, 1, 0x03, 0xA2, 0xFF, 0xFE])])
        await fe.send(Generates([BAD["empty"]]))
        await fe.until_finished({"b4"})
        reg = worker_registry(lambda: server.num_requests, lambda: server.draining)
        async with HealthServer(lambda: True, "127.0.0.1", 0, metrics=reg.render) as health:
            url = f"http://127.0.0.1:{health.port}/metrics"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        text = body.decode()
        assert sample(text, "tandem_worker_protocol_errors_total", socket="worker",
                      error="bad request") >= 1
        assert sample(text, "tandem_worker_bad_messages_total", socket="worker") >= 1
        assert sample(text, "tandem_worker_draining") == 0
        fe.close()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text, whatever the order of its labels."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


BROKEN_WORKER = """
import sys
from tandem.runtime import transport

async def broken(sock, decoder, log):  # the receive loop's source fails: a fault injected
    raise RuntimeError("injected receive failure")
    yield

transport.router_messages = broken
from tandem.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_receive_loop_ends_the_process_with_status_1(mock_dir: str,
                                                            tmp_path: Path) -> None:
    script = tmp_path / "broken_worker.py"
    script.write_text(textwrap.dedent(BROKEN_WORKER))
    argv = [sys.executable, str(script), "worker", "--engine", "mock", "--model", mock_dir,
            "--port", str(free_port()), "--drain-timeout", "1", "--no-auth"]
    p = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=30)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "fatal: task worker-recv died" in p.stderr
    assert "injected receive failure" in p.stderr


async def test_from_sigterm_a_worker_process_is_not_ready_and_reports_draining(
        mock_dir: str, tmp_path: Path) -> None:
    port, health = free_port(), free_port()
    p = spawn("drainer", ["worker", "--engine", "mock", "--model", mock_dir, "--port", str(port),
                          "--health-port", str(health), "--drain-timeout", "30",
                          "--step-delay-ms", "20"], str(tmp_path))
    url = f"http://127.0.0.1:{health}/health"

    def status() -> int:
        try:
            return int(urllib.request.urlopen(url, timeout=2).status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    fe = Peer(f"tcp://127.0.0.1:{port}", b"fe")
    try:
        async with asyncio.timeout(30):
            while await asyncio.to_thread(status) != 200:
                await asyncio.sleep(0.1)
        await fe.hello()
        # "long" runs for 20 s (1000 steps of 20 ms): the worker drains, up and not ready, for
        # longer than any loaded machine takes to finish this test (which then kills it).
        await fe.send(Generates([Generate("long", [5], SamplingParams(max_tokens=1000,
                                                                      ignore_eos=True))]))
        assert isinstance(await fe.recv(), Deltas)  # running
        os.kill(p.pid, signal.SIGTERM)
        async with asyncio.timeout(10):  # (the signal is handled when the worker gets to it)
            while (code := await asyncio.to_thread(status)) == 200:
                await asyncio.sleep(0.02)
        assert code == 503
        await fe.send(LoadQuery(7))
        await fe.send(Generates([Generate("new", [5], SamplingParams(max_tokens=4))]))
        seen_report, refused = False, False
        async with asyncio.timeout(10):
            while not (seen_report and refused):
                msg = await fe.recv()
                if isinstance(msg, LoadReport):
                    seen_report = msg.load.draining
                    assert seen_report
                elif isinstance(msg, Deltas):
                    refused |= any(d.rid == "new" and d.error_kind == ErrorKind.DRAINING
                                   for d in msg.items)
                    await fe.send(Credit(1))
        assert p.alive()  # still finishing "long"
    finally:
        fe.close()
        p.kill()


async def test_a_decode_worker_fetches_only_from_prefill_workers_its_frontend_announced(
        mock_dir: str) -> None:
    """A Generate naming a bootstrap address its frontend did not announce (Prefills) is refused
    before the engine sees it: the decode side never connects there, never sends it its transfer
    metadata or page addresses. Another frontend's announcement does not count. (Seen before: any
    local process could make a decode worker hand its pages to a 'prefill' of its choosing.)"""
    async with worker(mock_dir) as (server, engine, router):
        server.info.role = "decode"  # (the check is the decode role's; the engine is not reached)
        fe, other = Peer(router, b"fe"), Peer(router, b"other")
        await fe.hello()
        await other.hello()
        before = transport.protocol_errors[("worker", "bootstrap not announced")]
        bad = transport.protocol_errors[("worker", "bad prefills")]
        await other.send(wire.Prefills(["10.9.9.9:7200"]))
        await fe.send(wire.Prefills(["127.0.0.1:7200"]))
        sp = SamplingParams(max_tokens=4)
        await fe.send(Generates([Generate("evil", [5, 6], sp, wire.Bootstrap("10.9.9.9", 7200, 1)),
                                 Generate("bad-port", [5, 6], sp,
                                          wire.Bootstrap("127.0.0.1", 7201, 2))]))
        last = await fe.until_finished({"evil", "bad-port"})
        for rid in ("evil", "bad-port"):
            assert (last[rid].finish_reason, last[rid].error_kind) == ("error",
                                                                       ErrorKind.BAD_REQUEST)
            assert "not one this frontend announced" in last[rid].error
        assert engine.seen == []
        assert transport.protocol_errors[("worker", "bootstrap not announced")] - before == 2
        await fe.send(wire.Prefills(["x" * 300 + ":1"]))  # refused, counted; the last set stands
        await until(lambda: transport.protocol_errors[("worker", "bad prefills")] == bad + 1)
        assert server.frontends.announced(b"fe", "127.0.0.1:7200")
        fe.close()
        other.close()
