"""Several "nodes" on one machine, for tests: Linux network namespaces joined by veth pairs on a
bridge that lives in a namespace of its own, so the host's network is never touched.

`Nodes.create(n)` makes `n` namespaces, each with a loopback and one interface `eth0` holding
10.213.<k>.<i>/24 (k is drawn per test run so parallel runs cannot collide); `nodes.run(i, argv)`
starts a process inside node i; `nodes.close()` kills what it started (by PID) and deletes every
namespace it made, which removes the veth pairs and the bridge with them. Needs root and iproute2;
`available()` says whether this machine can.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field


def available() -> str:
    """'' when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"tdprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Nodes:
    tag: str
    subnet: int
    names: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def create(cls, n: int) -> Nodes:
        subnet = random.randint(1, 250)
        nodes = cls(tag=f"td{os.getpid() % 100000}", subnet=subnet)
        try:
            nodes._build(n)
        except BaseException:
            nodes.close()
            raise
        return nodes

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}br"

    def addr(self, i: int) -> str:
        return f"10.213.{self.subnet}.{i + 2}"

    def _build(self, n: int) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        self.names.append(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i in range(n):
            ns = f"{self.tag}n{i}"
            _ip("netns", "add", ns)
            self.names.append(ns)
            # Create the pair inside the node's namespace, then move its peer to the bridge's.
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}")
            _ip("-n", ns, "link", "set", f"p{i}", "netns", br)
            _ip("-n", br, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def ns(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def run(self, i: int, argv: Sequence[str], *, env: dict[str, str] | None = None,
            log: str | None = None) -> subprocess.Popen[bytes]:
        out = open(log, "ab") if log else subprocess.DEVNULL
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], env=env, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def check_output(self, i: int, argv: Sequence[str], timeout: float,
                     env: dict[str, str] | None = None) -> str:
        return subprocess.run(["ip", "netns", "exec", self.ns(i), *argv], check=True, env=env,
                              capture_output=True, text=True, timeout=timeout).stdout

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.names.clear()
