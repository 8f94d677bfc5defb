"""The client of perf/prefix/bench_prefix.py: one level of sessions (perf.prefix.prefix_workloads) sent open-loop
to an OpenAI-compatible frontend (tandem's or Dynamo's: the same code, the same bytes), and the
level's summary.

Open loop: each session starts at its own arrival time whatever the server is doing (a closed loop
would slow down with the server and hide its queue: coordinated omission); a session's later turns
wait for the previous answer and a think time, as a person does, and append the session's scripted
answer (perf.prefix.prefix_workloads says why not the text sent). Every request streams
/v1/completions with a token-id prompt (exact lengths), `ignore_eos` and `max_tokens`, and
`stream_options.include_usage` (for `usage.prompt_tokens_details.cached_tokens`) and
`continuous_usage_stats` (usage in every chunk: Dynamo's frontend sends no chunk for a token whose
text is empty, and most of its mocker's random tokens decode to empty text with the tiny model's
tokenizer, so without it the first event would come only with the last token). Multi-turn
requests carry their session in `X-Session-ID` (tandem's and the vLLM router's header),
`X-Dynamo-Session-ID` (Dynamo's) and the body's `user`. A request that fails (a 503 included) is
counted, never retried, and ends its session (the rest of its turns are counted as not sent).
Connections are kept alive and reused: a request takes an idle one or opens one.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from perf.common.client import Connection
from perf.common.stats import quantile
from perf.prefix.prefix_workloads import Session


@dataclass(slots=True)
class Rec:
    sid: str
    turn: int
    sent_s: float  # from the level's start
    status: int
    error: str
    ttft_s: float
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # as sent
    cached_tokens: int = 0  # from usage
    completion_tokens: int = 0
    oracle_cached: int = 0
    done_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


async def drive_level(host: str, port: int, model: str, sessions: list[Session],
                      max_tokens: int, timeout_s: float = 120.0) -> tuple[list[Rec], int, float]:
    """Send the level; (every request's record, turns never sent because their session's earlier
    turn failed, the level's wall time from its start to the last answer)."""
    loop = asyncio.get_running_loop()
    idle: list[Connection] = []
    recs: list[Rec] = []
    unsent = 0
    t0 = loop.time()

    async def session(s: Session) -> None:
        nonlocal unsent
        await asyncio.sleep(max(0.0, t0 + s.start_s - loop.time()))
        history: list[int] = []
        multi = len(s.turns) > 1
        for i, add in enumerate(s.turns):
            if i:
                await asyncio.sleep(s.think_s[i - 1])
            prompt = history + add
            body: dict = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                          "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True,
                                             "continuous_usage_stats": True}}
            headers = b""
            if multi:
                body["user"] = s.sid
                headers = b"X-Session-ID: %s\r\nX-Dynamo-Session-ID: %s\r\n" % (
                    s.sid.encode(), s.sid.encode())
            conn = idle.pop() if idle else Connection(host, port)
            sent = loop.time() - t0
            r = await conn.post_stream("/v1/completions", json.dumps(body).encode(), timeout_s,
                                       headers)
            if r.ok and conn._writer is not None:
                idle.append(conn)
            else:
                await conn.close()
            recs.append(Rec(s.sid, i, sent, r.status, r.error, r.ttft_s, r.gaps_s, len(prompt),
                            r.cached_tokens, r.completion_tokens,
                            s.oracle_cached[i] if i < len(s.oracle_cached) else 0,
                            loop.time() - t0))
            if not r.ok:
                unsent += len(s.turns) - i - 1
                return
            history = prompt + (s.answers[i] if i < len(s.answers) else [])

    try:
        await asyncio.gather(*(session(s) for s in sessions))
    finally:
        for c in idle:
            await c.close()
    wall = max((r.done_s for r in recs), default=0.0)
    return recs, unsent, wall


def summarize(recs: list[Rec], unsent: int, wall_s: float) -> dict:
    """One level's figures (latencies in ms; hit rates as fractions; rates per request sent)."""
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft_s * 1e3 for r in ok]
    gaps = [g * 1e3 for r in ok for g in r.gaps_s]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    sent = len(recs)
    rejected = sum(r.status == 503 for r in recs)
    return {
        "requests": sent, "ok": len(ok), "rejected_503": rejected,
        "rate_503": rejected / sent if sent else 0.0,
        "failed_other": sent - len(ok) - rejected, "unsent_turns": unsent,
        "errors": sorted({r.error[:120] for r in recs if r.error})[:3],
        "ttft_p50_ms": quantile(ttft, 0.5), "ttft_p90_ms": quantile(ttft, 0.9),
        "ttft_p99_ms": quantile(ttft, 0.99), "itl_p50_ms": quantile(gaps, 0.5),
        "output_tok_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else 0.0,
        "wall_s": wall_s, "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "oracle_hit_rate": (sum(r.oracle_cached for r in ok) / prompt) if prompt else 0.0,
    }
