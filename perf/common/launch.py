"""The one cluster starter of perf/ (every benchmark, the soak too): a cluster of SHAPE (the mock
engine unless told otherwise) through the one local-cluster launcher (tandem.launcher): workers
and a frontend as child processes on free loopback ports, known by PID, stopped by PID (SIGTERM,
a deadline, then SIGKILL). Their CPU time (psutil, all threads) is what CPU-µs per streamed token
is measured from."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import psutil

from tandem.launcher import LocalCluster, Shape, plan

SHAPES = ("agg", "1p1d")


@dataclass
class Launched:
    cluster: LocalCluster

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        """Each process by name: agg, prefill, decode, frontend."""
        return {name: p.popen for name, p in self.cluster.procs.items()}

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system, all threads) each process has used so far."""
        out = {}
        for name, p in self.procs.items():
            t = psutil.Process(p.pid).cpu_times()
            out[name] = t.user + t.system
        return out

    def stop(self, timeout_s: float = 15.0) -> None:
        self.cluster.stop(timeout_s)


def keyless(pythonpath: str | None = None) -> list[str]:
    """`--no-auth`, for servers that must be told by name to run keyless (this tree's; a baseline
    tree's, on `pythonpath`, only when it knows the flag: older ones refuse it)."""
    if not pythonpath:
        return ["--no-auth"]
    for entry in pythonpath.split(os.pathsep):
        cli = os.path.join(entry, "tandem", "cli.py")
        if os.path.exists(cli):
            with open(cli) as f:
                return ["--no-auth"] if "resolve_keys_dir" in f.read() else []
    return []


def launch(shape: str, model: str, log_dir: str, worker_args: list[str],
           frontend_args: list[str], ready_timeout_s: float = 60.0,
           engine: str = "mock", *, keys: str = "", health_base_port: int | None = None,
           env: dict[str, str] | None = None, own_session: bool = False) -> Launched:
    """A frontend over the workers of `shape` ("agg", "1p1d", "1p2d", ...), ready. `keys`: the
    cluster's key folder (tandem.up.new_keys), given to every process; `health_base_port`: 0
    gives each worker a health port (None: none); `own_session`: each child in its own session,
    as `tandem up` starts them."""
    os.makedirs(log_dir, exist_ok=True)
    # perf.streaming.bench_compare runs a baseline commit's servers under this tree's load
    # generator.
    server_path = os.environ.get("TANDEM_SERVER_PYTHONPATH")
    auth = ["--auth-keys", keys] if keys else keyless(server_path)  # (keyless: loopback only)
    common = ["--log-level", "WARNING", *auth]
    p = plan(Shape.parse(shape), model, host="127.0.0.1", health_base_port=health_base_port,
             worker_args=["--engine", engine, *common, *worker_args],
             frontend_args=[*common, *frontend_args])
    if server_path:
        env = {**(env or os.environ), "PYTHONPATH": server_path}
    out = Launched(LocalCluster(p, log_dir=log_dir, env=env, own_session=own_session))
    try:
        out.cluster.start()
        out.cluster.wait_ready(ready_timeout_s)
    except BaseException:
        out.stop()
        raise
    return out
