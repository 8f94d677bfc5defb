"""Several choices in one response, with real processes (mock engine, slowed by --step-delay-ms):
a choice's worker killed mid-stream fails the whole response (error event, then [DONE]); a client
that goes away mid-stream leaves every page free and nothing in flight, aggregated and PD."""

from __future__ import annotations

import time

import pytest

from tests.cluster import Cluster
from tests.fault.test_pd_faults import assert_survivors_idle, pd_cluster
from tests.sse import Stream

SLOW = ["--step-delay-ms", "20"]


def body_for(c: Cluster, **fields: object) -> dict:
    model = c.get_json("/v1/models")["data"][0]["id"]  # type: ignore[index]
    return {"model": model, "prompt": [5, 6, 7], "max_tokens": 150, "ignore_eos": True,
            "stream": True, **fields}


def indexes_seen(events: list[dict]) -> set[int]:
    return {ch["index"] for e in events for ch in e.get("choices", [])}


def test_worker_killed_mid_stream_fails_the_response(make_cluster) -> None:
    # With moves off (--max-migrations 0): the failure path (moves are tests/fault/test_migration)
    c = make_cluster(workers=2, worker_args=SLOW, frontend_args=["--max-migrations", "0"])
    s = Stream(c.url, "/v1/completions", body_for(c, n=4))
    for _ in range(20):  # well into the stream: every choice has sent text
        assert s.next_event() is not None
    busy = [w for w in c.worker_states() if w["in_flight"] > 0]
    assert len(busy) == 2, busy  # the four choices are spread over both workers
    victim = c.workers[0]
    victim.kill()
    r = s.read_all()
    assert r.status == 200 and r.done, "the response must end with [DONE]"
    assert r.events[-1].get("error"), f"the error event comes last: {r.events[-3:]}"
    assert r.events[-1]["error"]["message"]
    finished = [ch for e in r.events for ch in e.get("choices", []) if ch["finish_reason"]]
    assert finished == [], "no choice may look finished when the response failed"
    assert_survivors_idle(c, [victim])


@pytest.mark.parametrize("fields", [{"n": 4}, {"prompt": [[5, 6], [7, 8, 9], [10]]}])
def test_client_gone_mid_stream_frees_every_choice(make_cluster, fields: dict) -> None:
    c = make_cluster(workers=2, worker_args=SLOW)
    s = Stream(c.url, "/v1/completions", body_for(c, **fields))
    want = 4 if "n" in fields else 3
    while len(indexes_seen(s.result.events)) < want:
        assert s.next_event() is not None
    assert sum(w["in_flight"] for w in c.worker_states()) == want
    s.close()
    c.assert_idle(timeout=15)


def test_pd_client_gone_mid_stream_frees_every_choice(tiny_model, tmp_path) -> None:
    c = pd_cluster(tiny_model, tmp_path, 1, 1, SLOW)
    try:
        s = Stream(c.url, "/v1/completions", body_for(c, n=4))
        while len(indexes_seen(s.result.events)) < 4:
            assert s.next_event() is not None
        decode = [w for w in c.worker_states() if w["role"] == "decode"][0]
        assert decode["in_flight"] == 4 and decode["pages_free"] < decode["pages_total"]
        s.close()
        c.assert_idle(timeout=15)
        time.sleep(0.2)
        r = Stream(c.url, "/v1/completions", body_for(c, n=2, max_tokens=4)).read_all()
        assert r.done and r.error is None and indexes_seen(r.events) == {0, 1}
        c.assert_idle()
    finally:
        c.stop()
