"""SGLang's real CPU engine behind tandem, live: one `tandem worker --engine sglang --device cpu`
(bfloat16, the suite's tiny model) and a frontend, started once for the whole module (SGLang takes
tens of seconds to start on a CPU). Greedy answers streamed and not agree with each other and
across runs; stop strings; seeds; a stream cancelled or a client gone mid-request,
with the engine healthy afterwards; and after every test the worker idle, in tandem's accounting
and in SGLang's own (its TokenizerManager holds no request).

Needs SGLang's CPU kernel library, which no package index carries (README, "SGLang on a CPU"):
without it the module skips, saying what is missing and how to get it."""

from __future__ import annotations

import importlib.metadata
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import Cluster
from tests.sse import Stream, StreamResult

REQUIREMENTS = Path(__file__).with_name("requirements-live.txt")
START_TIMEOUT_S = 300.0  # SGLang's start: ~45 s on a loaded 2-core machine
# The last two: SGLang's own flag. bfloat16, since on a CPU with AMX SGLang's RMSNorm kernel takes
# no float32; greedy answers are still the same every time.
WORKER_ARGS = ["--device", "cpu", "--num-pages", "256", "--dtype", "bfloat16"]
PROMPT = "tell me a story about a dragon"


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def missing() -> str:
    """What SGLang's live CPU engine lacks here, and how to get it ("" = nothing)."""
    if not _installed("sglang-kernel-cpu"):
        return ("SGLang's CPU kernel library is not installed: no package index carries it, and "
                "`make venv` installs it only from a wheel sglang_kernel_cpu-*-cp311-*.whl in "
                "wheels/ of the `shared` folder beside the checkout (Makefile: SHARED). Build it "
                "as README.md's \"SGLang on a CPU\" says, put it there and run `make venv`")
    need = ["sglang"] + [line.split("==")[0] for line in REQUIREMENTS.read_text().splitlines()
                         if line and not line.startswith("#")]
    absent = [name for name in need if not _installed(name)]
    if absent:
        return (f"SGLang's CPU engine needs {', '.join(absent)}: `make venv` installs them "
                "(tests/sglang/requirements.txt, requirements-live.txt)")
    return ""


if missing():
    pytest.skip(missing(), allow_module_level=True)

pytestmark = pytest.mark.timeout(START_TIMEOUT_S + 120)


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tiny_model, str(tmp_path_factory.mktemp("sglang-live")))
    c.add_worker("sglang", WORKER_ARGS)
    t0 = time.monotonic()
    try:
        c.start_frontend(["--worker-start-timeout", f"{START_TIMEOUT_S:g}"], wait=False)
        c.wait_ready(timeout=START_TIMEOUT_S)
    except BaseException:
        print(c.workers[0].log())
        c.stop()
        raise
    print(f"SGLang's CPU worker ready in {time.monotonic() - t0:.1f} s")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def model(cluster: Cluster) -> str:
    return str(cluster.get_json("/v1/models")["data"][0]["id"])


@pytest.fixture(autouse=True)
def idle_after(cluster: Cluster):
    yield
    cluster.assert_idle()  # SGLang's own requests count as waiting (tandem.engines.sglang, load)


def post(url: str, path: str, body: dict[str, Any], timeout: float = 60.0
         ) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def body(model: str, endpoint: str, **fields: Any) -> dict[str, Any]:
    prompt: dict[str, Any] = ({"prompt": PROMPT} if endpoint == "completions" else
                              {"messages": [{"role": "user", "content": PROMPT}]})
    return {"model": model, **prompt, "max_tokens": 24, "temperature": 0.0, **fields}


def text_of(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice.get("text", (choice.get("message") or {}).get("content")) or "")


def stream(url: str, endpoint: str, payload: dict[str, Any]) -> StreamResult:
    return Stream(url, f"/v1/{endpoint}", {**payload, "stream": True,
                                           "stream_options": {"include_usage": True}}).read_all()


def usage_of(result: StreamResult) -> dict[str, Any]:
    return next(e["usage"] for e in result.events if e.get("usage"))


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_greedy_streamed_equals_non_streamed(cluster: Cluster, model: str, endpoint: str) -> None:
    status, answer = post(cluster.url, f"/v1/{endpoint}", body(model, endpoint, ignore_eos=True))
    assert status == 200, answer
    text = text_of(answer)
    assert text and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 24 and answer["usage"]["prompt_tokens"] > 0
    streamed = stream(cluster.url, endpoint, body(model, endpoint, ignore_eos=True))
    assert streamed.done and streamed.error is None
    assert (streamed.text, streamed.finish_reason) == (text, "length")
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage_of(streamed)[k] for k in counts] == [answer["usage"][k] for k in counts]
    again = post(cluster.url, f"/v1/{endpoint}", body(model, endpoint, ignore_eos=True))[1]
    assert text_of(again) == text  # float32 greedy: the same every time


def pick_stop(text: str) -> tuple[int, str]:
    """A printable stop string first seen well past the start of `text`, and where."""
    for n in (3, 2, 1):
        for at in range(max(1, len(text) // 4), len(text) - n):
            stop = text[at:at + n]
            if stop.isascii() and stop.isprintable() and stop.strip() and text.find(stop) == at:
                return at, stop
    raise AssertionError(f"no stop string to pick in {text!r}")


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_stop_strings(cluster: Cluster, model: str, endpoint: str) -> None:
    """The frontend stops at a stop string and ends SGLang's request early: the text before it,
    finish "stop", streamed and not."""
    full = text_of(post(cluster.url, f"/v1/{endpoint}", body(model, endpoint,
                                                               ignore_eos=True))[1])
    at, stop = pick_stop(full)
    status, answer = post(cluster.url, f"/v1/{endpoint}",
                          body(model, endpoint, ignore_eos=True, stop=[stop]))
    assert status == 200, answer
    assert (text_of(answer), answer["choices"][0]["finish_reason"]) == (full[:at], "stop")
    streamed = stream(cluster.url, endpoint, body(model, endpoint, ignore_eos=True, stop=[stop]))
    assert (streamed.text, streamed.finish_reason) == (full[:at], "stop")


def test_seeded_sampling_is_refused_naming_seed(cluster: Cluster, model: str) -> None:
    """SGLang honours a seed only with --enable-deterministic-inference, which SGLang 0.5.23 does
    not allow on a CPU (its attention backends for it are GPU ones): a seed is a 400 naming it,
    never a seed silently ignored. Sampling without one works."""
    status, answer = post(cluster.url, "/v1/completions",
                          body(model, "completions", temperature=1.0, seed=7))
    assert status == 400 and answer["error"]["param"] == "seed", answer
    status, answer = post(cluster.url, "/v1/completions",
                          body(model, "completions", temperature=1.0, top_p=0.9,
                               ignore_eos=True))
    assert status == 200 and answer["usage"]["completion_tokens"] == 24, answer


def test_a_cancelled_stream_leaves_the_engine_idle_and_healthy(cluster: Cluster,
                                                               model: str) -> None:
    before = text_of(post(cluster.url, "/v1/completions", body(model, "completions"))[1])
    s = Stream(cluster.url, "/v1/completions",
               body(model, "completions", max_tokens=1500, ignore_eos=True, stream=True))
    for _ in range(3):
        assert s.next_event() is not None  # running in SGLang now
    s.close()  # the client goes away mid-stream
    cluster.assert_idle(timeout=20)
    after = text_of(post(cluster.url, "/v1/completions", body(model, "completions"))[1])
    assert after == before


def test_a_client_gone_before_a_non_streamed_answer_frees_it(cluster: Cluster,
                                                            model: str) -> None:
    with pytest.raises(TimeoutError):
        post(cluster.url, "/v1/chat/completions",
             body(model, "chat/completions", max_tokens=1500, ignore_eos=True), timeout=1.0)
    cluster.assert_idle(timeout=20)
    status, answer = post(cluster.url, "/v1/chat/completions", body(model, "chat/completions"))
    assert status == 200 and text_of(answer), answer
