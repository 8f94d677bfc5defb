"""A cheap streaming HTTP/1.1 client for load generation: raw asyncio streams, one keep-alive
connection per concurrency slot, and almost no work per network read (a timestamp and a count of
`data: ` markers). The body is kept as bytes and parsed once, when the stream ends, to verify it:
`data: [DONE]` last, no error event, a finish reason, and usage present.

Latency as the client sees it: TTFT is from writing the request to the first read that carries an
SSE event; each later read carrying events adds one inter-token gap (per read, not per token: when
the server coalesces, one read carries several chunks).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

_decode = msgspec.json.decode
_END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked body


@dataclass(slots=True)
class StreamResult:
    status: int = 0
    error: str = ""  # why the stream is not valid ("" = valid)
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0  # from usage
    prompt_tokens: int = 0
    cached_tokens: int = 0  # from usage.prompt_tokens_details
    content_chunks: int = 0  # chunks carrying non-empty text
    finish_reason: str = ""
    text: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def dechunk(raw: bytes, partial: bool = False) -> bytes:
    """A chunked body's payload; `partial`: what complete chunks there are (a stream the client
    left), else ValueError when it is cut short."""
    out: list[bytes] = []
    pos = 0
    while True:
        eol = raw.find(b"\r\n", pos)
        if eol < 0:
            if partial:
                return b"".join(out)
            raise ValueError("truncated chunked body")
        size = int(raw[pos:eol].split(b";", 1)[0], 16)
        if size == 0:
            return b"".join(out)
        if eol + 2 + size > len(raw):
            if partial:
                return b"".join(out)
            raise ValueError("truncated chunk")
        out.append(raw[eol + 2:eol + 2 + size])
        pos = eol + 2 + size + 2


def verify_sse(body: bytes, res: StreamResult) -> None:
    """Fill `res` from a whole SSE body; sets `res.error` when the stream is not complete."""
    events = [e for e in body.split(b"\n\n") if e.strip()]
    if not events or events[-1].strip() != b"data: [DONE]":
        res.error = "no [DONE] at the end"
        return
    texts: list[str] = []
    usage = None
    for ev in events[:-1]:
        if not ev.startswith(b"data: "):
            res.error = f"not an SSE data event: {ev[:80]!r}"
            return
        obj = _decode(ev[6:])
        if "error" in obj:
            res.error = f"error event: {obj['error'].get('message', '')[:200]}"
            return
        if obj.get("usage"):
            usage = obj["usage"]
        for c in obj.get("choices") or ():
            t = c.get("text")
            if t is None:
                t = (c.get("delta") or {}).get("content")
            if t:
                texts.append(t)
                res.content_chunks += 1
            if c.get("finish_reason"):
                res.finish_reason = c["finish_reason"]
    if usage is None:
        res.error = "no usage chunk (stream_options.include_usage)"
        return
    res.completion_tokens = int(usage["completion_tokens"])
    res.prompt_tokens = int(usage["prompt_tokens"])
    res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    res.text = "".join(texts)
    if not res.finish_reason:
        res.error = "no finish_reason"


class Connection:
    """One keep-alive HTTP/1.1 connection; streams one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        w, self._writer, self._reader = self._writer, None, None
        if w is not None:
            w.close()
            try:
                await w.wait_closed()
            except OSError:
                pass

    async def post_stream(self, path: str, body: bytes, timeout_s: float = 120.0,
                          headers: bytes = b"") -> StreamResult:
        """`headers`: more request header lines, each ending in CRLF (b"X-Session-ID: 7\r\n")."""
        res = StreamResult()
        try:
            await asyncio.wait_for(self._post(path, body, res, headers), timeout_s)
        except TimeoutError:
            res.error = f"timed out after {timeout_s:.0f}s"
            await self.close()
        except (OSError, asyncio.IncompleteReadError, ValueError, KeyError, TypeError,
                AttributeError) as e:  # a malformed answer fails this stream, not the run
            res.error = f"{type(e).__name__}: {e}"[:200]
            await self.close()
        return res

    async def send(self, path: str, body: bytes, headers: bytes = b"") -> tuple[
            asyncio.StreamReader, bytes, int, dict[bytes, bytes]]:
        """POST `body` (JSON) on this connection (opened if need be); its reader, and the answer's
        head, status and headers (names and values lower-cased)."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"%sContent-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(),
                                                            headers, len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip().lower()
        return reader, head, int(lines[0].split(b" ", 2)[1]), headers

    async def _post(self, path: str, body: bytes, res: StreamResult, extra: bytes = b"") -> None:
        t0 = time.monotonic()
        reader, head, res.status, headers = await self.send(path, body, extra)
        if b"content-length" in headers:
            data = await reader.readexactly(int(headers[b"content-length"]))
            res.error = f"HTTP {res.status}: {data[:200]!r}"
            if headers.get(b"connection") == b"close":
                await self.close()
            return
        if headers.get(b"transfer-encoding") != b"chunked":
            raise ValueError(f"neither content-length nor chunked: {head!r}")
        parts: list[bytes] = []
        gaps = res.gaps_s
        last = 0.0
        tail = b""
        while True:
            data = await reader.read(65536)
            if not data:
                raise ValueError("connection closed mid-stream")
            parts.append(data)
            if b"data: " in data:
                now = time.monotonic()
                if last:
                    gaps.append(now - last)
                else:
                    res.ttft_s = now - t0
                last = now
            tail = (tail + data)[-len(_END):]
            if tail == _END:
                break
        if res.status != 200:
            res.error = f"HTTP {res.status}"
            return
        verify_sse(dechunk(b"".join(parts)), res)
