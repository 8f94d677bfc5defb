"""A client that goes away mid-stream aborts its request: no page held, no task running."""

from __future__ import annotations

import http.client
import json
import time

import pytest


def open_stream(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


@pytest.mark.parametrize("engine,worker_args", [
    ("mock", ["--step-delay-ms", "5"]),
    ("reference", []),
])
def test_disconnect_mid_stream_frees_pages(make_cluster, engine, worker_args):
    c = make_cluster(engine, workers=1, worker_args=worker_args)
    model = c.get_json("/v1/models")["data"][0]["id"]
    conns = []
    for _ in range(4):
        conn, resp = open_stream(c.url, {"model": model, "prompt": "tell me a long story",
                                         "max_tokens": 1500, "stream": True,
                                         "ignore_eos": True})
        line = resp.readline()  # the first event has arrived: the request is running
        assert line.startswith(b"data: ")
        conns.append(conn)
    busy = c.worker_states()[0]
    assert busy["pages_free"] < busy["pages_total"]
    for conn in conns:
        conn.sock.close()  # type: ignore[union-attr]
        conn.close()
    t0 = time.monotonic()
    c.assert_idle(timeout=10)
    assert time.monotonic() - t0 < 10
    metrics = urlread(c.url + "/metrics")
    assert "tandem_worker_pages_free" in metrics


def urlread(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()
