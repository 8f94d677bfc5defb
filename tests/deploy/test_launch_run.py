"""launch/single_node.sh running: with a fake `tandem` on loopback (readiness, watching, stopping
exactly what it started), and with the real CLI once it has the flags the script passes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.manifests import REPO
from tests.deploy.test_launch import SINGLE

FAKE = Path(__file__).with_name("fake_tandem.py")


# --- running, with a fake tandem ----------------------------------------------------------------

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


class Launch:
    def __init__(self, tmp: Path, *args: str, **env: str) -> None:
        self.dir = tmp / "fake"
        self.dir.mkdir()
        base = free_base(40)
        self.port = base + 30
        cmd = ["bash", str(SINGLE), "--model", "/m", "--cpu", "--engine", "mock",
               "--tandem", f"{sys.executable} {FAKE}", "--log-dir", str(tmp / "logs"),
               "--worker-port-base", str(base), "--bootstrap-port-base", str(base + 10),
               "--health-port-base", str(base + 20), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True,
                                     env=os.environ | {"FAKE_TANDEM_DIR": str(self.dir)} | env)

    def records(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.dir.glob("*.json"))]

    def wait_ready(self, timeout: float = 20.0) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "ready" once everything answered /health
        assert line.strip() == "ready", (line, self.proc.poll())

    def finish(self, timeout: float = 30.0) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err

    def pids(self) -> list[int]:
        recs = self.records()
        return [r["pid"] for r in recs] + [r["child"] for r in recs if r["child"]]

    def kill_leftovers(self) -> None:  # only what this test's script started
        if self.proc.poll() is None:
            self.proc.kill()
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


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


@pytest.fixture
def launched(tmp_path: Path):
    made: list[Launch] = []

    def make(*args: str, **env: str) -> Launch:
        made.append(Launch(tmp_path, *args, **env))
        return made[-1]

    yield make
    for launch in made:
        launch.kill_leftovers()


def test_ready_then_sigterm_stops_everything_it_started(launched) -> None:
    la = launched("--prefill", "1", "--decode", "1", "--frontends", "2")
    la.wait_ready()
    recs = la.records()
    assert sorted(r["role"] for r in recs) == ["decode", "frontend", "frontend", "prefill"]
    for r in recs:
        assert gone(r["pid"]) is False and r["pgid"] == r["pid"]  # each in its own group
        if r["kind"] == "worker":
            assert r["cuda"] == ""
    la.proc.send_signal(signal.SIGTERM)
    rc, err = la.finish()
    assert rc == 143 and "stopping 4 process(es)" in err
    for r in recs:
        assert (la.dir / f"{r['pid']}.term").exists(), f"{r['role']} got no SIGTERM"
    assert all_gone(la.pids())  # workers' children too (the group was signalled)


def test_a_child_that_dies_takes_the_cluster_down(launched) -> None:
    la = launched("--prefill", "1", "--decode", "2", "--frontends", "1",
                  FAKE_EXIT_ROLE="decode", FAKE_EXIT_AFTER="1.5")
    la.wait_ready()
    rc, err = la.finish()
    assert rc == 1 and "decode-" in err and "exited" in err
    survivors = [r for r in la.records() if r["role"] != "decode"]
    assert all((la.dir / f"{r['pid']}.term").exists() for r in survivors)
    assert all_gone(la.pids())


def test_readiness_deadline(launched) -> None:
    la = launched("--decode", "1", "--prefill", "0", "--ready-timeout", "2",
                  FAKE_READY_AFTER="never")
    t0 = time.monotonic()
    rc, err = la.finish()
    assert rc == 1 and "not ready after 2 s" in err
    assert time.monotonic() - t0 < 15
    assert la.records() and all_gone(la.pids())


def test_a_process_ignoring_sigterm_is_killed_after_the_drain_deadline(launched) -> None:
    la = launched("--decode", "1", "--prefill", "0", "--frontends", "0", "--drain-timeout", "0",
                  FAKE_IGNORE_TERM="1")
    la.wait_ready()
    t0 = time.monotonic()
    la.proc.send_signal(signal.SIGINT)
    rc, err = la.finish()
    assert rc == 130 and "SIGKILL" in err
    assert 4.9 <= time.monotonic() - t0 < 12  # drain (0) + 5 s, then SIGKILL
    assert all_gone(la.pids())


# --- running the real tandem (once the CLI has the flags the scripts use) -----------------------

def _real_cli_missing() -> str:
    tandem = REPO / ".venv" / "bin" / "tandem"
    if not tandem.exists():
        return "no .venv/bin/tandem"
    for sub, flags in (("worker", ("--health-port", "--advertise-host", "--drain-timeout")),
                       ("frontend", ("--drain-timeout",))):
        res = subprocess.run([str(tandem), sub, "--help"], capture_output=True, text=True,
                             timeout=60)
        missing = [f for f in flags if f not in res.stdout]
        if res.returncode != 0 or missing:
            return f"tandem {sub} lacks {missing or 'a working --help'} (launch/ wiring pending)"
    return ""


@pytest.mark.parametrize("frontends", [1, 2])
def test_real_cluster_starts_serves_and_stops(tiny_model: str, tmp_path: Path,
                                              frontends: int) -> None:
    """1P1D on the mock engine with the real CLI; with 2 frontends both share one port
    (`--reuse-port`: SO_REUSEPORT)."""
    why = _real_cli_missing()
    if why:
        pytest.skip(why)
    import urllib.request

    base = free_base(40)
    port = base + 30
    env = os.environ | {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo"}
    proc = subprocess.Popen(
        ["bash", str(SINGLE), "--model", tiny_model, "--cpu", "--engine", "mock",
         "--prefill", "1", "--decode", "1", "--frontends", str(frontends), "--ready-timeout", "120",
         "--tandem", str(REPO / ".venv" / "bin" / "tandem"), "--log-dir", str(tmp_path / "logs"),
         "--worker-port-base", str(base), "--bootstrap-port-base", str(base + 10),
         "--health-port-base", str(base + 20), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "ready":
            proc.wait(60)
            pytest.fail(f"not ready: {proc.stderr.read() if proc.stderr else ''}")
        for p in (base + 20, base + 21):
            with urllib.request.urlopen(f"http://127.0.0.1:{p}/health", timeout=5) as r:
                assert r.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        pids = [int(w.split(")")[0]) for w in err.split("(pid ")[1:]]
        assert proc.returncode == 143 and len(set(pids)) == 2 + frontends, err
        assert all_gone(pids)
    finally:
        if proc.poll() is None:  # the script stops its own children on SIGTERM
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for p in pids:
            if not gone(p):
                os.kill(p, signal.SIGKILL)
