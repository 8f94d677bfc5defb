"""PD failure semantics with real processes (mock engine; slow transfers are simulated).

Each affected request ends with a clear error (an SSE error event then [DONE], or a 5xx before the
stream starts), unaffected requests go on, a dead worker leaves the router, and every surviving
worker's pages are all free once idle."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor


from tandem.runtime import wire, transport
from tandem.runtime.wire import Bootstrap, Deltas, Generate, SamplingParams
from tests.cluster import Cluster, free_port
from tests.sse import Stream, StreamResult, completion
from tests.waits import wait_for

PAGE_BYTES = 8192  # the tiny model's page: 2 layers * k/v * 16 tokens * 2 heads * 16 dims * 4 B
LONG_PROMPT = list(range(10, 110))  # 100 tokens = 7 pages


def pd_cluster(tiny_model, tmp_path, prefill: int, decode: int, worker_args: list[str],
               frontend: bool = True, frontend_args: list[str] | None = None) -> Cluster:
    c = Cluster(tiny_model, str(tmp_path))
    for role in ["prefill"] * prefill + ["decode"] * decode:
        extra = ["--role", role, *worker_args]
        if role == "prefill":
            extra += ["--bootstrap-port", str(free_port())]
        c.add_worker("mock", extra)
    if frontend:
        c.start_frontend(frontend_args)
    return c


def ok_or_clean_error(r: StreamResult) -> str:
    """'ok' for a complete stream, 'error' for a clean failure; anything else fails the test."""
    if r.status != 200:
        assert r.status >= 500 and r.error is not None, (r.status, r.body)
        return "error"
    assert r.done, f"stream ended without [DONE]: {r.events[-3:]}"
    if r.error is not None:
        assert "message" in r.error and r.error["message"]
        return "error"
    assert r.finish_reason in ("length", "stop")
    return "ok"


def by_state(c: Cluster) -> dict[str, str]:
    return {w["address"]: w["state"] for w in c.worker_states()}


def assert_survivors_idle(c: Cluster, dead: list, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = c.worker_states()
        alive = [w for w in states if w["address"] not in {d.address for d in dead}]
        if all(w["state"] == "up" and w["pages_free"] == w["pages_total"] and w["running"] == 0
               for w in alive):
            return
        time.sleep(0.2)
    raise AssertionError(f"survivors not idle: {states}")


def run_streams(url: str, bodies: list[dict], during=None, timeout: float = 60.0):
    with ThreadPoolExecutor(len(bodies)) as ex:
        futs = [ex.submit(completion, url, b, timeout) for b in bodies]
        if during is not None:
            during()
        return [f.result(timeout + 5) for f in futs]


def test_prefill_killed_during_transfer(tiny_model, tmp_path):
    # A 7-page transfer at 20 kB/s takes ~2.9 s: plenty of time to kill a prefill worker in it.
    # Moves off (--max-migrations 0): the failure path (moves: tests/fault/test_migration.py).
    c = pd_cluster(tiny_model, tmp_path, 2, 1, ["--kv-bytes-per-s", "20000"],
                   frontend_args=["--max-migrations", "0"])
    try:
        model = c.get_json("/v1/models")["data"][0]["id"]
        body = {"model": model, "prompt": LONG_PROMPT, "max_tokens": 8}
        victim = c.workers[0]

        def kill_soon() -> None:
            time.sleep(1.0)
            victim.kill()

        results = run_streams(c.url, [body] * 6, during=kill_soon)
        kinds = [ok_or_clean_error(r) for r in results]
        assert "error" in kinds and "ok" in kinds, kinds
        deadline = time.monotonic() + 10
        while by_state(c)[victim.address] == "up":
            assert time.monotonic() < deadline, "dead prefill worker still in the router"
            time.sleep(0.2)
        assert_survivors_idle(c, [victim])
        # Unaffected capacity keeps serving.
        assert ok_or_clean_error(completion(c.url, body)) == "ok"
        assert_survivors_idle(c, [victim])
    finally:
        c.stop()


def test_decode_killed_mid_stream(tiny_model, tmp_path):
    c = pd_cluster(tiny_model, tmp_path, 1, 2, ["--step-delay-ms", "20"],
                   frontend_args=["--max-migrations", "0"])  # the failure path
    try:
        model = c.get_json("/v1/models")["data"][0]["id"]
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 150}
        victim = c.workers[1]

        def kill_soon() -> None:
            time.sleep(1.0)
            victim.kill()

        results = run_streams(c.url, [body] * 6, during=kill_soon)
        kinds = [ok_or_clean_error(r) for r in results]
        assert "error" in kinds and "ok" in kinds, kinds
        for r, k in zip(results, kinds):
            if k == "error":
                assert r.status == 200 and r.events[-1].get("error"), "error event is the last"
        assert_survivors_idle(c, [victim])
        assert by_state(c)[victim.address] != "up"
    finally:
        c.stop()


def test_client_gone_during_transfer_frees_everything(tiny_model, tmp_path):
    c = pd_cluster(tiny_model, tmp_path, 1, 1, ["--kv-bytes-per-s", "20000"])
    try:
        model = c.get_json("/v1/models")["data"][0]["id"]
        streams = [Stream(c.url, "/v1/completions", {"model": model, "prompt": LONG_PROMPT,
                                                     "max_tokens": 8, "stream": True},
                          wait=False)  # the client goes away before the first token
                   for _ in range(3)]

        def decode_pages_busy() -> bool:
            d = next(w for w in c.worker_states() if w["role"] == "decode")
            return bool(d["pages_free"] < d["pages_total"])

        # (the decode worker reserves a request's pages before its slow transfer starts, and
        # holds them until it ends)
        wait_for(decode_pages_busy, "the decode worker holds pages for the transfers",
                 timeout=20)
        for s in streams:
            s.close()
        c.assert_idle(timeout=15)  # D's pages come back once P's writes have ended
        assert ok_or_clean_error(completion(c.url, {"model": model, "prompt": [1, 2],
                                                    "max_tokens": 4})) == "ok"
        c.assert_idle()
    finally:
        c.stop()


def test_transfer_past_its_deadline(tiny_model, tmp_path):
    c = pd_cluster(tiny_model, tmp_path, 1, 1,
                   ["--kv-bytes-per-s", "20000", "--kv-transfer-timeout", "0.5"])
    try:
        model = c.get_json("/v1/models")["data"][0]["id"]
        t0 = time.monotonic()
        r = completion(c.url, {"model": model, "prompt": LONG_PROMPT, "max_tokens": 8})
        assert ok_or_clean_error(r) == "error"
        assert "transfer" in r.error["message"].lower()
        assert time.monotonic() - t0 < 10
        c.assert_idle()
    finally:
        c.stop()


async def _send_direct(address: str, msg: Generate, timeout: float) -> wire.Delta:
    sock = transport.dealer(address, b"test-frontend")
    try:
        transport.send_nowait(sock, wire.Generates([msg]))
        replies = transport.dealer_messages(sock, wire.TO_FRONTEND, logging.getLogger("test"))
        async with asyncio.timeout(timeout):
            async for reply in replies:
                if isinstance(reply, Deltas):
                    for d in reply.items:
                        if d.finish_reason is not None:
                            return d
        raise AssertionError("unreachable: the replies never end")
    finally:
        transport.close(sock)


def test_room_that_never_gets_its_bootstrap_message(tiny_model, tmp_path):
    c = pd_cluster(tiny_model, tmp_path, 1, 1, ["--kv-room-timeout", "1"])
    try:
        p, d = c.workers
        boot_port = _bootstrap_port(p)
        sp = SamplingParams(max_tokens=4)
        # 1) The prefill worker gets a request whose decode side never sends its pages.
        t0 = time.monotonic()
        last = asyncio.run(_send_direct(p.address, Generate("lonely-p", [1, 2, 3], sp,
                                                            Bootstrap("127.0.0.1", boot_port, 11)), 10))
        assert last.finish_reason == "error" and "room" in last.error
        assert 0.9 < time.monotonic() - t0 < 8
        # 2) The decode worker gets a request whose prefill side never gets it.
        last = asyncio.run(_send_direct(d.address, Generate("lonely-d", [1, 2, 3], sp,
                                                            Bootstrap("127.0.0.1", boot_port, 12)), 10))
        assert last.finish_reason == "error" and last.error
        c.assert_idle()
    finally:
        c.stop()


def _bootstrap_port(p) -> int:
    argv = p.popen.args
    return int(argv[argv.index("--bootstrap-port") + 1])
