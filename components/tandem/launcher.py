"""Local clusters: the one launcher `tandem up`, the tests (tests/cluster.py) and the sweeps
(perf/common/launch.py) start tandem processes with.

`plan()` (tandem.plans, re-exported here) turns a shape into the argv of every process, ports
included; nothing runs yet. `LocalCluster.start()` checks that every port it was given is free,
then starts the workers and the frontends as child processes of this one (`python -m tandem.cli
...`, each with its own environment additions: a worker's GPUs), each known by PID and stopped by
PID: SIGTERM, a deadline, then SIGKILL (to its process group, when it leads one: what it started
goes too). `wait_ready()` reports progress while workers come up, fails at once (with the child's
name and exit code) if one dies, and checks through the frontend's `/workers` that the workers it
reached at this cluster's addresses are the ones this cluster started: a port taken by another
cluster never goes unnoticed. With no frontend, ready is every worker's `/health` answering 200. A
child stays restartable from its plan entry (`LocalCluster.restart`).

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
from typing import Any

from tandem.plans import Child as Child, Kind as Kind, Plan as Plan, Shape as Shape
from tandem.plans import plan as plan  # (re-exported: tests and perf take these here)
from tandem.ports import free_port as free_port
from tandem.ports import port_in_use


_PORT_FLAGS = "--port, --worker-base-port, --bootstrap-base-port, --health-base-port"


class LaunchError(RuntimeError):
    """The cluster could not be started; the message says why and what to change."""


@dataclass
class Proc:
    """One started tandem process."""

    name: str
    popen: subprocess.Popen[bytes]
    address: str = ""
    log_path: str = ""
    group: bool = False  # it leads its own process group (and session)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL, to its whole group when it leads one (an engine's own processes go too)."""
        if self.alive():
            try:
                (os.killpg if self.group else os.kill)(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
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
    cmd = command(argv)
    if not log_dir:
        p = subprocess.Popen(cmd, env=env, start_new_session=own_session)
        return Proc(name, p, address, group=own_session)
    log_path = os.path.join(log_dir, f"{name}.log")
    with open(log_path, "ab") as out:  # (a restarted child's log follows its predecessor's)
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=own_session)
    return Proc(name, p, address, log_path, own_session)


def command(argv: Sequence[str]) -> list[str]:
    """The command line of a tandem process: this interpreter, `-m tandem.cli`, then `argv`."""
    return [sys.executable, "-m", "tandem.cli", *argv]


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
    workers_up: tuple[str, ...]  # worker names up: through the frontend, or their own /health
    workers_expected: tuple[str, ...]
    via_frontend: bool = True  # False: no frontend; the workers' own /health says


Probe = Callable[[], tuple[bool, tuple[str, ...]]]  # -> (frontend up, worker names up)


def wait_ready(url: str, procs: Sequence[Proc], timeout: float, *,
               expect_workers: Mapping[str, str] | None = None,
               on_progress: Callable[[Progress], None] | None = None) -> None:
    """Until `url` answers /health with 200 (and, given `expect_workers`, address -> name, /workers
    shows each of them up). Raises LaunchError when a process in `procs` exits, when a worker the
    frontend reached at one of those addresses is not the one expected, or at the deadline."""
    expect = dict(expect_workers or {})

    def probe() -> tuple[bool, tuple[str, ...]]:
        health = healthy(url)
        up = _workers_up(url, expect) if expect else ()
        return health or bool(up), up

    _wait(probe, procs, timeout, tuple(expect.values()), on_progress, needs_frontend=True)


def wait_healthy(urls: Mapping[str, str], procs: Sequence[Proc], timeout: float, *,
                 on_progress: Callable[[Progress], None] | None = None) -> None:
    """Until every process in `urls` (name -> its HTTP base URL) answers /health with 200; raises
    LaunchError when a process in `procs` exits, or at the deadline."""
    _wait(lambda: (False, tuple(sorted(n for n, u in urls.items() if healthy(u)))), procs,
          timeout, tuple(urls), on_progress, needs_frontend=False)


def _wait(probe: Probe, procs: Sequence[Proc], timeout: float, expected: tuple[str, ...],
          on_progress: Callable[[Progress], None] | None, *, needs_frontend: bool) -> None:
    t0 = time.monotonic()
    last: Progress | None = None
    while True:
        dead = exited(procs)
        if dead:
            raise LaunchError(describe_exit(dead[0]))
        frontend_up, up = probe()
        prog = Progress(time.monotonic() - t0, frontend_up, up, expected, needs_frontend)
        if on_progress and (last is None or (prog.frontend_up, prog.workers_up) !=
                            (last.frontend_up, last.workers_up)):
            on_progress(prog)
        last = prog
        if (frontend_up or not needs_frontend) and set(up) >= set(expected):
            return
        if prog.elapsed_s > timeout:
            missing = sorted(set(expected) - set(up))
            raise LaunchError(f"not ready after {timeout:g}s" +
                              (f"; still waiting for {', '.join(missing)}" if missing else ""))
        time.sleep(0.2)


def _workers_up(url: str, expected: Mapping[str, str]) -> tuple[str, ...]:
    try:
        data = get_json(url + "/workers")
    except (urllib.error.URLError, OSError, ValueError):
        return ()
    rows = data.get("workers", []) if isinstance(data, dict) else data
    up = []
    for w in rows if isinstance(rows, list) else []:
        if not isinstance(w, dict) or w.get("state") != "up":
            continue
        name, address = str(w.get("name", "")), str(w.get("address", ""))
        if address not in expected:
            continue  # a worker started elsewhere (--worker-addresses)
        if name != expected[address]:
            raise LaunchError(
                f"the frontend reached a worker this cluster did not start ({name or 'unnamed'} "
                f"at {address}): another process holds that port; stop it, or "
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
                              f"holds it or choose another ({_PORT_FLAGS})")
        if busy:
            raise LaunchError(f"ports {', '.join(map(str, busy))} on {self.plan.host} are already "
                              f"in use; stop what holds them or choose others ({_PORT_FLAGS})")

    def start(self) -> None:
        self.check_ports()
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
        for child in self.plan.children:
            self._spawn(child)

    def _spawn(self, child: Child) -> Proc:
        env = {**(self.env or os.environ), **dict(child.env)} if child.env else self.env
        p = spawn(child.name, child.argv, log_dir=self.log_dir, env=env,
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
        procs = list(self.procs.values())
        if not self.plan.frontends:
            wait_healthy({w.name: w.http_url for w in self.plan.workers}, procs, timeout,
                         on_progress=on_progress)
            return
        wait_ready(self.url, procs, timeout, on_progress=on_progress,
                   expect_workers={w.address: w.worker_name for w in self.plan.workers})

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
