"""The frontend's log lines about traffic: one access line per HTTP request, and a periodic
one-line summary of throughput and queues.

An access line (logger `tandem.access`, INFO) says method, path, status, request id, prompt and
completion tokens, time to first token and duration; in JSON logs (tandem.runtime.logs) the same
are keys. The summary (logger `tandem.stats`, every `--log-stats-interval` seconds, only while
there is traffic or work in flight) says requests finished, prompt and generation tokens per
second over the interval, and requests running and waiting. Nothing here runs per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

access_log = logging.getLogger("tandem.access")
stats_log = logging.getLogger("tandem.stats")


class Traffic:
    """Counts since the last summary; `record` is called once per finished request."""

    __slots__ = ("requests", "prompt_tokens", "completion_tokens", "since")

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.since = time.monotonic()

    def record(self, method: str, path: str, status: int, rid: str, prompt_tokens: int,
               completion_tokens: int, ttft: float | None, duration: float) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if not access_log.isEnabledFor(logging.INFO):
            return
        ttft_text = "-" if ttft is None else f"{ttft * 1000:.1f}ms"
        access_log.info(
            "%s %s %d rid=%s prompt_tokens=%d completion_tokens=%d ttft=%s duration=%.1fms",
            method, path, status, rid or "-", prompt_tokens, completion_tokens, ttft_text,
            duration * 1000,
            extra={"fields": {"method": method, "path": path, "status": status, "rid": rid,
                              "prompt_tokens": prompt_tokens,
                              "completion_tokens": completion_tokens,
                              "ttft_s": ttft, "duration_s": round(duration, 6)}})

    def summary(self, running: int, waiting: int) -> str | None:
        """The summary line for the interval that ends now (None when idle), and a new interval."""
        now = time.monotonic()
        span = max(now - self.since, 1e-9)
        if not (self.requests or running or waiting):
            self.since = now
            return None
        line = (f"{self.requests} requests in {span:.1f}s: prompt {self.prompt_tokens / span:.1f} "
                f"tok/s, generation {self.completion_tokens / span:.1f} tok/s; running {running}, "
                f"waiting {waiting}")
        self.requests = self.prompt_tokens = self.completion_tokens = 0
        self.since = now
        return line


async def log_stats(traffic: Traffic, interval_s: float, load: Callable[[], tuple[int, int]]
                    ) -> None:
    """Log `traffic`'s summary every `interval_s` seconds until cancelled; `load()` gives
    (running, waiting)."""
    while True:
        await asyncio.sleep(interval_s)
        line = traffic.summary(*load())
        if line is not None:
            stats_log.info(line)
