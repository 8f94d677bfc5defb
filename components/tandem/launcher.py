"""Local clusters: the one launcher `tandem up`, the tests (tests/cluster.py) and the sweeps
(perf/launch.py) start tandem processes with.

`plan()` turns a shape (aggregated workers, or prefill and decode workers) into the argv of every
process, ports included; nothing runs yet, so a plan can be printed or tested. `LocalCluster.start()`
checks that every port it was given is free, then starts the workers and the frontends as child
processes of this one (`python -m tandem.cli ...`), each known by PID and stopped by PID: SIGTERM,
a deadline, then SIGKILL. `wait_ready()` reports progress while workers come up, fails at once
(with the child's name and exit code) if one dies, and checks through the frontend's `/workers`
that the workers it reached are the ones this cluster started: a port taken by another cluster
never goes unnoticed. A child stays restartable from its plan entry (`LocalCluster.restart`).

`LocalCluster.supervise(policy)`, called in a loop, does what an orchestrator would: a dead worker
or frontend (whatever its exit status: the cluster is still meant to run) is started again on its
ports within `RestartPolicy`'s rate (frontends reconnect to restarted workers by themselves, and a
restarted frontend finds every worker); one dying faster than that is a `LaunchError`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.ports import free_port as free_port  # (re-exported: tests and perf take it here)
from tandem.ports import port_in_use

Kind = Literal["worker", "frontend"]


class LaunchError(RuntimeError):
    """The cluster could not be started; the message says why and what to change."""


@dataclass(frozen=True)
class Shape:
    agg: int = 0
    prefill: int = 0
    decode: int = 0

    @classmethod
    def parse(cls, text: str) -> Shape:
        """"agg", "3agg", "1p1d", "2p4d" -> a shape."""
        t = text.strip().lower()
        if t.endswith("agg"):
            return cls(agg=int(t[:-3] or 1))
        p, sep, d = t.removesuffix("d").partition("p")
        if not sep or not p.isdigit() or not d.isdigit() or t[-1:] != "d":
            raise ValueError(f"shape {text!r} is not 'agg', 'Nagg' or 'XpYd'")
        return cls(prefill=int(p), decode=int(d))

    def roles(self) -> list[str]:
        return ["agg"] * self.agg + ["prefill"] * self.prefill + ["decode"] * self.decode

    def describe(self) -> str:
        if self.agg:
            return f"{self.agg} aggregated worker{'s' if self.agg > 1 else ''}"
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Child:
    name: str  # "prefill", "decode-1", "frontend"
    kind: Kind
    argv: tuple[str, ...]  # after `python -m tandem.cli`
    ports: tuple[int, ...]  # every port it binds; the first is where it serves
    address: str  # tcp://HOST:PORT (worker) or http://HOST:PORT (frontend)
    worker_name: str = ""  # a worker's --name: how /workers shows it


@dataclass(frozen=True)
class Plan:
    host: str
    workers: tuple[Child, ...]
    frontends: tuple[Child, ...]

    @property
    def url(self) -> str:
        return self.frontends[0].address

    @property
    def children(self) -> tuple[Child, ...]:
        return (*self.workers, *self.frontends)


def plan(shape: Shape, model: str, *, host: str = "127.0.0.1", http_port: int = 0,
         worker_base_port: int = 0, frontends: int = 1, worker_args: Sequence[str] = (),
         frontend_args: Sequence[str] = (), cluster_id: str = "") -> Plan:
    """Every process of a local cluster. Ports: `http_port` (0 = a free one) for the frontends
    (several share it with SO_REUSEPORT); workers take consecutive ports from `worker_base_port`
    (a prefill worker's bootstrap socket takes the next), or free ones if it is 0.
    `worker_args`/`frontend_args` are appended to every worker's / frontend's argv."""
    roles = shape.roles()
    if not roles or (shape.agg and (shape.prefill or shape.decode)) or \
            bool(shape.prefill) != bool(shape.decode):
        raise ValueError(f"no cluster of shape {shape}: give agg workers, or prefill and decode")
    cid = cluster_id or f"up{os.getpid()}"
    counts = {r: roles.count(r) for r in set(roles)}
    seen: dict[str, int] = {}
    nxt = worker_base_port

    def take() -> int:
        nonlocal nxt
        if not worker_base_port:
            return free_port(host)
        nxt += 1
        if nxt - 1 > 65535:
            raise ValueError(f"--worker-base-port {worker_base_port} leaves too few ports")
        return nxt - 1

    workers = []
    for role in roles:
        i = seen[role] = seen.get(role, -1) + 1
        name = role if counts[role] == 1 else f"{role}-{i}"
        ports: tuple[int, ...] = (take(),)
        wname = f"{name}@{cid}"
        argv = ["worker", "--model", model, "--role", role, "--host", host,
                "--port", str(ports[0]), "--name", wname]
        if role == "prefill":
            ports += (take(),)
            argv += ["--bootstrap-port", str(ports[1])]
        workers.append(Child(name, "worker", (*argv, *worker_args), ports,
                             f"tcp://{host}:{ports[0]}", wname))
    http = http_port or free_port(host)
    addrs = ",".join(w.address for w in workers)
    fronts = []
    for i in range(frontends):
        argv = ["frontend", "--model", model, "--host", host, "--port", str(http),
                "--workers", addrs, *(["--reuse-port"] if frontends > 1 else [])]
        fronts.append(Child("frontend" if frontends == 1 else f"frontend-{i}", "frontend",
                            (*argv, *frontend_args), (http,), f"http://{host}:{http}"))
    return Plan(host, tuple(workers), tuple(fronts))


@dataclass
class Proc:
    """One started tandem process."""

    name: str
    popen: subprocess.Popen[bytes]
    address: str = ""
    log_path: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

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

    def log(self, last: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-last:]
        except OSError:
            return ""


def spawn(name: str, argv: Sequence[str], *, log_dir: str = "", env: Mapping[str, str] | None = None,
          own_session: bool = False, address: str = "") -> Proc:
    """Start `python -m tandem.cli *argv`. Output goes to LOG_DIR/NAME.log, or to ours with no
    `log_dir`. `own_session`: Ctrl-C at the terminal reaches only us, and we stop it ourselves."""
    cmd = [sys.executable, "-m", "tandem.cli", *argv]
    if not log_dir:
        p = subprocess.Popen(cmd, env=env, start_new_session=own_session)
        return Proc(name, p, address)
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "ab") as out:  # (a restarted child's log follows its predecessor's)
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=own_session)
    return Proc(name, p, address, log_path)


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stop_all(procs: Iterable[Proc], timeout: float = 15.0) -> None:
    """SIGTERM to every live process at once, then SIGKILL to any still alive at the deadline."""
    procs = list(procs)
    for p in procs:
        if p.alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def exited(procs: Iterable[Proc]) -> list[Proc]:
    return [p for p in procs if not p.alive()]


def describe_exit(p: Proc) -> str:
    rc = p.returncode
    how = f"was killed by signal {-rc}" if rc is not None and rc < 0 else f"exited with code {rc}"
    tail = p.log(1500).strip()
    return f"{p.name} (pid {p.pid}) {how}" + (f"; its log ends:\n{tail}" if tail else "")


@dataclass(frozen=True)
class Progress:
    elapsed_s: float
    frontend_up: bool
    workers_up: tuple[str, ...]  # worker names the frontend has a working connection to
    workers_expected: tuple[str, ...]


def wait_ready(url: str, procs: Sequence[Proc], timeout: float, *,
               expect_workers: Sequence[str] = (),
               on_progress: Callable[[Progress], None] | None = None) -> None:
    """Until `url` answers /health with 200 (and, given `expect_workers`, /workers shows every one
    of those worker names up). Raises LaunchError when a process in `procs` exits, when a worker
    the frontend reached is not one of `expect_workers`, or at the deadline."""
    t0 = time.monotonic()
    last: Progress | None = None
    while True:
        dead = exited(procs)
        if dead:
            raise LaunchError(describe_exit(dead[0]))
        health = healthy(url)
        up: tuple[str, ...] = ()
        if expect_workers:
            up = _workers_up(url, expect_workers)
        prog = Progress(time.monotonic() - t0, health or bool(up), up, tuple(expect_workers))
        if on_progress and (last is None or (prog.frontend_up, prog.workers_up) !=
                            (last.frontend_up, last.workers_up)):
            on_progress(prog)
        last = prog
        if health and set(up) >= set(expect_workers):
            return
        if prog.elapsed_s > timeout:
            missing = sorted(set(expect_workers) - set(up))
            raise LaunchError(f"not ready after {timeout:g}s" +
                              (f"; still waiting for {', '.join(missing)}" if missing else ""))
        time.sleep(0.2)


def _workers_up(url: str, expected: Sequence[str]) -> tuple[str, ...]:
    try:
        data = get_json(url + "/workers")
    except (urllib.error.URLError, OSError, ValueError):
        return ()
    rows = data.get("workers", []) if isinstance(data, dict) else data
    up = []
    for w in rows if isinstance(rows, list) else []:
        if not isinstance(w, dict) or w.get("state") != "up":
            continue
        name = str(w.get("name", ""))
        if name not in expected:
            raise LaunchError(
                f"the frontend reached a worker this cluster did not start ({name or 'unnamed'} "
                f"at {w.get('address', '?')}): another process holds that port; stop it, or "
                f"choose other ports (--worker-base-port)")
        up.append(name)
    return tuple(sorted(up))


@dataclass
class RestartPolicy:
    """How often a worker may be restarted: at most `max_restarts` within any `window_s`."""

    max_restarts: int = 5
    window_s: float = 60.0
    history: dict[str, deque[float]] = field(default_factory=dict)

    def allow(self, name: str, now: float) -> bool:
        times = self.history.setdefault(name, deque())
        while times and now - times[0] > self.window_s:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True


@dataclass
class LocalCluster:
    """The processes of one plan: started, watched, stopped (and restartable one by one)."""

    plan: Plan
    log_dir: str = ""  # "" = children write to our stdout/stderr
    env: Mapping[str, str] | None = None
    own_session: bool = False
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.plan.url

    def check_ports(self) -> None:
        """LaunchError naming every planned port that something already listens on."""
        busy = sorted({p for c in self.plan.children for p in c.ports
                       if port_in_use(self.plan.host, p)})
        if len(busy) == 1:
            raise LaunchError(f"port {busy[0]} on {self.plan.host} is already in use; stop what "
                              "holds it or choose another (--port, --worker-base-port)")
        if busy:
            raise LaunchError(f"ports {', '.join(map(str, busy))} on {self.plan.host} are already "
                              "in use; stop what holds them or choose others (--port, "
                              "--worker-base-port)")

    def start(self) -> None:
        self.check_ports()
        for child in self.plan.children:
            self._spawn(child)

    def _spawn(self, child: Child) -> Proc:
        p = spawn(child.name, child.argv, log_dir=self.log_dir, env=self.env,
                  own_session=self.own_session, address=child.address)
        self.procs[child.name] = p
        return p

    def restart(self, name: str) -> Proc:
        """Start the named child again, with the argv it was planned with."""
        child = next(c for c in self.plan.children if c.name == name)
        old = self.procs.get(name)
        if old is not None:
            old.stop()
        return self._spawn(child)

    def wait_ready(self, timeout: float,
                   on_progress: Callable[[Progress], None] | None = None) -> None:
        wait_ready(self.url, list(self.procs.values()), timeout,
                   expect_workers=[w.worker_name for w in self.plan.workers],
                   on_progress=on_progress)

    def exited(self) -> list[Proc]:
        return exited(self.procs.values())

    def supervise(self, policy: RestartPolicy) -> list[str]:
        """Restart each dead child, one line each (module docstring); LaunchError if not."""
        lines = []
        for p in self.exited():
            if not policy.allow(p.name, time.monotonic()):
                raise LaunchError(f"{describe_exit(p)}\n{p.name} died {policy.max_restarts} "
                                  f"times within {policy.window_s:g}s: not restarting it")
            lines.append(f"{describe_exit(p).split(';')[0]}; restarted it on its port "
                         f"(pid {self.restart(p.name).pid})")
        return lines

    def stop(self, timeout: float = 15.0) -> None:
        """Frontends first (they drain their clients), then workers."""
        fronts = [self.procs[c.name] for c in self.plan.frontends if c.name in self.procs]
        stop_all(fronts, timeout)
        stop_all([p for p in self.procs.values() if p not in fronts], timeout)
