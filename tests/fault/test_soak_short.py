"""A short slice of the soak (perf/soak/soak.py) in `make test`: 1P2D on the mock engine, 12 clients
sending the seeded mix (chat and completions, streamed and not, n > 1, logprobs, stop strings,
greedy or seeded, streams left mid-way) for 30 s while a decode worker, the prefill worker and the
frontend are each SIGKILLed and restarted once by the launcher's supervision. The same checks as
the full soak: every completed answer equal to its fault-free answer, every fault back and
serving, no failure outside a fault window (so none after the last restart), no restart the soak
did not cause, every page free once idle, and every process's RSS within 10% of its start. The
workers have a small KV pool (128 pages) and a host tier (96 pages), so cached pages move
between the tiers throughout, every worker checking both tiers' accounting after every step."""

from __future__ import annotations

import pytest

from perf.soak import soak
from perf.soak.soak_report import verdict


@pytest.mark.timeout(150)
def test_a_short_soak_with_each_role_killed_once(tiny_model: str, tmp_path) -> None:
    cfg = soak.SoakConfig(duration_s=30.0, model=tiny_model, pool_size=48,
                          log_dir=str(tmp_path / "logs"), write=False, num_pages=128,
                          host_kv_pages=96)
    res = soak.run(cfg)
    detail = (f"{verdict(res)}\nfaults: {res['faults']}\nfailures: {res['failures']}\n"
              f"mismatches: {res['mismatch_examples']}\npages: {res['pages']}\nrss: {res['rss']}\n"
              f"unexpected restarts: {res['unexpected_restarts']} {res['supervise_error']}")
    assert [f["victim"] for f in res["faults"]] == ["decode-0", "prefill", "frontend"], detail
    assert res["requests"]["compared_in_full"] > 100, detail  # the load did run
    assert res["requests"]["compared_as_prefix"] > 0, detail
    assert res["passed"], detail
    assert res["mismatches"] == 0 and res["failures"]["after_last_restart"] == 0, detail
    assert res["pages"]["leaked"] == 0, detail
    # (the host tier was in use: pages moved into it, and some came back as hits)
    workers = [w for w in res["pages"]["workers"] if w.get("role") != "frontend"]
    assert any(w["host_pages_cached"] for w in workers), detail
    assert any(w["prefix_cache_host_hits"] for w in workers), detail
