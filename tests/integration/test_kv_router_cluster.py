"""The kv policy on a live cluster: two mock workers publish their KV events, the frontend's
index follows them (visible in /workers), and a request whose long prefix one worker holds goes
to that worker even when the other is idler by request count; a worker with --no-kv-events is
routed on an approximate index, and /workers says so. Cache isolation (issue 38, N3): a probe
with another cache_salt (or, with --cache-salt-by user, as another user) finds nothing cached
and is not routed to the holder by prediction; the same salt hits."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

PREFIX = list(range(100, 400))  # 300 tokens: 18 full pages of 16


def complete(url: str, prompt: list[int], session: str = "", **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True, **extra}
    headers = {"Content-Type": "application/json"}
    if session:
        headers["X-Session-ID"] = session
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_repeated_prefix_lands_on_the_worker_that_holds_it(make_cluster: Any) -> None:
    c = make_cluster("mock", workers=2, frontend_args=["--router-policy", "kv",
                                                       "--kv-predict-ttl", "0"])
    first = complete(c.url, PREFIX + [1, 2, 3])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the holder's events reach the index (no prediction: its TTL is 0 here)
    wait_for(lambda: max(w["kv_index_blocks"] for w in c.worker_states()) >= 18)
    rows = c.worker_states()
    holder = next(w["address"] for w in rows if w["kv_index_blocks"] >= 18)
    assert all(w["kv_index"] == "events" for w in rows)
    for q in range(5):
        usage = complete(c.url, PREFIX + [10 + q, 11])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 288  # 18 pages, on the holder
    rows = {w["address"]: w for w in c.worker_states()}
    assert rows[holder]["prefix_cache_hits"] == 5 * 288
    assert rows[holder]["kv_events_applied"] > 0 and rows[holder]["kv_last_event_age_s"] >= 0
    assert rows[holder]["kv_predicted_cached_tokens"] == 5 * 288  # the router predicted each hit
    c.assert_idle()


def test_a_worker_without_events_gets_an_approximate_index(make_cluster: Any) -> None:
    c = make_cluster("mock", workers=2, worker_args=["--no-kv-events"],
                     frontend_args=["--router-policy", "kv"])
    complete(c.url, PREFIX + [1], session="s")
    usage = complete(c.url, PREFIX + [2], session="s")["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 288  # placed by its placements
    rows = c.worker_states()
    assert all(w["kv_index"].startswith("approximate") and w["kv_events_applied"] == 0
               for w in rows)
    c.assert_idle()


def test_each_frontend_keeps_its_own_index_from_the_same_streams(make_cluster: Any) -> None:
    """Two frontends over the same workers: what one frontend's traffic cached, the other's index
    sees too (from the workers' events), and it routes there."""
    c = make_cluster("mock", workers=2, frontend_args=["--router-policy", "kv",
                                                       "--kv-predict-ttl", "0"])
    first, first_url = c.frontend, c.url
    complete(first_url, PREFIX + [1, 2])
    try:  # a second frontend, started after the prefix was cached: it catches up by replay
        c.start_frontend(["--router-policy", "kv", "--kv-predict-ttl", "0"])
        assert c.url != first_url
        wait_for(lambda: max(w["kv_index_blocks"] for w in c.worker_states()) >= 18)
        usage = complete(c.url, PREFIX + [3, 4])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 288
    finally:
        first.stop()  # (the cluster stops the second)


def cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_probe_with_another_salt_finds_nothing_and_is_not_routed_to_the_holder(
        make_cluster: Any) -> None:
    c = make_cluster("mock", workers=2, frontend_args=["--router-policy", "kv",
                                                       "--kv-predict-ttl", "0"])
    assert cached(complete(c.url, PREFIX + [1, 2, 3], cache_salt="victim")) == 0
    wait_for(lambda: max(w["kv_index_blocks"] for w in c.worker_states()) >= 18)
    assert cached(complete(c.url, PREFIX + [1, 2, 3])) == 0  # the attacker's probes: no salt,
    for q in range(3):  # and other salts (each probe once: a second would hit its own first)
        assert cached(complete(c.url, PREFIX + [1, 2, 3], cache_salt=f"probe{q}")) == 0
    assert all(w["kv_predicted_cached_tokens"] == 0 for w in c.worker_states())
    assert cached(complete(c.url, PREFIX + [4], cache_salt="victim")) == 288  # its own: a hit
    c.assert_idle()


def test_cache_salt_by_user_partitions_without_the_clients_help(make_cluster: Any) -> None:
    c = make_cluster("mock", workers=1, frontend_args=["--cache-salt-by", "user"])
    assert cached(complete(c.url, PREFIX + [1], user="alice")) == 0
    assert cached(complete(c.url, PREFIX + [2], user="mallory")) == 0
    assert cached(complete(c.url, PREFIX + [3], user="alice")) == 288
    c.assert_idle()
