"""The soak's HTTP client and what it compares: one keep-alive HTTP/1.1 connection per client slot
(raw asyncio streams, as perf.common.client), a request streamed or not, optionally closed on purpose
after a few SSE events (a client going away mid-stream), and each answer reduced to its
*canonical* form: what must be identical between a fault-free run and any other run of the same
body, whatever the chunking (per choice: text, finish_reason, logprobs entry by entry; usage).
Response ids, `created` and chunk boundaries are left out; everything else the client was given
is in."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec

from perf.common import client

_decode = msgspec.json.decode
_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked body


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it. `error` empty: a complete, well-formed answer (or, for a
    planned disconnect, `disconnect_after` events received before the client closed)."""

    status: int = 0
    error: str = ""
    kind: str = ""  # "" (ok), "connection", "http", "stream-error", "broken", "timeout"
    canonical: Any = None
    events: int = 0
    closed_early: bool = False  # the client disconnected on purpose
    started: float = 0.0
    ended: float = 0.0


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    finish: str | None = None
    logprobs: list[Any] = field(default_factory=list)


def _lp_entries(api: str, lp: Any) -> list[Any]:
    """A choice's logprobs (one chunk's, or a whole body's) as a list of per-token entries."""
    if not lp:
        return []
    if api == "chat":
        return [[e.get("token"), e.get("logprob"), e.get("bytes"),
                 [[t.get("token"), t.get("logprob"), t.get("bytes")]
                  for t in e.get("top_logprobs") or ()]]
                for e in lp.get("content") or ()]
    tokens = lp.get("tokens") or []
    tops = lp.get("top_logprobs") or [None] * len(tokens)
    return [[t, p, sorted((top or {}).items()), off] for t, p, top, off in
            zip(tokens, lp.get("token_logprobs") or [], tops, lp.get("text_offset") or [])]


def _usage(u: Any) -> list[int] | None:
    if not u:
        return None
    return [u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")]


def canonical_body(api: str, body: Any) -> dict:
    """A non-streamed answer's canonical form."""
    choices = {}
    for c in body["choices"]:
        text = (c.get("message") or {}).get("content") if api == "chat" else c.get("text")
        choices[c["index"]] = [text or "", c.get("finish_reason"),
                               _lp_entries(api, c.get("logprobs"))]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": _usage(body.get("usage"))}


def canonical_events(api: str, events: list[Any]) -> dict:
    """A stream's canonical form, from its parsed data events (without [DONE])."""
    choices: dict[int, _Choice] = {}
    usage = None
    for ev in events:
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices") or ():
            ch = choices.setdefault(c["index"], _Choice())
            t = (c.get("delta") or {}).get("content") if api == "chat" else c.get("text")
            if t:
                ch.text.append(t)
            if c.get("finish_reason"):
                ch.finish = c["finish_reason"]
            ch.logprobs.extend(_lp_entries(api, c.get("logprobs")))
    return {"choices": [["".join(ch.text), ch.finish, ch.logprobs]
                        for _, ch in sorted(choices.items())], "usage": _usage(usage)}


def parse_sse(payload: bytes, complete: bool) -> tuple[list[Any], str]:
    """(data events, why the stream is not valid: "" when it is). `complete`: it must end with
    [DONE] and carry no error event."""
    events: list[Any] = []
    done = False
    if not complete:  # a stream the client left: its last event may be cut short
        end = payload.rfind(b"\n\n")
        payload = payload[:end + 2] if end >= 0 else b""
    for raw in payload.split(b"\n\n"):
        raw = raw.strip()
        if not raw:
            continue
        if not raw.startswith(b"data: "):
            return events, f"not an SSE data event: {raw[:80]!r}"
        if raw == b"data: [DONE]":
            done = True
            continue
        ev = _decode(raw[6:])
        if "error" in ev:
            return events, f"error event: {str(ev['error'].get('message', ''))[:200]}"
        events.append(ev)
    if complete and not done:
        return events, "no [DONE] at the end"
    return events, ""


class Connection(client.Connection):
    """One keep-alive connection; one request at a time. Closed after any failure (the next
    request opens a new one)."""

    async def request(self, path: str, api: str, body: bytes, stream: bool,
                      disconnect_after: int = 0, timeout_s: float = 120.0) -> Outcome:
        out = Outcome()
        try:
            await asyncio.wait_for(self._request(path, api, body, stream, disconnect_after, out),
                                   timeout_s)
        except TimeoutError:
            out.error, out.kind = f"timed out after {timeout_s:g}s", "timeout"
        except (ConnectionError, asyncio.IncompleteReadError) as e:  # refused, reset, cut
            out.error, out.kind = f"{type(e).__name__}: {e}"[:200], "connection"
        except (OSError, ValueError, KeyError, TypeError, AttributeError,
                msgspec.DecodeError) as e:
            out.error, out.kind = f"{type(e).__name__}: {e}"[:200], "broken"
        if out.error or out.closed_early:
            await self.close()
        return out

    async def _request(self, path: str, api: str, body: bytes, stream: bool,
                       disconnect_after: int, out: Outcome) -> None:
        reader, head, out.status, headers = await self.send(path, body)
        if b"content-length" in headers:
            data = await reader.readexactly(int(headers[b"content-length"]))
            if headers.get(b"connection") == b"close":
                await self.close()
            if out.status != 200:
                out.error, out.kind = f"HTTP {out.status}: {data[:200]!r}", "http"
            elif stream:
                out.error, out.kind = "a stream answered with a plain body", "broken"
            else:
                out.canonical = canonical_body(api, _decode(data))
            return
        if headers.get(b"transfer-encoding") != b"chunked":
            raise ValueError(f"neither content-length nor chunked: {head[:200]!r}")
        raw = bytearray()
        while True:
            data = await reader.read(65536)
            if not data:
                raise ConnectionResetError("connection closed mid-answer")
            raw += data
            if disconnect_after and raw.count(b"data: ") > disconnect_after:
                events, why = parse_sse(client.dechunk(bytes(raw), partial=True), complete=False)
                out.events, out.closed_early = len(events), True
                if why:
                    out.error, out.kind = why, "stream-error"
                else:
                    out.canonical = canonical_events(api, events)
                return
            if raw.endswith(_END):
                break
        payload = client.dechunk(bytes(raw))
        if out.status != 200:
            out.error, out.kind = f"HTTP {out.status}: {payload[:200]!r}", "http"
            return
        if not stream:
            out.canonical = canonical_body(api, _decode(payload))
            return
        events, why = parse_sse(payload, complete=True)
        out.events = len(events)
        if why:
            out.error, out.kind = why, "stream-error"
            return
        if disconnect_after:  # it ended before the client meant to leave
            out.closed_early = False
        out.canonical = canonical_events(api, events)
