"""A PD worker that restarts on its port rejoins: the reference engine's KV goes over NIXL between
real processes, one worker is killed (SIGKILL) and started again as `tandem up` would (same argv,
same `--name`), and every
request after it comes back succeeds, token for token as before. (Seen before: a restarted decode
worker was refused by the prefill side's NIXL agent, which still knew an agent of its name, for as
long as the prefill worker lived; a restarted prefill worker refused the decode side's rooms, whose
KvHello it had never heard.)"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nixl")

from tandem import launcher  # noqa: E402
from tests.cluster import Cluster, free_port, spawn  # noqa: E402
from tests.sse import completion  # noqa: E402

PROMPTS = [[10 + i, 20, 30 + 2 * i, 40, *range(50, 70 + i)] for i in range(4)]


def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout}s")


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_a_restarted_worker_rejoins_pd(tiny_model: str, tmp_path, victim: str) -> None:
    c = Cluster(tiny_model, str(tmp_path))
    for role in ("prefill", "decode"):
        extra = ["--role", role, "--name", role, "--page-size", "16", "--num-pages", "256"]
        if role == "prefill":
            extra += ["--bootstrap-port", str(free_port())]
        c.add_worker("reference", extra)
    c.start_frontend()
    try:
        model = launcher.get_json(c.url + "/v1/models")["data"][0]["id"]
        bodies = [{"model": model, "prompt": p, "max_tokens": 8, "temperature": 0}
                  for p in PROMPTS]
        want = [completion(c.url, b) for b in bodies]
        assert all(r.status == 200 and r.error is None for r in want)
        i = 0 if victim == "prefill" else 1
        old = c.workers[i]
        old.kill()
        _until(lambda: not old.alive(), 10, "the worker did not die")
        argv = list(old.popen.args[3:])  # (after `python -m tandem.cli`)
        new = spawn(f"{victim}-again", argv, str(tmp_path))
        new.address = old.address
        c.workers[i] = new
        _until(lambda: all(w["state"] == "up" for w in c.worker_states()), 60,
               "the restarted worker did not come back")
        got = [completion(c.url, b) for b in bodies]
        assert [(r.status, r.error) for r in got] == [(200, None)] * len(bodies)
        assert [r.text for r in got] == [r.text for r in want]
        c.assert_idle()
    finally:
        c.stop()
