"""KV page WRITEs over NIXL between two real processes on loopback (UCX tcp+cma).

The decode side (target) runs in a spawned process with a page-major KV tensor; the prefill side
(initiator) is this test process. As in PD, only the target's metadata and layout travel: the
initiator loads them, the target never loads the initiator's. Checks: exact bytes in the right
pages and nowhere else, a dead peer failing fast, a deadline that fires and leaves no handle
behind. Every spawned process is stopped by PID with a deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

pytest.importorskip("nixl")

import torch  # noqa: E402

from tandem.kv.transfer.nixl import KvAgent  # noqa: E402
from tandem.runtime.errors import KvTransferError, KvTransferTimeout, PeerGone  # noqa: E402
from tandem.runtime.wire import KvLayout  # noqa: E402

UCX_ENV = {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}

# [pages, layers, k/v, page_size, kv_heads, head_dim], float32: one page = 2 KiB.
SHAPE = (32, 2, 2, 4, 2, 16)
NUM_PAGES = SHAPE[0]
PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 4
STOP_S = 5.0


@pytest.fixture(scope="module", autouse=True)
def ucx_env() -> Iterator[None]:
    # This process is an agent too (UCX reads these at agent creation); children inherit them.
    with pytest.MonkeyPatch.context() as mp_env:
        for k, v in UCX_ENV.items():
            mp_env.setenv(k, v)
        yield


def _target_main(conn: Connection, name: str, progress: bool) -> None:
    """Decode side: owns a zeroed KV tensor and answers commands over the pipe."""
    kv = torch.zeros(SHAPE, dtype=torch.float32)
    interval = 0.001 if progress else None
    agent = KvAgent(name, kv, PAGE_BYTES, NUM_PAGES, progress_interval_s=interval)
    conn.send((agent.metadata(), agent.layout(), os.getpid()))
    while True:
        if progress:
            agent.progress()
        if not conn.poll(0.001):
            continue
        cmd = conn.recv()
        if cmd == "stop":
            break
        if cmd == "progress":  # from now on progress() above runs
            progress = True
        elif cmd == "pages":
            conn.send(kv.numpy().tobytes())
    agent.close()
    agent.close()


class Target:
    """A spawned decode-side process; always stopped by PID with a deadline."""

    def __init__(self, name: str, progress: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target_main, args=(child, name, progress), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            self.stop()
            raise TimeoutError("target did not start")
        self.metadata, self.layout, self.pid = self.conn.recv()

    def ask(self, cmd: str, timeout_s: float = 10.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"target did not answer {cmd!r}")
        return self.conn.recv()

    def pages(self) -> torch.Tensor:
        raw = bytearray(self.ask("pages"))
        return torch.frombuffer(raw, dtype=torch.float32).reshape(SHAPE)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(STOP_S)
        assert not self.proc.is_alive()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.proc.join(STOP_S)
        if self.proc.is_alive():
            assert self.proc.pid is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(STOP_S)
        assert not self.proc.is_alive()


def make_source(tag: str) -> tuple[KvAgent, torch.Tensor]:
    # Every element distinct, so a page landing in the wrong place is caught. Up to 2 pages
    # are written inline on the caller's thread; from 16 pages on, by two streams in parallel.
    kv = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE) + 1
    agent = KvAgent(
        f"prefill-{tag}-{time.monotonic_ns()}", kv, PAGE_BYTES, NUM_PAGES,
        num_streams=2, min_stream_bytes=8 * PAGE_BYTES, inline_max_bytes=2 * PAGE_BYTES,
    )
    return agent, kv


@pytest.fixture
def source() -> Iterator[tuple[KvAgent, torch.Tensor]]:
    agent, kv = make_source("a")
    yield agent, kv
    agent.close()
    agent.close()


@pytest.fixture(scope="module")
def target(ucx_env: None) -> Iterator[Target]:
    t = Target(f"decode-{time.monotonic_ns()}")
    yield t
    t.stop()


async def test_scattered_pages_land_exactly(
    source: tuple[KvAgent, torch.Tensor], target: Target
) -> None:
    agent, src = source
    peer = agent.add_peer(target.metadata, target.layout)
    assert peer in agent.peers
    want = target.pages().clone()
    # Runs contiguous on both sides merge: (0-3 -> 5-8), 7->0, (10,11 -> 12,13), 20->30, 31->1.
    local = [0, 1, 2, 3, 7, 10, 11, 20, 31]
    remote = [5, 6, 7, 8, 0, 12, 13, 30, 1]
    result = await agent.write_pages(peer, local, remote, deadline_s=10.0)
    assert (result.num_pages, result.num_bytes) == (9, 9 * PAGE_BYTES)
    assert result.num_descriptors == 5
    want[remote] = src[local]
    assert torch.equal(target.pages(), want)

    # Two streams of 8 pages each.
    local2 = list(range(12, 28))
    remote2 = [14, 15, 16, 17, 18, 19, 20, 21, 2, 3, 4, 22, 23, 24, 25, 26]
    await agent.write_pages(peer, local2, remote2, deadline_s=10.0)
    want[remote2] = src[local2]
    assert torch.equal(target.pages(), want)

    assert agent.num_open_transfers == 0


async def test_bad_requests_are_rejected(
    source: tuple[KvAgent, torch.Tensor], target: Target
) -> None:
    agent, _ = source
    peer = agent.add_peer(target.metadata, target.layout)
    assert agent.add_peer(target.metadata, target.layout) == peer  # adding twice is harmless
    with pytest.raises(ValueError):
        await agent.write_pages(peer, [0, 1], [0], deadline_s=1.0)
    with pytest.raises(ValueError):
        await agent.write_pages(peer, [0], [NUM_PAGES], deadline_s=1.0)
    with pytest.raises(KvTransferError):
        await agent.write_pages("nobody", [0], [0], deadline_s=1.0)
    with pytest.raises(ValueError):
        agent.add_peer(target.metadata, KvLayout(0, PAGE_BYTES * 2, NUM_PAGES))
    agent.remove_peer(peer)
    agent.remove_peer(peer)
    with pytest.raises(KvTransferError):
        await agent.write_pages(peer, [0], [0], deadline_s=1.0)
    assert agent.add_peer(target.metadata, target.layout) == peer  # and back again
    await agent.write_pages(peer, [0], [0], deadline_s=10.0)
    assert agent.num_open_transfers == 0


async def test_dead_peer_fails_fast_with_peer_gone() -> None:
    target = Target(f"doomed-{time.monotonic_ns()}")
    warm, warm_kv = make_source("warm")  # has written to the target before it dies
    cold, cold_kv = make_source("cold")  # never has
    try:
        warm_peer = warm.add_peer(target.metadata, target.layout)
        cold_peer = cold.add_peer(target.metadata, target.layout)
        await warm.write_pages(warm_peer, [0], [0], deadline_s=10.0)
        target.kill()
        for agent, peer, pages in ((warm, warm_peer, [1, 2]), (cold, cold_peer, list(range(16)))):
            t0 = time.monotonic()
            with pytest.raises(PeerGone):  # not KvTransferTimeout: it did not wait the deadline out
                await agent.write_pages(peer, pages, pages, deadline_s=30.0)
            assert time.monotonic() - t0 < 15  # fast: well inside the deadline, even on a busy box
            assert agent.num_open_transfers == 0
            agent.remove_peer(peer)
    finally:
        target.stop()
        warm.close()
        cold.close()


async def test_deadline_fires_and_releases_handle(source: tuple[KvAgent, torch.Tensor]) -> None:
    agent, src = source
    quiet = Target(f"quiet-{time.monotonic_ns()}", progress=False)  # makes no progress
    try:
        peer = agent.add_peer(quiet.metadata, quiet.layout)
        for pages in ([3], list(range(16))):  # inline, then two streams
            t0 = time.monotonic()
            with pytest.raises(KvTransferTimeout):
                await agent.write_pages(peer, pages, pages, deadline_s=0.5)
            # The 0.5 s deadline fired (a target that makes no progress never completes, and the
            # default deadline is 10 s): the upper bound leaves seconds for a loaded machine.
            assert 0.5 <= time.monotonic() - t0 < 8.0
            assert agent.num_open_transfers == 0
        # The agent stays usable: once the target makes progress, writes complete.
        quiet.conn.send("progress")
        for local, remote in (([16], [8]), (list(range(16, 32)), list(range(16)))):
            await agent.write_pages(peer, local, remote, deadline_s=10.0)
            assert torch.equal(quiet.pages()[remote], src[local])
        assert agent.num_open_transfers == 0
    finally:
        quiet.stop()
