"""Garbage at every door while verified streams run (a bounded, seeded slice; perf/ soaks more).

A 1P1D mock cluster serves streamed completions whose texts were recorded before the fuzzing
started (the mock engine is deterministic, so the same request must give the same text). While
they run, seeded random and structured garbage goes to the HTTP API, to the decode and prefill
workers' request sockets, and to the prefill worker's KV bootstrap socket. Afterwards: every stream
was exact, every process is alive and serving, and every page is free.

TANDEM_FUZZ_SCALE multiplies the amount of garbage (default 1).
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import zmq

from tandem.runtime import wire
from tests.cluster import Cluster, free_port
from tests.sse import completion

SCALE = int(os.environ.get("TANDEM_FUZZ_SCALE", "1"))
SEED = 20261123


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    c = Cluster(tiny_model, str(tmp_path_factory.mktemp("fuzz")))
    bootstrap = free_port()
    c.add_worker("mock", ["--role", "prefill", "--bootstrap-port", str(bootstrap)])
    c.add_worker("mock", ["--role", "decode"])
    c.start_frontend()
    c.bootstrap = f"tcp://127.0.0.1:{bootstrap}"  # type: ignore[attr-defined]
    yield c
    c.stop()


def _model(c: Cluster) -> str:
    return c.get_json("/v1/models")["data"][0]["id"]  # type: ignore[index]


def _bodies(c: Cluster) -> list[dict]:
    return [{"model": _model(c), "prompt": f"fuzz {i} " * (1 + i % 7), "max_tokens": 12 + i % 20,
             "temperature": 0} for i in range(16)]


def _http_garbage(url: str, rng: random.Random, n: int) -> list[int]:
    """Send n bad requests; return the statuses seen (0 = connection closed without an answer)."""
    host, port = url.removeprefix("http://").split(":")
    bodies = [
        b'{"model": "m", "prompt": "\xff\xfe", "max_tokens": 4}',  # invalid UTF-8
        b"[" * 100_000 + b"]" * 100_000,  # very deep nesting
        b'{"model": "m", "prompt": "x", "max_tokens": 4, "seed": 18446744073709551617}',
        b'{"model": "m", "prompt": "x", "max_tokens": 4, "top_k": 99999999999999999999999}',
        b'{"model": "m", "prompt": "x", "max_tokens": 1e400}',
        b'{"model": "m", "prompt": [99999999999999999999], "max_tokens": 4}',
        b'{"model": "m", "prompt": "x", "n": 3, "seed": 18446744073709551615, "max_tokens": 2}',
        b"not json at all",
    ]
    statuses = []
    for i in range(n):
        if i % 3 == 2:
            payload = rng.randbytes(rng.randint(1, 2048))  # not even HTTP
        else:
            body = bodies[i % len(bodies)] if i % 3 == 0 else rng.randbytes(rng.randint(0, 512))
            payload = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                       b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            head = b""
            try:
                while b"\r\n" not in head:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    head += chunk
            except OSError:
                pass
        statuses.append(int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else 0)
    return statuses


def _frames(rng: random.Random, tags: list[int]) -> list[bytes]:
    kind = rng.randrange(6)
    tag = bytes([rng.choice(tags)])
    if kind == 0:
        return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
    if kind == 1:
        return [tag + rng.randbytes(rng.randint(0, 256))]
    if kind == 2:  # a known tag, a string field holding invalid UTF-8
        return [bytes([0x93, tag[0], 0x03, 0xA2, 0xFF, 0xFE])]
    if kind == 3:  # a well-formed array of random shape
        return [msgspec.msgpack.encode([tag[0], rng.random(), "x" * rng.randint(0, 9),
                                        [rng.randint(-2**63, 2**64 - 1)]])]
    if kind == 4:  # a tag no message has
        return [msgspec.msgpack.encode([max(tags) + 1, 1])]
    return [tag]


def _zmq_garbage(address: str, rng: random.Random, n: int, tags: list[int],
                 structured: list[wire.Message]) -> None:
    ctx = zmq.Context.instance()
    for burst in range(max(1, n // 50)):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"fuzz-{burst}-{rng.random()}".encode())
        sock.connect(address)
        for i in range(50):
            if structured and i % 5 == 0:
                sock.send_multipart([wire.encode(rng.choice(structured))])
            else:
                sock.send_multipart(_frames(rng, tags))
        time.sleep(0.05)
        sock.close(0)  # gone before any answer: a reply to it must not hurt the receiver


def test_garbage_everywhere_while_streams_run(pd):
    c = pd
    bodies = _bodies(c)
    expected = [completion(c.url, b).text for b in bodies]
    assert all(expected)
    rng = random.Random(SEED)
    to_worker = [wire.Hello(1, "x"), wire.Credit(2**31), wire.LoadQuery(-1),
                 wire.Abort([f"cmpl-{rng.getrandbits(64):x}" for _ in range(5)]),
                 wire.Generates([wire.Generate("fz", [2**40, -5], wire.SamplingParams())]),
                 wire.Generates([wire.Generate("fz2", [], wire.SamplingParams(max_tokens=0))])]
    to_prefill = [wire.KvRooms([wire.KvRoom(rng.getrandbits(63), list(range(5)))]),
                  wire.KvCancel([1]),
                  wire.KvHello(3, "fz", b"\x00" * 64, wire.KvLayout(0, 1 << 40, 1 << 30)),
                  wire.KvRooms([wire.KvRoom(-1, [-1, 2**40])])]
    workers = [w.address for w in c.workers]
    with ThreadPoolExecutor(8) as ex:
        streams = [ex.submit(completion, c.url, b, 60.0) for b in bodies * 2]
        http = ex.submit(_http_garbage, c.url, random.Random(SEED + 1), 40 * SCALE)
        zw = [ex.submit(_zmq_garbage, a, random.Random(SEED + 2 + i), 200 * SCALE,
                        [1, 4, 6, 8, 9], to_worker) for i, a in enumerate(workers)]
        zb = ex.submit(_zmq_garbage, c.bootstrap, random.Random(SEED + 9), 200 * SCALE,
                       [16, 19, 21], to_prefill)
        results = [f.result() for f in streams]
        statuses = http.result()
        for f in [*zw, zb]:
            f.result()
    for r, want in zip(results, expected * 2):
        assert r.status == 200 and r.done and r.error is None, (r.status, r.body, r.events[-2:])
        assert r.text == want
    # Bad HTTP input is answered with a client error or the connection is closed: never a 5xx.
    assert statuses and all(s == 0 or 400 <= s < 500 for s in statuses), statuses
    assert all(p.alive() for p in [*c.workers, c.frontend]), [p.log() for p in c.workers]
    again = [completion(c.url, b) for b in bodies[:4]]
    assert [r.text for r in again] == expected[:4]
    c.assert_idle(timeout=30)
