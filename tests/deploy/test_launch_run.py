"""Running clusters through launch/single_node.sh, which execs `tandem up`, on CPU with the mock
engine: one log per process, a streamed completion, workers that only the cluster's key pair (made
by up, in a private directory) reaches, while a plain ZMQ peer gets nothing and is counted; and on
SIGTERM every process it started stops, by PID, and the keys are removed. `--no-auth` keeps the
workers open to any local process."""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import zmq

from tandem.runtime import wire
from tests.cluster import ENV
from tests.deploy.manifests import flag
from tests.deploy.test_launch import SINGLE, TANDEM
from tests.sse import completion


def free_base(span: int) -> int:
    """A port base with `span` free consecutive loopback ports."""
    for base in range(21000 + os.getpid() % 2000 * 10, 60000, 97):
        socks = []
        try:
            for p in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


class Run:
    """A `tandem up` (through a script or not): its output read line by line, each wait with a
    deadline; its children's PIDs as it prints them."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=ENV)
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put("")  # (the end)

    def until(self, text: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout:g}s:\n{''.join(self.lines)}")
            if not line:
                raise AssertionError(f"exited ({self.proc.wait()}) before {text!r}:\n"
                                     f"{''.join(self.lines)}")
            self.lines.append(line)
            if text in line:
                return line

    def pids(self) -> dict[str, int]:
        found = (re.match(r"tandem up:\s+(\S+) \(pid (\d+)\)", line) for line in self.lines)
        return {m[1]: int(m[2]) for m in found if m}

    def stop(self) -> int:
        """SIGTERM to up itself (the script exec'd it: the same PID); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def kill_leftovers(self) -> None:  # only what this run started
        for pid in self.pids().values():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Whether every process is gone within `timeout` (a signalled child takes its time to die
    on a loaded machine; the deadline is for one that never does)."""
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200, url
        return r.read().decode()


def plain_dealer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    """A ZMQ peer with no keys at all that says Hello to a worker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    sock.send(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, "intruder")), zmq.NOBLOCK)
    return ctx, sock


def refused(health_url: str) -> float:
    """How many failed handshakes the worker behind `health_url` counted (its /metrics), whatever
    the reason ZMQ gave: which side of a keyless connection sees the mismatch first is a race (the
    other then sees only that the peer ended the handshake)."""
    text = get(health_url + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_worker_protocol_errors_total{")
               and 'socket="worker"' in line and 'error="handshake' in line)


def test_single_node_serves_on_cpu_authenticates_and_stops_every_process(
        tiny_model: str, tmp_path: Path) -> None:
    base = free_base(40)
    port, logs = base + 30, tmp_path / "logs"
    run = Run(["bash", str(SINGLE), "--tandem", TANDEM, "--model", tiny_model, "--cpu",
               "--engine", "mock", "--frontends", "2", "--worker-port-base", str(base),
               "--bootstrap-port-base", str(base + 10), "--health-port-base", str(base + 20),
               "--port", str(port), "--log-dir", str(logs), "--ready-timeout", "120"])
    keys = ""
    try:
        run.until("tandem is serving")
        pids = run.pids()
        assert sorted(pids) == ["decode", "frontend-0", "frontend-1", "prefill"]
        assert sorted(os.listdir(logs)) == ["decode.log", "frontend-0.log", "frontend-1.log",
                                            "plan.tsv", "prefill.log"]
        lines = (logs / "plan.tsv").read_text().splitlines()
        cmds = [shlex.split(line.split("\tcmd=")[1]) for line in lines[1:]]
        keys = flag(cmds[0], "--auth-keys") or ""
        assert keys and all(flag(c, "--auth-keys") == keys for c in cmds)  # one key pair for all
        assert os.stat(keys).st_mode & 0o777 == 0o700  # made by up, private
        assert all(c[0] == "CUDA_VISIBLE_DEVICES=" for c in cmds[:2])  # --cpu: no GPU for workers
        for health in (base + 20, base + 21):
            get(f"http://127.0.0.1:{health}/health")

        url = f"http://127.0.0.1:{port}"
        model = __import__("json").loads(get(url + "/v1/models"))["data"][0]["id"]
        r = completion(url, {"model": model, "prompt": "hello there", "max_tokens": 8})
        assert r.status == 200 and r.done and r.error is None and r.text

        # A process without the cluster's keys: its handshake with the decode worker fails, the
        # worker counts it, and it never gets a reply (libzmq does not retry such a connection).
        decode_health = f"http://127.0.0.1:{base + 21}"
        before = refused(decode_health)
        ctx, intruder = plain_dealer(f"tcp://127.0.0.1:{base + 1}")
        try:
            deadline = time.monotonic() + 30
            while refused(decode_health) <= before:
                assert time.monotonic() < deadline, "the refused handshake was not counted"
                time.sleep(0.05)
            assert intruder.poll(0) == 0  # nothing came back
        finally:
            ctx.destroy(linger=0)
    finally:
        rc = run.stop()
        run.kill_leftovers()
    assert rc == 0, "".join(run.lines)
    assert all_gone(list(pids.values()))  # every process it started, by PID
    assert keys and not os.path.exists(keys)  # and the key pair it made is gone


def test_no_auth_keeps_the_workers_open_to_local_processes(tiny_model: str) -> None:
    base = free_base(10)
    run = Run([sys.executable, "-m", "tandem.cli", "up", "--model", tiny_model, "--no-auth",
               "--engine", "mock", "--frontends", "0", "--worker-base-port", str(base),
               "--health-base-port", str(base + 5), "--log-level", "WARNING"])
    try:
        said = run.until("ready; give the frontends --workers")
        assert said.strip().endswith(f"--workers tcp://127.0.0.1:{base}")
        pids = run.pids()
        ctx, peer = plain_dealer(f"tcp://127.0.0.1:{base}")
        try:
            assert peer.poll(30_000), "no answer to a Hello without keys"
            reply = wire.TO_FRONTEND.decode(peer.recv())
            assert isinstance(reply, wire.HelloReply) and reply.ok
        finally:
            ctx.destroy(linger=0)
    finally:
        rc = run.stop()
        run.kill_leftovers()
    assert rc == 0 and all_gone(list(pids.values()))
