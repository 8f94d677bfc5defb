"""Real tandem processes on loopback for integration and fault tests.

Every process is started here, known by PID, and stopped by the test that started it (SIGTERM, a
deadline, then SIGKILL). `Cluster.assert_idle()` is the KV check every scenario ends with: each
live worker reports every page free.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

ENV = {**os.environ, "UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    address: str = ""
    log_path: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""


def spawn(name: str, argv: list[str], log_dir: str) -> Proc:
    log_path = os.path.join(log_dir, f"{name}.log")
    out = open(log_path, "wb")
    p = subprocess.Popen([sys.executable, "-m", "tandem.cli", *argv], stdout=out,
                         stderr=subprocess.STDOUT, env=ENV)
    out.close()
    return Proc(name, p, log_path=log_path)


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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.frontend is not None and self.frontend.alive(), self.frontend.log()
            for w in self.workers:
                if isinstance(w, Proc) and not w.alive():
                    raise RuntimeError(f"{w.name} exited with {w.popen.returncode}:\n{w.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"cluster not ready in {timeout}s:\n" + self.frontend.log())

    def get_json(self, path: str, timeout: float = 10.0) -> object:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def worker_states(self) -> list[dict]:
        data = self.get_json("/workers")
        return data["workers"] if isinstance(data, dict) else data  # type: ignore[return-value]

    def assert_idle(self, timeout: float = 10.0) -> None:
        """Every live worker has every page free and nothing running (waits up to `timeout`)."""
        deadline = time.monotonic() + timeout
        states: list[dict] = []
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
