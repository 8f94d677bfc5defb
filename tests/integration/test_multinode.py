"""Several nodes on one machine: frontend, prefill and decode each in a network namespace of its own
on a bridge (tests/netns.py; root only, skipped cleanly otherwise).

Workers bind 0.0.0.0 and advertise their namespace's address (`--advertise-host`): the frontends'
connections, the prefill bootstrap and the NIXL transfer all use it. Binding beyond loopback needs
the cluster's CURVE keys, so every process gets `--auth-keys` (written into the test's tmp dir).
The KV goes over UCX TCP between namespaces (UCX_TLS=tcp, UCX_NET_DEVICES=eth0). An aggregated
worker in the prefill node serves the same greedy requests through a second frontend: the
disaggregated answers must equal the aggregated ones, and every page is free afterwards. The
client runs inside the frontend's namespace (the bridge is not reachable from the host's).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from tandem.runtime import auth  # noqa: E402
from tests import netns  # noqa: E402

WORKER_PORT, BOOT_PORT, AGG_PORT = 7100, 7200, 7101
PD_HTTP, AGG_HTTP = 8000, 8001
WORKER_ARGS = ["--engine", "reference", "--page-size", "16", "--num-pages", "512",
               "--max-batch", "16", "--log-level", "INFO"]

CLIENT = textwrap.dedent("""
    import json, sys, time, urllib.request, urllib.error
    from concurrent.futures import ThreadPoolExecutor
    urls, prompts, deadline = sys.argv[1].split(","), json.loads(sys.argv[2]), float(sys.argv[3])

    def get(url, path):
        with urllib.request.urlopen(url + path, timeout=5) as r:
            return json.loads(r.read())

    for url in urls:
        while True:
            try:
                get(url, "/health")
                break
            except (urllib.error.URLError, OSError):
                if time.time() > deadline:
                    sys.exit(f"{url} not ready before the deadline")
                time.sleep(0.2)

    def one(url, ids):
        body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 8,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            c = json.loads(r.read())
        return [c["choices"][0]["text"], c["usage"]["completion_tokens"],
                c["choices"][0]["finish_reason"]]

    out = {}
    with ThreadPoolExecutor(4) as ex:
        for url in urls:
            out[url] = list(ex.map(lambda ids: one(url, ids), prompts))
    time.sleep(0.5)  # (the last releases reach the workers)
    out["workers"] = {url: get(url, "/workers")["workers"] for url in urls}
    print(json.dumps(out))
""")


@pytest.fixture
def nodes():
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces: {why}")
    made = netns.Nodes.create(3)
    try:
        yield made
    finally:
        made.close()


def test_frontend_prefill_decode_in_three_namespaces(nodes: netns.Nodes, tiny_model: str,
                                                     tmp_path: Path) -> None:
    t0 = time.monotonic()
    keys = tmp_path / "keys"
    auth.write_keys(keys)
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "NIXL_LOG_LEVEL": "WARN"}
    tandem = [sys.executable, "-m", "tandem.cli"]
    common = ["--model", tiny_model, "--auth-keys", str(keys)]
    fe_node, p_node, d_node = 0, 1, 2
    p_addr, d_addr = nodes.addr(p_node), nodes.addr(d_node)

    def log(name: str) -> str:
        return str(tmp_path / f"{name}.log")

    nodes.run(p_node, [*tandem, "worker", *common, *WORKER_ARGS, "--role", "prefill",
                       "--host", "0.0.0.0", "--advertise-host", p_addr,
                       "--port", str(WORKER_PORT), "--bootstrap-port", str(BOOT_PORT)],
              env=env, log=log("prefill"))
    nodes.run(d_node, [*tandem, "worker", *common, *WORKER_ARGS, "--role", "decode",
                       "--host", "0.0.0.0", "--advertise-host", d_addr,
                       "--port", str(WORKER_PORT)], env=env, log=log("decode"))
    nodes.run(p_node, [*tandem, "worker", *common, *WORKER_ARGS, "--role", "agg",
                       "--host", "0.0.0.0", "--advertise-host", p_addr,
                       "--port", str(AGG_PORT)], env=env, log=log("agg"))
    pd_workers = f"tcp://{p_addr}:{WORKER_PORT},tcp://{d_addr}:{WORKER_PORT}"
    nodes.run(fe_node, [*tandem, "frontend", *common, "--workers", pd_workers,
                        "--port", str(PD_HTTP)], env=env, log=log("frontend-pd"))
    nodes.run(fe_node, [*tandem, "frontend", *common, "--workers", f"tcp://{p_addr}:{AGG_PORT}",
                        "--port", str(AGG_HTTP)], env=env, log=log("frontend-agg"))

    prompts = [[(7 * i + 3 * j) % 900 + 10 for j in range(n)]
               for i, n in enumerate([1, 5, 15, 16, 17, 31, 33, 48, 64, 70])]
    pd_url, agg_url = f"http://127.0.0.1:{PD_HTTP}", f"http://127.0.0.1:{AGG_HTTP}"
    try:
        out = json.loads(nodes.check_output(
            fe_node, [sys.executable, "-c", CLIENT, f"{pd_url},{agg_url}", json.dumps(prompts),
                      str(time.time() + 60)], timeout=85 - (time.monotonic() - t0), env=env))
    except Exception:
        for name in ("prefill", "decode", "agg", "frontend-pd", "frontend-agg"):
            print(f"--- {name}\n{Path(log(name)).read_text()[-2500:]}")
        raise
    assert all(ok_len == 8 or fin == "stop" for _, ok_len, fin in out[agg_url])
    assert out[pd_url] == out[agg_url]
    pd_rows = out["workers"][pd_url]
    assert {r["address"] for r in pd_rows} == {f"tcp://{p_addr}:{WORKER_PORT}",
                                               f"tcp://{d_addr}:{WORKER_PORT}"}
    assert {r["role"] for r in pd_rows} == {"prefill", "decode"}
    assert all(r["placed"] == len(prompts) for r in pd_rows)  # every request went P -> D
    for r in pd_rows + out["workers"][agg_url]:
        assert r["state"] == "up" and r["pages_free"] == r["pages_total"] and r["in_flight"] == 0
    assert time.monotonic() - t0 < 90
