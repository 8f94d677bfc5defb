"""A small blocking SSE client for tests: every read has a deadline, so a hung stream fails."""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass, field


@dataclass
class StreamResult:
    status: int
    events: list[dict] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    body: dict | None = None  # the JSON body of a non-200 answer

    @property
    def error(self) -> dict | None:
        for e in self.events:
            if "error" in e:
                return e["error"]
        return self.body.get("error") if self.body else None

    @property
    def text(self) -> str:
        out = []
        for e in self.events:
            for c in e.get("choices", []):
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        return "".join(out)

    @property
    def finish_reason(self) -> str | None:
        for e in self.events:
            for c in e.get("choices", []):
                if c.get("finish_reason"):
                    return c["finish_reason"]
        return None


class Stream:
    """Open a streamed POST; read events one at a time; close at will (a client going away)."""

    def __init__(self, url: str, path: str, body: dict, timeout: float = 30.0,
                 wait: bool = True) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        self.conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        if wait:
            self.start()

    def start(self) -> None:
        """Wait for the response head (the frontend sends it with the first token)."""
        self.resp = self.conn.getresponse()
        self.result = StreamResult(self.resp.status)
        if self.resp.status != 200:
            self.result.body = json.loads(self.resp.read() or b"{}")

    def next_event(self) -> dict | None:
        """The next data event, or None at [DONE] / end of stream."""
        if self.result.status != 200:
            return None
        while True:
            line = self.resp.readline()
            if not line:
                return None
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                self.result.done = True
                return None
            ev = json.loads(line[6:])
            self.result.events.append(ev)
            return ev

    def read_all(self) -> StreamResult:
        while self.next_event() is not None:
            pass
        self.close()
        return self.result

    def close(self) -> None:
        if self.conn.sock is not None:
            self.conn.sock.close()
        self.conn.close()


def completion(url: str, body: dict, timeout: float = 30.0) -> StreamResult:
    return Stream(url, "/v1/completions", {**body, "stream": True}, timeout).read_all()
