"""Request timelines (tandem.runtime.timeline) as a user meets them: a cluster started with
`TANDEM_TIMELINE=DIR` writes one file per process, and perf/streaming/hops.py joins them into each
request's hops, in order, with the step that computed its prompt. The mock engine's steps run on
the event loop, the reference engine's on a thread of their own: both."""

from __future__ import annotations

import glob
import json
import os
import urllib.request
from typing import Any

import pytest

from perf.streaming import hops
from tests import cluster
from tests.cluster import Cluster

PROMPTS = [[5 + j for j in range(20)], [300 + j for j in range(9)], [77] * 33, [9] * 17]
USERS = ["ann", "bob", "cy", "ann"]


def stream(url: str, prompt: list[int], user: str) -> str:
    """A streamed completion; its id (the frontend's rid, after "cmpl-")."""
    body = {"prompt": prompt, "max_tokens": 3, "stream": True, "user": user}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    assert events and events[0]["id"].startswith("cmpl-")
    return str(events[0]["id"][len("cmpl-"):])


@pytest.mark.parametrize("engine", ["mock", "reference"])
def test_each_request_has_its_hops_in_order(tiny_model: str, tmp_path: Any,
                                            monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    directory = str(tmp_path / "timeline")
    monkeypatch.setitem(cluster.ENV, "TANDEM_TIMELINE", directory)
    c = Cluster(tiny_model, str(tmp_path))
    try:
        c.add_worker(engine, ["--no-prefix-cache"])
        c.start_frontend(["--tenant-by", "user"])
        rids = [stream(c.url, p, u) for p, u in zip(PROMPTS, USERS)]
        c.assert_idle()
    finally:
        c.stop()
    pids = {os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.tl"))}
    assert pids == {f"{c.frontend.pid}.tl", f"{c.workers[0].pid}.tl"}  # type: ignore[union-attr]
    tl = hops.read(directory)
    assert len(rids) == len(set(rids)) == 4
    # Tenants as the frontend keeps them (digests, never the user's name): one per user.
    tenants = [tl.tenants[rid] for rid in rids]
    assert len(set(tenants)) == 3 and tenants[0] == tenants[3]
    assert not {t for t in tenants if t in USERS}
    for rid, prompt in zip(rids, PROMPTS):
        e = tl.events[rid]
        order = ["t0", "arrive", "placed", "recv", "out", "first", "chunk"]
        assert [e[k] for k in order] == sorted(e[k] for k in order), (rid, e)
        # One at a time, so the step that computed its prompt computed nothing else, began after
        # its Generate was read and ended before its first output left.
        (only,) = tl.prompt_steps[rid]
        step = tl.steps[only]
        assert step.prefill_tokens == len(prompt) and step.decodes == 0
        assert e["recv"] <= step.start <= step.end <= e["out"]
        row = hops.hops(tl, rid)
        assert row is not None
        assert row["prefill_tokens"] == len(prompt)
        times = [row[h] for h in ("admit", "to_worker", "wait", "compute", "out", "first", "held")]
        assert all(t >= 0 for t in times), row
        # The frontend's own clock agrees with the sum of its hops (no client times here).
        total = (e["chunk"] - e["t0"]) * 1e3
        assert row["ttft"] == pytest.approx(total)
        assert sum(times) <= total + 1e-6
    # Every step began by a `step` line ended with an `end` line, in order, one worker.
    starts = [s.start for s in tl.steps]
    assert starts == sorted(starts) and all(s.start <= s.end for s in tl.steps)
    assert {s.worker for s in tl.steps} == {tl.steps[0].worker}
