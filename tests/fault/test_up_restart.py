"""`tandem up` supervises like an orchestrator: a worker or a frontend killed with SIGKILL (or a
frontend that exits 0 on a stray SIGTERM) is started again on its port while the rest of the
cluster keeps serving, and requests succeed afterwards; one that keeps dying stops the cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tandem import launcher
from tests.cluster import ENV, free_port
from tests.sse import completion


def _workers(up: subprocess.Popen[bytes]) -> dict[int, int]:
    """worker port -> pid, for the `tandem worker` children of this `tandem up`."""
    out = {}
    for child in psutil.Process(up.pid).children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if "worker" in argv and "--port" in argv:
            out[int(argv[argv.index("--port") + 1])] = child.pid
    return out


def _wait(pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_worker_comes_back_on_its_port_and_the_cluster_keeps_serving(
        tiny_model: str, tmp_path) -> None:
    http, base = free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--model", tiny_model,
                           "--engine", "mock", "--workers", "2", "--port", str(http),
                           "--worker-base-port", str(base), "--log-level", "WARNING"],
                          stdout=log, stderr=subprocess.STDOUT, env=ENV)
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    try:
        _wait(lambda: b"tandem is serving" in (tmp_path / "up.log").read_bytes(), 60,
              "the cluster")
        body["model"] = launcher.get_json(url + "/v1/models")["data"][0]["id"]
        want = completion(url, body).text
        assert want
        before = _workers(up)
        os.kill(before[base], signal.SIGKILL)
        # The other worker keeps serving meanwhile (the frontend may first try the dead one).
        served = [completion(url, body, 30.0) for _ in range(4)]
        assert any(r.status == 200 and r.text == want for r in served)
        after = _wait(lambda: (w := _workers(up)).get(base, before[base]) != before[base] and w,
                      30, "the worker's restart")
        assert after[base + 1] == before[base + 1]  # the other one was left alone
        assert up.poll() is None

        def both_up() -> bool:
            rows = launcher.get_json(url + "/workers")
            rows = rows.get("workers", rows) if isinstance(rows, dict) else rows
            return sum(1 for w in rows if w.get("state") == "up") == 2

        _wait(both_up, 30, "the frontend to reach the restarted worker")
        for _ in range(6):  # both workers serve again
            r = completion(url, body, 30.0)
            assert r.status == 200 and r.text == want, (r.status, r.body)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()
        log.close()
    assert up.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert "restarted it on its port" in (tmp_path / "up.log").read_text()


def test_restarts_are_rate_limited() -> None:
    policy = launcher.RestartPolicy(max_restarts=2, window_s=10.0)
    assert policy.allow("agg-0", 0.0) and policy.allow("agg-0", 1.0)
    assert not policy.allow("agg-0", 2.0)  # a third within 10 s
    assert policy.allow("agg-1", 2.0)  # per worker
    assert policy.allow("agg-0", 11.5)  # the first has left the window


def test_a_dead_frontend_is_restarted_and_one_dying_too_often_stops_supervision(
        tiny_model: str, tmp_path) -> None:
    plan = launcher.plan(launcher.Shape(agg=1), tiny_model,
                         worker_args=("--engine", "mock", "--log-level", "WARNING", "--no-auth"),
                         frontend_args=("--log-level", "WARNING", "--no-auth"))
    cluster = launcher.LocalCluster(plan, log_dir=str(tmp_path), env=ENV)
    cluster.start()
    try:
        cluster.wait_ready(60)
        policy = launcher.RestartPolicy(max_restarts=1, window_s=60.0)
        cluster.procs["agg"].kill()
        assert len(cluster.supervise(policy)) == 1  # restarted once
        cluster.procs["agg"].kill()
        with pytest.raises(launcher.LaunchError, match="not restarting"):
            cluster.supervise(policy)
        cluster.restart("agg")
        cluster.wait_ready(60)
        front = launcher.RestartPolicy(max_restarts=1, window_s=60.0)
        cluster.procs["frontend"].kill()
        assert len(cluster.supervise(front)) == 1  # restarted on its port, serving again
        cluster.wait_ready(60)
        model = launcher.get_json(cluster.url + "/v1/models")["data"][0]["id"]
        r = completion(cluster.url, {"model": model, "prompt": "x", "max_tokens": 4})
        assert r.status == 200 and r.done and r.error is None
        cluster.procs["frontend"].stop()  # SIGTERM: it drains and exits 0, the cluster goes on
        with pytest.raises(launcher.LaunchError, match="frontend"):  # (its second death)
            cluster.supervise(front)
    finally:
        cluster.stop()
