"""Local cluster plans: every process of a cluster on one machine, its argv and its ports, before
anything runs (so a plan can be printed, checked and tested). `tandem.launcher` runs a plan;
`tandem up` makes one from its flags and adds each worker's GPUs (`tandem.gpus`).

`plan()` owns the shape rules (aggregated workers, or prefill and decode workers; one role alone
only where the other runs elsewhere, or with no frontend here), which port each process binds
(consecutive from a base, or free ones) and that no two bind the same, the address the workers are
reached at (`advertise_host`), and each frontend's worker list: this plan's workers, then any
started elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tandem.ports import free_port
from tandem.runtime.transport import url_host

Kind = Literal["worker", "frontend"]
WILDCARDS = ("0.0.0.0", "::", "[::]")


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

    def check(self, frontends: int, elsewhere: bool) -> None:
        """ValueError unless a cluster of this shape, with `frontends` frontends here and workers
        `elsewhere` too or not, can serve."""
        if self.agg and (self.prefill or self.decode):
            raise ValueError(f"no cluster of shape {self}: aggregated workers, or prefill and "
                             "decode workers, not both")
        if bool(self.prefill) != bool(self.decode) and frontends and not elsewhere:
            raise ValueError("disaggregated serving needs both --prefill N and --decode M (one "
                             "alone: --frontends 0, or the other role's --worker-addresses)")
        if not self.roles() and not frontends:
            raise ValueError("nothing to start: no workers and --frontends 0")
        if not self.roles() and not elsewhere:
            raise ValueError("no workers to start: the frontends need --worker-addresses ADDRS")


@dataclass(frozen=True)
class Child:
    name: str  # "prefill", "decode-1", "frontend"
    kind: Kind
    argv: tuple[str, ...]  # after `python -m tandem.cli`
    ports: tuple[int, ...]  # every port it binds; the first is where it serves
    address: str  # tcp://HOST:PORT (a worker, as others reach it) or http://HOST:PORT (frontend)
    worker_name: str = ""  # a worker's --name: how /workers shows it
    role: str = ""  # agg, prefill, decode or frontend
    bootstrap_port: int = 0  # a prefill worker's
    health_port: int = 0  # a worker's /live, /health, /metrics (0 = none); a frontend's HTTP port
    http_url: str = ""  # where its /health (and a worker's /metrics) answer ("" = nowhere)
    env: tuple[tuple[str, str], ...] = ()  # set in its environment (a worker's GPUs)
    gpus: tuple[str, ...] | None = None  # its CUDA_VISIBLE_DEVICES (None: left as ours)


@dataclass(frozen=True)
class Plan:
    host: str
    workers: tuple[Child, ...]
    frontends: tuple[Child, ...]
    worker_addresses: tuple[str, ...] = ()  # what the frontends route to: ours, then elsewhere's

    @property
    def url(self) -> str:
        return self.frontends[0].address if self.frontends else ""

    @property
    def children(self) -> tuple[Child, ...]:
        return (*self.workers, *self.frontends)


def reach_host(host: str, advertise_host: str = "") -> str:
    """Where other local processes reach a process bound to `host`."""
    return advertise_host or ("127.0.0.1" if host in WILDCARDS else host)


def plan(shape: Shape, model: str, *, host: str = "127.0.0.1", advertise_host: str = "",
         http_port: int = 0, worker_base_port: int = 0, bootstrap_base_port: int = 0,
         health_base_port: int | None = None, frontends: int = 1,
         worker_args: Sequence[str] = (), frontend_args: Sequence[str] = (),
         elsewhere: Sequence[str] = (), cluster_id: str = "") -> Plan:
    """Every process of a local cluster. Ports: `http_port` (0 = a free one) for the frontends
    (several share it with SO_REUSEPORT); workers take consecutive ports from `worker_base_port`
    (a prefill worker's bootstrap socket takes the next, unless `bootstrap_base_port` numbers
    them), or free ones if it is 0; `health_base_port` numbers the workers' health ports (0 = free
    ones, None = none, unless there is no frontend). `worker_args`/`frontend_args` are appended
    to every worker's / frontend's argv; `elsewhere`: worker addresses the frontends route to
    besides this plan's."""
    shape.check(frontends, bool(elsewhere))
    if not frontends and health_base_port is None:
        health_base_port = 0  # with no frontend, each worker's /health says it is ready
    roles = shape.roles()
    cid = cluster_id or f"up{os.getpid()}"
    counts = {r: roles.count(r) for r in set(roles)}
    reach, probe = reach_host(host, advertise_host), url_host(reach_host(host))
    owners: dict[int, str] = {}
    nxt = worker_base_port

    def claim(port: int, what: str) -> int:
        if port > 65535:
            raise ValueError(f"{what}: port {port} is out of range (1-65535)")
        if port in owners:
            raise ValueError(f"overlapping ports: {port} is both {owners[port]} and {what}")
        owners[port] = what
        return port

    def take(what: str) -> int:
        nonlocal nxt
        if not worker_base_port:
            return claim(free_port(host), what)
        nxt += 1
        return claim(nxt - 1, what)

    def numbered(base: int, i: int, what: str) -> int:
        return claim(base + i if base else free_port(host), what)

    workers = []
    seen: dict[str, int] = {}
    for i, role in enumerate(roles):
        j = seen[role] = seen.get(role, -1) + 1
        name = role if counts[role] == 1 else f"{role}-{j}"
        port = take(f"{name} ZMQ")
        wname = f"{name}@{cid}"
        argv = ["worker", "--model", model, "--role", role, "--host", host, "--port", str(port),
                "--name", wname]
        if reach != host:
            argv += ["--advertise-host", reach]
        ports: tuple[int, ...] = (port,)
        boot = health = 0
        if role == "prefill":
            boot = numbered(bootstrap_base_port, j, f"{name} bootstrap") if bootstrap_base_port \
                else take(f"{name} bootstrap")
            ports += (boot,)
            argv += ["--bootstrap-port", str(boot)]
        if health_base_port is not None:
            health = numbered(health_base_port, i, f"{name} health")
            ports += (health,)
            argv += ["--health-port", str(health)]
        workers.append(Child(
            name, "worker", (*argv, *worker_args), ports, f"tcp://{url_host(reach)}:{port}", wname,
            role, boot, health, f"http://{probe}:{health}" if health else ""))
    addrs = (*(w.address for w in workers), *elsewhere)
    http = claim(http_port or free_port(host), "frontend HTTP") if frontends else 0
    fronts = []
    for i in range(frontends):
        argv = ["frontend", "--model", model, "--host", host, "--port", str(http),
                "--workers", ",".join(addrs), *(["--reuse-port"] if frontends > 1 else [])]
        url = f"http://{probe}:{http}"
        fronts.append(Child("frontend" if frontends == 1 else f"frontend-{i}", "frontend",
                            (*argv, *frontend_args), (http,), url, role="frontend",
                            health_port=http, http_url=url))
    return Plan(host, tuple(workers), tuple(fronts), addrs)
