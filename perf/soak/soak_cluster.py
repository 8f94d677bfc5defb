"""The soak's cluster: 1P2D and one frontend on 127.0.0.1 through perf's one cluster starter
(perf.common.launch, over tandem.launcher.LocalCluster, the one `tandem up` runs), with the
cluster's own CURVE key pair as `tandem up` makes it, supervised as `tandem up` supervises (a
thread calling `LocalCluster.supervise` every 0.2 s: a dead child is started again with its
planned argv, on its ports). The soak kills a child by PID (SIGKILL) and waits until the supervisor's replacement is
back and serving. Every restart the supervisor makes is recorded, so a death the soak did not
cause shows up in the report. `stop()` stops the supervisor first, then every child by PID
(frontend first; SIGTERM, a deadline, SIGKILL) and removes the key pair.

Also here: what the end-of-run checks read (the frontend's /workers, each worker's /metrics on its
health port) and every process's RSS (psutil)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import psutil

from perf.common.launch import launch
from tandem.launcher import LocalCluster, RestartPolicy, get_json, healthy
from tandem.up import new_keys

ENV = {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", **os.environ}
NAMES = ("prefill", "decode-0", "decode-1", "frontend")


@dataclass
class Restart:
    name: str
    old_pid: int
    new_pid: int
    at: float  # time.monotonic()
    line: str


@dataclass
class SoakCluster:
    model: str
    log_dir: str
    engine: str = "mock"
    worker_args: list[str] = field(default_factory=list)
    frontend_args: list[str] = field(default_factory=list)
    keys: str = ""
    cluster: LocalCluster | None = None
    restarts: list[Restart] = field(default_factory=list)
    supervise_error: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self.cluster is not None
        return self.cluster.url

    def start(self, ready_timeout_s: float = 120.0) -> None:
        self.keys = new_keys()
        # Each child in its own session, as `tandem up` starts them: a Ctrl-C at the terminal
        # reaches only the soak, which stops them (and the supervisor does not see them die).
        self.cluster = launch("1p2d", self.model, self.log_dir, self.worker_args,
                              self.frontend_args, ready_timeout_s, self.engine, keys=self.keys,
                              health_base_port=0, env=ENV, own_session=True).cluster
        self._thread = threading.Thread(target=self._supervise, name="soak-supervisor",
                                        daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        """`tandem up`'s loop: restart whatever died, within its rate."""
        assert self.cluster is not None
        policy = RestartPolicy(5, 60.0)
        while not self._stop.wait(0.2):
            before = {n: p.pid for n, p in self.cluster.procs.items()}
            try:
                lines = self.cluster.supervise(policy)
            except Exception as e:  # LaunchError: one keeps dying; a failed spawn
                self.supervise_error = str(e)[:2000]
                return
            now = time.monotonic()
            for n, p in self.cluster.procs.items():
                if p.pid != before.get(n):
                    line = next((x for x in lines if x.startswith(n)), "")
                    self.restarts.append(Restart(n, before.get(n, 0), p.pid, now, line))

    def pid(self, name: str) -> int:
        assert self.cluster is not None
        return self.cluster.procs[name].pid

    def pids(self) -> dict[str, int]:
        assert self.cluster is not None
        return {n: p.pid for n, p in self.cluster.procs.items()}

    def kill(self, name: str) -> int:
        """SIGKILL the named child by its PID; the supervisor starts it again. Its old PID."""
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def child(self, name: str) -> Any:
        assert self.cluster is not None
        return next(c for c in self.cluster.plan.children if c.name == name)

    def serving(self, name: str, old_pid: int) -> bool:
        """The named child is a new process (not `old_pid`), answers its own /health, and the
        frontend (itself, for the frontend) is ready with every worker up."""
        if self.pid(name) == old_pid or self.supervise_error:
            return False
        c = self.child(name)
        if c.kind == "worker" and not healthy(c.http_url):
            return False
        return self.all_up()

    def all_up(self) -> bool:
        if not healthy(self.url):
            return False
        try:
            rows = self.workers()
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return len(rows) == 3 and all(w.get("state") == "up" for w in rows)

    def workers(self) -> list[dict[str, Any]]:
        data = get_json(self.url + "/workers", 5.0)
        rows: list[dict[str, Any]] = data["workers"] if isinstance(data, dict) else data
        return rows

    def worker_in_flight(self) -> dict[str, float]:
        """Each worker's own count of requests submitted and not ended (its /metrics)."""
        assert self.cluster is not None
        out = {}
        for c in self.cluster.plan.workers:
            out[c.name] = _metric(c.http_url + "/metrics", "tandem_worker_requests_in_flight")
        return out

    def frontend_metric(self, name: str) -> float:
        return _metric(self.url + "/metrics", name)

    def rss(self) -> dict[str, dict[str, int]]:
        """name -> {pid, rss bytes} of each live child (its own process; the mock and the
        frontend start none of their own)."""
        out = {}
        for n, pid in self.pids().items():
            try:
                out[n] = {"pid": pid, "rss": psutil.Process(pid).memory_info().rss}
            except psutil.Error:
                continue
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        try:
            if self.cluster is not None:
                self.cluster.stop()
        finally:
            if self.keys:
                shutil.rmtree(self.keys, ignore_errors=True)


def _metric(url: str, name: str) -> float:
    """The sum of a metric's samples (-1 when it cannot be read)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return -1.0
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else -1.0


def idle_state(c: SoakCluster) -> tuple[bool, list[dict[str, Any]], dict[str, float]]:
    """(idle, the frontend's /workers rows, each worker's own in-flight count): idle is every
    worker up with every page free, none reserved, nothing running, waiting or in flight."""
    try:
        rows = c.workers()
    except (urllib.error.URLError, OSError, ValueError):
        return False, [], {}
    own = c.worker_in_flight()
    ok = len(rows) == 3 and all(
        w["state"] == "up" and w["pages_free"] == w["pages_total"] and not w["pages_reserved"]
        and w["running"] == 0 and w["waiting"] == 0 and w["in_flight"] == 0 for w in rows)
    return ok and all(v == 0 for v in own.values()), rows, own
