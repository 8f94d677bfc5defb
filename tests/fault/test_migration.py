"""Streams survive a dead worker, with real processes (mock engine, paced so that streams are
mid-way): 16 concurrent streams, one serving worker SIGKILLed by PID, and every stream completes
(no error, the full token count, no gap or duplicate: the frontend refuses both), its text equal to
a fault-free run (the engines honour `Generate.resume_offset`: the mock's tokens and the reference
engine's seeded draws are keyed by completion position), the move counted on /metrics, and every
page free on the survivors."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.cluster import Cluster, free_port
from tests.fault.test_pd_faults import assert_survivors_idle, run_streams
from tests.sse import StreamResult

N = 16
MAX_TOKENS = 48
PACE = ["--mock-decode-step-us", "30000"]  # 30 ms a decode step: a stream takes about 1.5 s


def bodies(model: str) -> list[dict]:
    return [{"model": model, "prompt": [10 + i, 20 + 2 * i, 30 + 3 * i, 40], "max_tokens":
             MAX_TOKENS, "temperature": 0, "seed": i, "stream_options": {"include_usage": True}}
            for i in range(N)]


def completion_tokens(r: StreamResult) -> int:
    usage = [e["usage"] for e in r.events if e.get("usage")]
    return int(usage[-1]["completion_tokens"]) if usage else -1


def migrations(c: Cluster) -> float:
    import urllib.request

    with urllib.request.urlopen(c.url + "/metrics", timeout=10) as f:
        for line in f.read().decode().splitlines():
            if line.startswith("tandem_request_migrations_total "):
                return float(line.split()[1])
    return 0.0


def kill_when_busy(c: Cluster, victim_index: int, graceful: bool = False) -> threading.Thread:
    """SIGKILL the victim once it serves streams that have started (a few tokens in); `graceful`:
    SIGTERM it (it drains: what does not finish within its drain deadline ends DRAINING)."""
    victim = c.workers[victim_index]

    def go() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            rows = {w["address"]: w for w in c.worker_states()}
            w = rows.get(victim.address)
            if w and w["in_flight"] >= 2 and w["active_decode_tokens"] > w["in_flight"] * 8:
                break
            time.sleep(0.05)
        if graceful:
            os.kill(victim.pid, signal.SIGTERM)
            victim.popen.wait(30)
        else:
            victim.kill()
    t = threading.Thread(target=go)
    t.start()
    return t


def check_survived(c: Cluster, results: list[StreamResult], reference: list[str],
                   dead_index: int) -> None:
    for r in results:
        assert r.status == 200 and r.done and r.error is None, (r.status, r.error, r.body)
        assert r.finish_reason == "length"
        assert completion_tokens(r) == MAX_TOKENS  # no token lost, none twice
    assert migrations(c) >= 1
    assert_survivors_idle(c, [c.workers[dead_index]])
    mismatched = [i for i, r in enumerate(results) if r.text != reference[i]]
    assert not mismatched, [(results[i].text, reference[i]) for i in mismatched]


def run_case(c: Cluster, victim: int, graceful: bool = False) -> None:
    model = c.get_json("/v1/models")["data"][0]["id"]
    reference = [r.text for r in run_streams(c.url, bodies(model))]
    assert all(reference)
    killer: list[threading.Thread] = []
    results = run_streams(c.url, bodies(model),
                          during=lambda: killer.append(kill_when_busy(c, victim, graceful)))
    killer[0].join(40)
    check_survived(c, results, reference, victim)


def test_two_agg_workers_one_killed_mid_stream(tiny_model, tmp_path):
    c = Cluster(tiny_model, str(tmp_path))
    for _ in range(2):
        c.add_worker("mock", PACE)
    c.start_frontend()
    try:
        run_case(c, 0)
    finally:
        c.stop()


def test_1p2d_decode_worker_killed_mid_stream(tiny_model, tmp_path):
    c = Cluster(tiny_model, str(tmp_path))
    c.add_worker("mock", ["--role", "prefill", "--bootstrap-port", str(free_port()), *PACE])
    for _ in range(2):
        c.add_worker("mock", ["--role", "decode", *PACE])
    c.start_frontend()
    try:
        run_case(c, 1)
    finally:
        c.stop()


DRAIN = ["--drain-timeout", "0.3"]  # far shorter than a stream: the drain ends them mid-way


def test_two_agg_workers_one_stopped_gracefully_mid_stream(tiny_model, tmp_path):
    """SIGTERM: what the worker did not finish within its drain deadline moves like a crash's.
    (Seen before: those streams failed, so a graceful restart was worse than a crash.)"""
    c = Cluster(tiny_model, str(tmp_path))
    c.add_worker("mock", [*PACE, *DRAIN])
    c.add_worker("mock", PACE)
    c.start_frontend()
    try:
        run_case(c, 0, graceful=True)
    finally:
        c.stop()


def test_1p2d_decode_worker_stopped_gracefully_mid_stream(tiny_model, tmp_path):
    c = Cluster(tiny_model, str(tmp_path))
    c.add_worker("mock", ["--role", "prefill", "--bootstrap-port", str(free_port()), *PACE])
    c.add_worker("mock", ["--role", "decode", *PACE, *DRAIN])
    c.add_worker("mock", ["--role", "decode", *PACE])
    c.start_frontend()
    try:
        run_case(c, 1, graceful=True)
    finally:
        c.stop()


def test_moves_are_bounded_by_max_migrations(tiny_model, tmp_path):
    """--max-migrations 0: the stream cut by the dead worker ends with a clear error event."""
    c = Cluster(tiny_model, str(tmp_path))
    for _ in range(2):
        c.add_worker("mock", PACE)
    c.start_frontend(["--max-migrations", "0"])
    try:
        model = c.get_json("/v1/models")["data"][0]["id"]
        killer: list[threading.Thread] = []
        results = run_streams(c.url, bodies(model),
                              during=lambda: killer.append(kill_when_busy(c, 0)))
        killer[0].join(30)
        failed = [r for r in results if r.error is not None]
        assert failed and all(r.done and "stopped answering" in json.dumps(r.error)
                              for r in failed)
        assert migrations(c) == 0
        assert_survivors_idle(c, [c.workers[0]])
    finally:
        c.stop()
