"""Real tandem processes on loopback for integration and fault tests, started through the one
local-cluster launcher (tandem.launcher).

Every process is started here, known by PID, and stopped by the test that started it (SIGTERM, a
deadline, then SIGKILL). `Cluster.assert_idle()` is the KV check every scenario ends with: each
live worker reports every page free.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.launcher import Proc, free_port, get_json, wait_ready
from tandem.launcher import spawn as _spawn

__all__ = ["ENV", "Cluster", "Proc", "free_port", "reference_workers", "spawn"]

# UCX on loopback (TCP, CMA) unless the caller chose otherwise (on a GPU: tests/gpu/run_on_device.py
# adds cuda_ipc and cuda_copy, which KV in VRAM needs).
ENV = {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", **os.environ}


def spawn(name: str, argv: list[str], log_dir: str) -> Proc:
    """A tandem process for a test: output to LOG_DIR/NAME.log, UCX on loopback. A worker or a
    frontend given no --auth-keys runs keyless on loopback, said by name (--no-auth), as a
    process started by hand must."""
    if argv[0] in ("worker", "frontend") and "--auth-keys" not in argv and "--no-auth" not in argv:
        argv = [*argv, "--no-auth"]
    return _spawn(name, argv, log_dir=log_dir, env=ENV)


@dataclass
class Cluster:
    model: str
    log_dir: str
    url: str = ""
    workers: list[Proc] = field(default_factory=list)
    frontend: Proc | None = None

    def add_worker(self, engine: str = "mock", extra: list[str] | None = None) -> Proc:
        port = free_port()
        name = f"worker{len(self.workers)}"
        p = spawn(name, ["worker", "--model", self.model, "--engine", engine, "--port", str(port),
                         "--log-level", "WARNING", *(extra or [])], self.log_dir)
        p.address = f"tcp://127.0.0.1:{port}"
        self.workers.append(p)
        return p

    def start_frontend(self, extra: list[str] | None = None, wait: bool = True) -> Proc:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        addrs = ",".join(w.address for w in self.workers)
        self.frontend = spawn("frontend", ["frontend", "--model", self.model, "--workers", addrs,
                                           "--port", str(port), "--log-level", "WARNING",
                                           *(extra or [])], self.log_dir)
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()  # a cluster that never came up must not outlive its test
                raise
        return self.frontend

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.frontend is not None
        try:
            wait_ready(self.url, [self.frontend, *self.workers], timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\nfrontend log:\n{self.frontend.log()}") from None

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        return get_json(self.url + path, timeout)

    def worker_states(self) -> list[dict[str, Any]]:
        data = self.get_json("/workers")
        rows: list[dict[str, Any]] = data["workers"] if isinstance(data, dict) else data
        return rows

    def assert_idle(self, timeout: float = 10.0) -> None:
        """Every live worker has every page free and nothing running (waits up to `timeout`)."""
        deadline = time.monotonic() + timeout
        states: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            states = [w for w in self.worker_states() if w["state"] == "up"]
            if states and all(
                w["pages_free"] == w["pages_total"] and w["running"] == 0 and w["waiting"] == 0
                and w["in_flight"] == 0 for w in states
            ):
                return
            time.sleep(0.1)
        raise AssertionError(f"workers not idle after {timeout}s: {states}")

    def stop(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
        for w in self.workers:
            w.stop()


def reference_workers(c: Cluster, shape: str) -> Cluster:
    """Reference-engine workers of a shape: "agg" (one) or "1p1d" (a prefill with its bootstrap
    port, and a decode worker)."""
    roles = ["agg"] if shape == "agg" else ["prefill", "decode"]
    for role in roles:
        extra = ["--role", role]
        if role == "prefill":
            extra += ["--bootstrap-port", str(free_port())]
        c.add_worker("reference", extra)
    return c
