"""Helpers for the end-to-end deployment tests: streamed completions over httpx with a deadline on
every stream, a load of client loops that records each stream's outcome, and what a frontend's
/workers says (by address)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Outcome:
    """One streamed request as the client saw it."""

    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    error: str = ""
    completion_tokens: int = -1  # from the usage chunk
    done: bool = False  # saw [DONE]
    t0: float = 0.0
    t1: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error and self.finish is not None


async def stream(client: httpx.AsyncClient, url: str, prompt: str | list[int], max_tokens: int,
                 timeout: float = 30.0, **extra: Any) -> Outcome:
    """One streamed /v1/completions (greedy), read to the end within `timeout` seconds."""
    body = {"model": extra.pop("model", "tiny"), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **extra}
    out = Outcome(t0=time.monotonic())
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.error = (await r.aread()).decode(errors="replace")
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        out.done = True
                        break
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out.error = json.dumps(ev["error"])
                    for c in ev.get("choices", []):
                        out.text += c.get("text") or ""
                        out.finish = c.get("finish_reason") or out.finish
                    if ev.get("usage"):
                        out.completion_tokens = ev["usage"]["completion_tokens"]
    except TimeoutError:
        out.error = f"no end within {timeout}s"
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.t1 = time.monotonic()
    return out


class Load:
    """`clients` loops each sending one streamed request after another until `stop()`."""

    def __init__(self, url: str, clients: int, max_tokens: int, model: str = "tiny",
                 timeout: float = 30.0) -> None:
        self.url, self.max_tokens, self.model, self.timeout = url, max_tokens, model, timeout
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout),
                                         limits=httpx.Limits(max_connections=clients + 4))
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(clients)]

    async def _loop(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.outcomes.append(await stream(self._client, self.url, f"client {i} request {n}",
                                              self.max_tokens, self.timeout, model=self.model))

    async def stop(self, timeout: float = 60.0) -> list[Outcome]:
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.gather(*self._tasks), timeout)
        finally:
            for t in self._tasks:
                t.cancel()
            await self._client.aclose()
        return self.outcomes


async def workers(url: str) -> dict[str, dict[str, Any]]:
    """The frontend's /workers, by worker address."""
    async with httpx.AsyncClient(timeout=5.0) as c:
        rows = (await c.get(url + "/workers")).json()["workers"]
    return {r["address"]: r for r in rows}


async def until(what: str, check: Any, timeout: float, every: float = 0.1) -> Any:
    """Await `check()` (sync or async) until it returns something truthy; fail at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")


def idle(rows: dict[str, dict[str, Any]]) -> bool:
    """Every worker that is up has every page free and nothing in flight."""
    up = [w for w in rows.values() if w["state"] == "up"]
    return bool(up) and all(w["pages_free"] == w["pages_total"] and w["running"] == 0
                            and w["waiting"] == 0 and w["in_flight"] == 0 for w in up)
