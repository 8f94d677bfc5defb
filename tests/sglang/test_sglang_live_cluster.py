"""SGLang's CPU engine under tandem as a cluster, live, on the suite's tiny model in float32: two
aggregated workers (one in SGLang's cumulative output mode, one incremental, both publishing
SGLang's own KV events), a prefill and a decode worker (1P1D through SGLang's NIXL transfer, the
KV pool described to NIXL as host memory by tandem's adapter), and four frontends over them: one
per aggregated worker, one for the PD pair, one over both aggregated workers (the kv router).

- Both output modes and PD give transformers' greedy answer token for token, with its logprobs,
  streamed and not, with stop strings; a stream cancelled mid-way leaves each engine idle (in
  incremental mode SGLang's abort echoes the last id, which the adapter trims: the worker logs no
  delta out of step).
- A repeated prefix goes to the worker whose SGLang events say it holds it, and SGLang reports
  the cached tokens.
- Last, in this order (each ends a worker): a worker SIGKILLed mid-stream, whose stream moves to
  the other and stays exact; then SIGTERM to the survivor mid-stream: the stream finishes and the
  worker exits 0.

Every page free afterwards: tandem's accounting (`assert_idle`), and SGLang's own, which each
scheduler checks whenever it goes idle and which is fatal to it on a leak
(SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, on by default: checked below), so the workers must be
alive at the end of each test."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import Cluster, Proc, free_port
from tests.sglang.live import START_TIMEOUT_S, WORKER_ARGS, missing, pick_stop, post, stream
from tests.sse import Stream
from tests.transformers_ref import Expected, Transformers
from tests.waits import wait_for

if missing():
    pytest.skip(missing(), allow_module_level=True)

pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 240)

PROMPTS = ["tell me a story about a dragon", "the quick brown fox", "1, 2, 3, 4,"]
MAX_TOKENS = 24
LOGPROB_TOL = 2e-3


def events_config() -> list[str]:
    return ["--kv-events-config", json.dumps({
        "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}", "bind": True,
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})]


@dataclass
class Live:
    a0: Proc  # agg, cumulative
    a1: Proc  # agg, incremental
    p: Proc
    d: Proc
    f0: Cluster
    f1: Cluster
    fpd: Cluster
    fkv: Cluster

    def frontends(self) -> list[Cluster]:
        return [self.f0, self.f1, self.fpd, self.fkv]


@pytest.fixture(scope="module")
def live(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("sglang-cluster")
    workers = Cluster(tiny_model, str(root))
    a0 = workers.add_worker("sglang", WORKER_ARGS + events_config())
    a1 = workers.add_worker("sglang", ["--output-mode", "incremental", *WORKER_ARGS,
                                       *events_config()])
    p = workers.add_worker("sglang", ["--role", "prefill", "--bootstrap-port", str(free_port()),
                                      *WORKER_ARGS])
    d = workers.add_worker("sglang", ["--role", "decode", *WORKER_ARGS])
    fronts: list[Cluster] = []
    try:
        for name, procs in (("f0", [a0]), ("f1", [a1]), ("fpd", [p, d]), ("fkv", [a0, a1])):
            (root / name).mkdir()
            c = Cluster(tiny_model, str(root / name), workers=list(procs))
            c.start_frontend(["--worker-start-timeout", f"{START_TIMEOUT_S:g}"], wait=False)
            fronts.append(c)
        for c in fronts:
            c.wait_ready(timeout=START_TIMEOUT_S)
            wait_for(lambda: all(w["state"] == "up" for w in c.worker_states()),
                     "every worker up", timeout=START_TIMEOUT_S)  # (ready: one is up)
    except BaseException:
        for w in workers.workers:
            print(w.name, w.log())
        for c in fronts:
            assert c.frontend is not None
            c.frontend.stop()
        workers.stop()
        raise
    yield Live(a0, a1, p, d, *fronts)
    for c in fronts:
        assert c.frontend is not None
        c.frontend.stop()
    workers.stop()


@pytest.fixture(scope="module")
def hf(tiny_model: str) -> Transformers:
    return Transformers(tiny_model)


@pytest.fixture(autouse=True)
def idle_after(live: Live) -> Iterator[None]:
    yield
    for c in live.frontends():
        if all(w.alive() for w in c.workers):
            c.assert_idle(timeout=20)


def model_of(c: Cluster) -> str:
    return str(c.get_json("/v1/models")["data"][0]["id"])


def completion(c: Cluster, prompt: str, **fields: Any) -> dict[str, Any]:
    status, answer = post(c.url, "/v1/completions", {
        "model": model_of(c), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, **fields})
    assert status == 200, answer
    return answer


def check(answer: dict[str, Any], want: Expected, hf: Transformers) -> None:
    """Completions name tokens by text: the text, the count and each token's logprob pin the ids
    down (another split of the same text has other logprobs)."""
    choice = answer["choices"][0]
    assert choice["text"] == hf.tok.decode(want.ids, skip_special_tokens=True)
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == answer["usage"]["completion_tokens"] == len(want.ids) == MAX_TOKENS
    worst = max(abs(a - b) for a, b in zip(lps, want.logprobs))
    assert worst <= LOGPROB_TOL, worst


def test_sglang_checks_its_own_pools_strictly_when_idle() -> None:
    """What makes 'the workers are alive' mean 'no page leaked' in SGLang's own accounting."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "srt" / "environ.py").read_text(encoding="utf-8")
    assert "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE = EnvBool(True)" in source
    assert os.environ.get("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "1") not in ("0", "false")


@pytest.mark.parametrize("front", ["f0", "f1", "fpd"])
def test_greedy_answers_are_transformers_token_for_token(live: Live, hf: Transformers,
                                                         front: str) -> None:
    """Cumulative, incremental and 1P1D: transformers' answer with its logprobs, streamed and
    not (the streamed text joined from its deltas)."""
    c: Cluster = getattr(live, front)
    for prompt in PROMPTS:
        want = hf.greedy(hf.text_ids(prompt), MAX_TOKENS)
        check(completion(c, prompt), want, hf)
        streamed = stream(c.url, "completions", {
            "model": model_of(c), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True})
        assert streamed.done and streamed.error is None
        assert streamed.text == hf.tok.decode(want.ids, skip_special_tokens=True)
    assert all(w.alive() for w in c.workers)


def test_stop_strings_cut_the_same_in_every_mode(live: Live) -> None:
    full = completion(live.f0, PROMPTS[0], logprobs=None)["choices"][0]["text"]
    at, stop = pick_stop(full)
    for c in (live.f0, live.f1, live.fpd):
        answer = completion(c, PROMPTS[0], logprobs=None, stop=[stop])
        assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == (
            full[:at], "stop")
        streamed = stream(c.url, "completions", {
            "model": model_of(c), "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stop": [stop]})
        assert (streamed.text, streamed.finish_reason) == (full[:at], "stop")


def test_a_stream_cancelled_mid_way_leaves_every_mode_idle(live: Live) -> None:
    for c in (live.f0, live.f1, live.fpd):
        s = Stream(c.url, "/v1/completions", {
            "model": model_of(c), "prompt": PROMPTS[1], "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True})
        for _ in range(3):
            assert s.next_event() is not None
        s.close()
        c.assert_idle(timeout=20)
    for w in (live.a0, live.a1, live.p, live.d):
        assert w.alive() and "out of step" not in w.log(last=200_000), w.name


def placed(c: Cluster) -> dict[str, int]:
    return {w["address"]: int(w["placed"]) for w in c.worker_states()}


def state(c: Cluster, address: str) -> dict[str, Any]:
    return next(w for w in c.worker_states() if w["address"] == address)


def events_applied(c: Cluster, address: str) -> int:
    return int(state(c, address)["kv_events_applied"])


def test_a_repeated_prefix_goes_to_the_sglang_worker_that_holds_it(live: Live) -> None:
    """The router reads SGLang's own KV events: each prefix's second request lands where the
    first was computed, and SGLang serves it from its cache."""
    c = live.fkv
    rows = {w["address"]: w for w in c.worker_states()}
    assert all(r["kv_events_addr"] and r["kv_index"] == "events" for r in rows.values()), rows
    for topic in ("castles", "rivers"):
        prefix = " ".join(f"{topic} {i}" for i in range(60))  # (well past a few 16-token pages)
        before, applied = placed(c), {a: events_applied(c, a) for a in rows}
        first = completion(c, prefix + " one", max_tokens=2, logprobs=None)
        after = placed(c)
        holder = next(a for a in after if after[a] > before[a])
        deadline = time.monotonic() + 20  # (SGLang publishes the stored pages after the step)
        while events_applied(c, holder) <= applied[holder] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert events_applied(c, holder) > applied[holder], "no KV event from SGLang arrived"
        predicted = state(c, holder)["kv_predicted_cached_tokens"]
        second = completion(c, prefix + " two", max_tokens=2, logprobs=None)
        final = placed(c)
        assert state(c, holder)["kv_predicted_cached_tokens"] >= predicted + 64
        assert final[holder] == after[holder] + 1, (holder, after, final)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 64 and first["usage"]["prompt_tokens"] > 64, second["usage"]


def _serving(c: Cluster) -> Proc:
    busy = [w for w in c.worker_states() if w["in_flight"] > 0]
    assert len(busy) == 1, busy
    return next(w for w in c.workers if w.address == busy[0]["address"])


def test_a_stream_moves_off_a_killed_sglang_worker_and_stays_exact(
        live: Live, hf: Transformers) -> None:
    """(Ends one aggregated worker.) SIGKILL to the worker serving a greedy stream once three
    chunks have arrived: the stream goes on on the other (prompt and tokens so far as its prompt)
    and the whole answer is transformers'."""
    c = live.fkv
    max_tokens = 64
    want = hf.greedy(hf.text_ids(PROMPTS[2]), max_tokens)
    s = Stream(c.url, "/v1/completions", {
        "model": model_of(c), "prompt": PROMPTS[2], "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120)
    seen, killed = 0, None
    while (ev := s.next_event()) is not None:
        seen += sum(1 for ch in ev.get("choices", []) if ch.get("text"))
        if seen >= 3 and killed is None:
            killed = _serving(c)
            killed.popen.send_signal(signal.SIGKILL)
    s.close()
    r = s.result
    assert killed is not None and r.done and r.error is None, r.events[-3:]
    assert r.text == hf.tok.decode(want.ids, skip_special_tokens=True)
    usage = [e["usage"] for e in r.events if e.get("usage")][-1]
    assert usage["completion_tokens"] == max_tokens
    with urllib.request.urlopen(c.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    moved = [ln for ln in metrics.splitlines() if ln.startswith("tandem_request_migrations_total ")]
    assert moved and float(moved[0].split()[1]) >= 1
    killed.popen.wait(30)
    c.workers = [w for w in c.workers if w is not killed]


def test_sigterm_drains_an_sglang_worker_mid_stream(live: Live) -> None:
    """(Ends the other aggregated worker.) SIGTERM while a stream runs: the stream finishes whole
    and the worker exits 0 on its own."""
    c = live.fkv
    (worker,) = [w for w in c.workers if w.alive()]
    s = Stream(c.url, "/v1/completions", {
        "model": model_of(c), "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120)
    seen, signalled = 0, False
    while (ev := s.next_event()) is not None:
        seen += sum(1 for ch in ev.get("choices", []) if ch.get("text"))
        if seen >= 3 and not signalled:
            assert _serving(c) is worker
            worker.popen.send_signal(signal.SIGTERM)
            signalled = True
    s.close()
    r = s.result
    assert signalled and r.done and r.error is None and r.finish_reason == "length", r.events[-3:]
    assert [e["usage"] for e in r.events if e.get("usage")][-1]["completion_tokens"] == 48
    assert worker.popen.wait(60) == 0, worker.log()
