"""What the live SGLang test modules share: whether SGLang's CPU engine can run here (and if not,
what is missing and how to get it), the worker flags, and small HTTP helpers."""

from __future__ import annotations

import importlib.metadata
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.sse import Stream, StreamResult

REQUIREMENTS = Path(__file__).with_name("requirements-live.txt")
START_TIMEOUT_S = 300.0  # SGLang's start: ~45 s on a loaded 2-core machine
# The last two: SGLang's own flag. float32, to compare with transformers exactly (tandem runs
# SGLang's torch paths for it on a CPU with AMX, whose kernels take no float32: sglang_cpu).
WORKER_ARGS = ["--device", "cpu", "--num-pages", "256", "--dtype", "float32"]
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


def pick_stop(text: str) -> tuple[int, str]:
    """A printable stop string first seen well past the start of `text`, and where."""
    for n in (3, 2, 1):
        for at in range(max(1, len(text) // 4), len(text) - n):
            stop = text[at:at + n]
            if stop.isascii() and stop.isprintable() and stop.strip() and text.find(stop) == at:
                return at, stop
    raise AssertionError(f"no stop string to pick in {text!r}")
