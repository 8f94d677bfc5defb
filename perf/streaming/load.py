"""Fixed-concurrency load: `concurrency` slots, each a keep-alive connection streaming one request
after another, until a request count or a duration is reached. Summaries are computed once at the
end of a level; nothing per event beyond what perf.common.client records."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from perf.common.client import Connection, StreamResult


T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop: the load generator shares the machine with what it measures, so it
    spends as little CPU per event, and adds as little scheduling delay to its timings, as it can."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """During a level, CPython's cyclic collector with default thresholds would stop the client's
    loop for 100+ ms at a time with thousands of streams open (those pauses would count as server
    latency). As the servers do (tandem.runtime.lifecycle.tune_gc): freeze what exists and collect
    the young generation every 50,000 allocations; restored afterwards."""
    old = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


@dataclass(frozen=True, slots=True)
class LoadSpec:
    host: str
    port: int
    api: str = "completions"  # or "chat"
    model: str = "tiny"
    max_tokens: int = 64
    prompt: str = "Tell me about the sea."
    stream_interval: int = 1
    timeout_s: float = 300.0
    headers: bytes = b""  # more request header lines, each ending in CRLF (an API key's)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def body(self) -> bytes:
        req: dict = {"model": self.model, "stream": True, "max_tokens": self.max_tokens,
                     "temperature": 0, "ignore_eos": True,
                     "stream_options": {"include_usage": True},
                     "stream_interval": self.stream_interval}
        if self.api == "chat":
            req["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            req["prompt"] = self.prompt
        return msgspec.json.encode(req)


@dataclass(slots=True)
class LevelResult:
    concurrency: int
    results: list[StreamResult] = field(default_factory=list)
    wall_s: float = 0.0


def check(res: StreamResult, spec: LoadSpec, expected_text: str | None) -> str:
    """Why `res` is not the stream we asked for ("" when it is)."""
    if res.error:
        return res.error
    if res.completion_tokens != spec.max_tokens or res.finish_reason != "length":
        return (f"usage says {res.completion_tokens} tokens, finish {res.finish_reason!r}; asked "
                f"for {spec.max_tokens} with ignore_eos")
    if not 1 <= res.content_chunks <= res.completion_tokens:
        return f"{res.content_chunks} content chunks for {res.completion_tokens} tokens"
    if expected_text is not None and res.text != expected_text:
        return "text differs from the reference stream"
    return ""


async def run_level(spec: LoadSpec, concurrency: int, *, requests: int = 0, duration_s: float = 0,
                    progress: Callable[[int, int], None] | None = None,
                    bodies: Sequence[bytes] = ()) -> LevelResult:
    """Stream `requests` requests (or for `duration_s`) with `concurrency` in flight at once;
    every request sends `spec.body()`, or with `bodies` the i-th request bodies[i % len]."""
    each = list(bodies) or [spec.body()]
    out = LevelResult(concurrency)
    issued = 0
    deadline = 0.0

    def take() -> bool:
        nonlocal issued
        if requests and issued >= requests:
            return False
        if duration_s and time.monotonic() >= deadline:
            return False
        issued += 1
        return True

    async def slot() -> None:
        conn = Connection(spec.host, spec.port)
        try:
            while take():
                body = each[(issued - 1) % len(each)]
                out.results.append(await conn.post_stream(spec.path, body, spec.timeout_s,
                                                          spec.headers))
        finally:
            await conn.close()

    async def report() -> None:
        while True:
            await asyncio.sleep(1.0)
            if progress is not None:
                progress(len(out.results), issued)

    with quiet_gc():
        t0 = time.monotonic()
        deadline = t0 + duration_s
        reporter = asyncio.create_task(report())
        try:
            async with asyncio.TaskGroup() as tg:  # one slot failing cancels the others
                for _ in range(concurrency):
                    tg.create_task(slot())
        finally:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
        out.wall_s = time.monotonic() - t0
    return out


def print_progress(concurrency: int) -> Callable[[int, int], None]:
    def show(done: int, issued: int) -> None:
        print(f"\r  c={concurrency}: {done} done, {issued - done} in flight", end="",
              file=sys.stderr, flush=True)
    return show
