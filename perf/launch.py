"""Start a mock-engine cluster for a sweep: workers and a frontend as child processes on free
loopback ports, known by PID, stopped by PID (SIGTERM, a deadline, then SIGKILL). Their CPU time
(psutil, all threads) is what CPU-µs per streamed token is measured from."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import psutil

SHAPES = ("agg", "1p1d")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Launched:
    url: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system, all threads) each process has used so far."""
        out = {}
        for name, p in self.procs.items():
            t = psutil.Process(p.pid).cpu_times()
            out[name] = t.user + t.system
        return out

    def stop(self, timeout_s: float = 15.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)


def _spawn(argv: list[str], log_dir: str, name: str) -> subprocess.Popen[bytes]:
    with open(os.path.join(log_dir, f"{name}.log"), "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "tandem.cli", *argv], stdout=log,
                                stderr=subprocess.STDOUT)


def launch(shape: str, model: str, log_dir: str, worker_args: list[str],
           frontend_args: list[str], ready_timeout_s: float = 60.0) -> Launched:
    """A frontend over one agg worker, or over one prefill and one decode worker."""
    os.makedirs(log_dir, exist_ok=True)
    port = free_port()
    out = Launched(f"http://127.0.0.1:{port}")
    roles = ["agg"] if shape == "agg" else ["prefill", "decode"]
    addrs = []
    try:
        for role in roles:
            wport = free_port()
            extra = ["--bootstrap-port", str(free_port())] if role == "prefill" else []
            out.procs[role] = _spawn(["worker", "--role", role, "--engine", "mock", "--model", model,
                                      "--port", str(wport), "--log-level", "WARNING", *extra,
                                      *worker_args], log_dir, role)
            addrs.append(f"tcp://127.0.0.1:{wport}")
        out.procs["frontend"] = _spawn(["frontend", "--model", model, "--workers", ",".join(addrs),
                                        "--port", str(port), "--log-level", "WARNING",
                                        *frontend_args], log_dir, "frontend")
        _wait_ready(out, ready_timeout_s)
    except BaseException:
        out.stop()
        raise
    return out


def _wait_ready(c: Launched, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [n for n, p in c.procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited during start")
        try:
            with urllib.request.urlopen(c.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"cluster at {c.url} not ready in {timeout_s:.0f}s")
