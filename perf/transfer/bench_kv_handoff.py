"""KV handoff microbenchmark: NIXL WRITE of page-major KV pages between two processes vs an
in-process copy of the same pages, side by side in one run, reported as ratios.

For each page shape and handoff size the same scattered page set (runs of 1..16 pages, on both
sides, from pools twice the handoff size) is moved by:
- nixl x1 / nixl x2: `KvAgent.write_pages` into another process, with one or two copy streams; timed from the call until every byte is in
  place. KV memory: --memory thp (default) huge-page advised and pre-faulted, as `KvAgent` does
  by default; --memory 4k: torch.zeros, faulted in 4 KiB pages; --memory cuda: VRAM on GPU 0 in
  both processes (NIXL over UCX's cuda_ipc).
- copy: this process copies the same pages between two tensors with torch: the fastest of
  per-run slice `copy_` and `index_copy_`, each with torch's default threads and with one. With
  --memory cuda: a device-to-device copy of the same number of bytes between two contiguous
  buffers (the physical ceiling) and the per-run slice `copy_`, each timed to its synchronize.
Bytes are checked on the target after each case. Results: perf/results/kv_handoff.{json,md}.
GB/s count each byte moved once (not read plus written).

    UCX_TLS=tcp,cma UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN \\
        .venv/bin/python perf/transfer/bench_kv_handoff.py
    # on a GPU (tests/gpu/run_on_device.sh runs this):
    UCX_TLS=cuda_ipc,cuda_copy,tcp,cma UCX_NET_DEVICES=lo \\
        python perf/transfer/bench_kv_handoff.py --memory cuda --sizes-mib 1 64 1024
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tandem.kv.transfer.nixl import KvAgent, MemType, prefault_host_memory

DEFAULT_THREADS = torch.get_num_threads()
SETTLE_S = 0.02
UCX_ENV = {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
UCX_TLS_CUDA = "cuda_ipc,cuda_copy,tcp,cma"  # the default UCX_TLS with --memory cuda


def ucx_defaults(memory: str) -> None:
    """Set the UCX environment this bench runs under, unless the caller set it already."""
    tls = UCX_TLS_CUDA if memory == "cuda" else UCX_ENV["UCX_TLS"]
    for k, v in {**UCX_ENV, "UCX_TLS": tls}.items():
        os.environ.setdefault(k, v)

# name -> page shape [layers, k/v, page_size, kv_heads, head_dim] in float32
PAGE_SHAPES: dict[str, tuple[int, ...]] = {
    # Llama-3-8B class: 32 layers, 8 KV heads of 128; 4 tokens/page f32 = 8 tokens bf16: 1 MiB
    "8b-1MiB": (32, 2, 4, 8, 128),
    # small model: 4 layers, 2 KV heads of 64, 16 tokens/page: 64 KiB
    "small-64KiB": (4, 2, 16, 2, 64),
}


@dataclass
class Case:
    shape: str
    page_bytes: int
    handoff_mib: int
    num_pages: int
    num_descriptors: int
    copy_method: str  # the fastest in-process baseline (by median); "copy" below is that one
    gbps_median: dict[str, float]  # x1, x2, copy, and every baseline by name
    gbps_best: dict[str, float]
    seconds: dict[str, list[float]]  # every timed rep

    def ratio(self, key: str, stat: str = "median") -> float:
        g = self.gbps_median if stat == "median" else self.gbps_best
        return g[key] / g["copy"]


def alloc_pool(num_pages: int, page_shape: tuple[int, ...], memory: str) -> torch.Tensor:
    """A page-major pool. thp: untouched, then huge-page advised and faulted in (what KvAgent's
    prefault does); 4k: torch.zeros, already faulted in 4 KiB pages; cuda: on GPU 0."""
    if memory == "cuda":
        return torch.empty((num_pages, *page_shape), dtype=torch.float32, device="cuda:0")
    if memory == "4k":
        return torch.zeros((num_pages, *page_shape), dtype=torch.float32)
    t = torch.empty((num_pages, *page_shape), dtype=torch.float32)
    prefault_host_memory(t.data_ptr(), t.numel() * 4)
    return t


def scattered(num: int, pool: int, rng: np.random.Generator) -> list[int]:
    """`num` distinct pages of a `pool`, as runs of 1..16 consecutive pages in random places."""
    taken = np.zeros(pool, dtype=bool)
    out: list[int] = []
    while len(out) < num:
        n = min(int(rng.integers(1, 17)), num - len(out))
        s = int(rng.integers(0, pool - n + 1))
        if taken[s : s + n].any():
            continue
        taken[s : s + n] = True
        out += range(s, s + n)
    return out


def target_main(conn: Connection, num_pages: int, page_shape: tuple[int, ...], memory: str) -> None:
    ucx_defaults(memory)
    kv = alloc_pool(num_pages, page_shape, memory)
    page_bytes = kv[0].numel() * 4
    agent = KvAgent(f"bench-decode-{os.getpid()}", kv, page_bytes, num_pages, mem_of(memory),
                    prefault=False)
    conn.send((agent.metadata(), agent.layout(), os.getpid()))
    while True:
        if not conn.poll(0.01):  # (the agent's own thread makes progress meanwhile)
            continue
        cmd, arg = conn.recv()
        if cmd == "peer":
            agent.add_peer(*arg)
            conn.send(True)
        elif cmd == "digest":  # of the given pages, to check the bytes landed
            conn.send(digest(kv, arg))
        elif cmd == "stop":
            break
    agent.close()


def mem_of(memory: str) -> MemType:
    return "VRAM" if memory == "cuda" else "DRAM"


def digest(kv: torch.Tensor, pages: list[int]) -> str:
    return hashlib.sha256(kv[pages].cpu().numpy().tobytes()).hexdigest()


def ask(conn: Connection, cmd: str, arg: Any = None, timeout_s: float = 60.0) -> Any:
    conn.send((cmd, arg))
    if not conn.poll(timeout_s):
        raise TimeoutError(f"target did not answer {cmd}")
    return conn.recv()


def copiers(
    src: torch.Tensor, dst: torch.Tensor, local: list[int], remote: list[int]
) -> dict[str, Callable[[], None]]:
    """The in-process baselines: per-run slice copy_ (one pass) and index_copy_ (gather then
    scatter), each with torch's default threads and with one thread."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(local) + 1):
        if i == len(local) or local[i] != local[i - 1] + 1 or remote[i] != remote[i - 1] + 1:
            runs.append((local[start], remote[start], i - start))
            start = i
    li, ri = torch.tensor(local), torch.tensor(remote)

    def by_runs() -> None:
        for a, b, n in runs:
            dst[b : b + n].copy_(src[a : a + n])

    if src.is_cuda:  # the ceiling: as many bytes, one contiguous device-to-device copy
        flat_src, flat_dst = src.view(-1)[: len(local) * src[0].numel()], dst.view(-1)
        flat_dst = flat_dst[: flat_src.numel()]

        def d2d() -> None:
            flat_dst.copy_(flat_src)
            torch.cuda.synchronize()

        def runs_synced() -> None:
            by_runs()
            torch.cuda.synchronize()

        return {"d2d copy": d2d, "slice copy_": runs_synced}

    def by_index() -> None:
        dst.index_copy_(0, ri, src.index_select(0, li))

    def threads(fn: Callable[[], None], n: int) -> Callable[[], None]:
        def run() -> None:
            torch.set_num_threads(n)
            try:
                fn()
            finally:
                torch.set_num_threads(DEFAULT_THREADS)
        return run

    out: dict[str, Callable[[], None]] = {}
    for name, fn in (("slice copy_", by_runs), ("index_copy_", by_index)):
        out[f"{name} {DEFAULT_THREADS}t"] = fn
        if DEFAULT_THREADS != 1:
            out[f"{name} 1t"] = threads(fn, 1)
    return out


async def run_shape(
    shape_name: str, sizes_mib: list[int], reps: int, memory: str
) -> list[Case]:
    page_shape = PAGE_SHAPES[shape_name]
    page_bytes = int(np.prod(page_shape)) * 4
    pool = 2 * max(sizes_mib) * (1 << 20) // page_bytes
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(child, pool, page_shape, memory), daemon=True)
    proc.start()
    child.close()
    src = alloc_pool(pool, page_shape, memory)
    src.copy_(torch.rand(src.shape, generator=torch.Generator(src.device).manual_seed(0),
                         device=src.device))
    dst = alloc_pool(pool, page_shape, memory)  # the in-process copy's destination
    agents: list[KvAgent] = []
    try:
        if not conn.poll(120):
            raise TimeoutError("target did not start")
        md, layout, _ = conn.recv()
        for streams in (1, 2):
            agent = KvAgent(f"bench-prefill-x{streams}-{os.getpid()}", src, page_bytes, pool,
                            mem_of(memory), num_streams=streams, prefault=False)
            agents.append(agent)
            peer = agent.add_peer(md, layout)
            ask(conn, "peer", (agent.metadata(), agent.layout()))
            await agent.write_pages(peer, [0], [0], deadline_s=30.0)
        peer = agents[0].peers[0]
        cases = []
        rng = np.random.default_rng(42)
        for mib in sizes_mib:
            n = max(1, mib * (1 << 20) // page_bytes)
            local, remote = scattered(n, pool, rng), scattered(n, pool, rng)
            copy = copiers(src, dst, local, remote)
            times: dict[str, list[float]] = {k: [] for k in ("x1", "x2", *copy)}
            descs = 0
            # Interleaved, one of each per rep, so load from elsewhere hits all alike; rep 0 warms.
            # A pause before each: torch's OpenMP threads spin for a while after a parallel copy.
            for r in range(reps + 1):
                for agent, key in zip(agents, ("x1", "x2")):
                    await asyncio.sleep(SETTLE_S)
                    res = await agent.write_pages(peer, local, remote, deadline_s=60.0)
                    times[key].append(res.seconds)
                    descs = res.num_descriptors
                for key, fn in copy.items():
                    await asyncio.sleep(SETTLE_S)
                    t0 = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - t0)
            times = {k: v[1:] for k, v in times.items()}
            assert ask(conn, "digest", remote) == digest(src, local), "bytes differ on the target"
            assert torch.equal(dst[remote], src[local])
            method = min(copy, key=lambda k: statistics.median(times[k]))
            times["copy"] = times[method]
            nbytes = n * page_bytes
            median = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            best = {k: nbytes / min(v) / 1e9 for k, v in times.items()}
            best["copy"] = max(best[k] for k in copy)
            c = Case(shape_name, page_bytes, mib, n, descs, method, median, best, times)
            cases.append(c)
            print(f"{shape_name:12s} {mib:4d} MiB {n:5d} pages {descs:5d} descs | GB/s median "
                  f"x1 {median['x1']:5.2f} x2 {median['x2']:5.2f} copy {median['copy']:5.2f} "
                  f"({method}) | x2/copy median {c.ratio('x2'):4.2f} best "
                  f"{c.ratio('x2', 'best'):4.2f}", flush=True)
        return cases
    finally:
        for agent in agents:
            agent.close()
        if proc.is_alive():
            conn.send(("stop", None))
            proc.join(10)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)


def write_results(cases: list[Case], args: argparse.Namespace, command: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {
        "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "ucx_env": {k: os.environ.get(k) for k in UCX_ENV},
        "memory": args.memory,
        "gpu": torch.cuda.get_device_name(0) if args.memory == "cuda" else None,
        "reps": args.reps,
        "loadavg_1min_start_end": args.loadavg,
    }
    (out / "kv_handoff.json").write_text(
        json.dumps({"command": command, "env": env, "cases": [asdict(c) for c in cases]}, indent=1)
    )
    lines = [
        "# KV handoff: NIXL WRITE between processes vs in-process copy", "",
        f"Command: `{command}`", "",
        (
            f"Machine: {env['cpus']} CPUs, kernel {env['kernel']}, torch {env['torch']} "
            f"({env['torch_threads']} threads), UCX {env['ucx_env']}, memory={args.memory}"
            f"{' on ' + str(env['gpu']) if env['gpu'] else ''}, "
            f"median of {args.reps} reps, 1-min load average {args.loadavg[0]:.2f} at start and "
            f"{args.loadavg[1]:.2f} at end (the machine is shared). GB = 1e9 bytes."
        ),
        "",
        (
            "| page shape | handoff | pages | descriptors | nixl x1 | nixl x2 | in-process copy "
            "| x1/copy | x2/copy | x2/copy, best of reps |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        m = c.gbps_median
        lines.append(
            f"| {c.shape} | {c.handoff_mib} MiB | {c.num_pages} | {c.num_descriptors} | "
            f"{m['x1']:.2f} | {m['x2']:.2f} | {m['copy']:.2f} ({c.copy_method}) | "
            f"{c.ratio('x1'):.2f} | {c.ratio('x2'):.2f} | {c.ratio('x2', 'best'):.2f} |"
        )
    lines += ["", "GB/s are medians; the last column is best nixl x2 over the best copy.", ""]
    (out / "kv_handoff.md").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--shapes", nargs="+", default=list(PAGE_SHAPES), choices=list(PAGE_SHAPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--memory", choices=["thp", "4k", "cuda"], default="thp")
    ap.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "results")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    ucx_defaults(args.memory)
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else "python"
    command = " ".join([*(f"{k}={os.environ[k]}" for k in UCX_ENV), python, *sys.argv])
    cases: list[Case] = []
    args.loadavg = [os.getloadavg()[0]]
    for shape in args.shapes:
        cases += asyncio.run(run_shape(shape, args.sizes_mib, args.reps, args.memory))
    args.loadavg.append(os.getloadavg()[0])
    write_results(cases, args, command, args.out)
    print(f"wrote {args.out / 'kv_handoff.json'} and {args.out / 'kv_handoff.md'}")


if __name__ == "__main__":
    main()
