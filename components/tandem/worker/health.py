"""A worker's health port: the tiny HTTP/1.1 server orchestrators probe.

This module owns `HealthServer`, built on `asyncio.start_server` (no framework, nothing on the hot
path). It answers:

- `GET /live`   -> 200 while the process's event loop answers at all;
- `GET /health` -> 200 when the `ready()` callable says the worker is ready (engine started,
  sockets bound, not draining), else 503 with a short JSON body saying why;
- `GET /metrics` -> 200 with the `metrics()` callable's Prometheus text, when one was given (the
  worker's protocol-error counters, tandem.worker.metrics);
- any other path -> 404; any method other than GET or HEAD -> 405 (with `Allow`).

Each connection carries one request and is then closed (`Connection: close`): probes open a fresh
connection each time, and a one-shot server holds no idle sockets. A request head larger than
`max_header_bytes` gets 431, one not complete within `read_timeout_s` gets 408, a malformed one
400. `start()` binds (port 0 picks a free port, see `.port`); `close()` stops accepting, ends the
connections in progress and waits for them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from http import HTTPStatus

log = logging.getLogger("tandem.health")

MAX_HEADER_BYTES = 8192
READ_TIMEOUT_S = 5.0

Ready = Callable[[], bool | tuple[bool, str]]
"""`ready()` -> bool, or (bool, reason); the reason goes into the 503 body."""


class HealthServer:
    """See the module docstring. `ready` is called on every `/health` request; keep it cheap."""

    def __init__(self, ready: Ready, host: str = "127.0.0.1", port: int = 0, *,
                 max_header_bytes: int = MAX_HEADER_BYTES,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 metrics: Callable[[], str] | None = None) -> None:
        self.ready = ready
        self.metrics = metrics
        self.host = host
        self._port = port
        self.max_header_bytes = max_header_bytes
        self.read_timeout_s = read_timeout_s
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The bound port (the real one after `start()`, also when 0 was asked for)."""
        return self._port

    @property
    def num_connections(self) -> int:
        """Connections being handled now."""
        return len(self._conns)

    @property
    def serving(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("HealthServer already started")
        self._server = await asyncio.start_server(
            self._on_connection, self.host, self._port, limit=self.max_header_bytes,
            reuse_address=True)
        self._port = int(self._server.sockets[0].getsockname()[1])
        log.info("health port listening on %s:%d", self.host, self._port)

    async def close(self) -> None:
        """Stop accepting, cancel the connections in progress and wait for them. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        conns = list(self._conns)
        for task in conns:
            task.cancel()
        if conns:
            await asyncio.gather(*conns, return_exceptions=True)
        await server.wait_closed()

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- one connection ---------------------------------------------------------------------------

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the peer left, or we are closing
        except Exception:
            log.exception("health request failed")
        finally:
            self._conns.discard(task)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, asyncio.CancelledError):
                pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout_s)
        except TimeoutError:
            return await self._send(writer, HTTPStatus.REQUEST_TIMEOUT, {"error": "read timeout"})
        except asyncio.LimitOverrunError:
            await self._send(writer, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                             {"error": "request head too large"})
            return await self._linger(reader, writer)
        except asyncio.IncompleteReadError:
            return  # closed before a whole request head: nothing to answer
        if len(head) > self.max_header_bytes:
            return await self._send(writer, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                    {"error": "request head too large"})
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
            return await self._send(writer, HTTPStatus.BAD_REQUEST, {"error": "bad request line"})
        method, target, _ = parts
        path = target.split("?", 1)[0]
        served = ("/live", "/health", *(("/metrics",) if self.metrics is not None else ()))
        if path not in served:
            return await self._send(writer, HTTPStatus.NOT_FOUND, {"error": "not found"},
                                    head_only=method == "HEAD")
        if method not in ("GET", "HEAD"):
            return await self._send(writer, HTTPStatus.METHOD_NOT_ALLOWED,
                                    {"error": "method not allowed"}, extra="Allow: GET, HEAD\r\n")
        head_only = method == "HEAD"
        if path == "/metrics" and self.metrics is not None:
            return await self._send_text(writer, self.metrics(), head_only)
        if path == "/live":
            return await self._send(writer, HTTPStatus.OK, {"status": "live"}, head_only=head_only)
        ok, reason = self._check()
        if ok:
            return await self._send(writer, HTTPStatus.OK, {"status": "ready"}, head_only=head_only)
        return await self._send(writer, HTTPStatus.SERVICE_UNAVAILABLE,
                                {"status": "not ready", "reason": reason}, head_only=head_only)

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """After an error answer to a request we did not read whole: half-close, then drain what
        the client still sends (briefly), so closing does not reset the connection under the
        answer before the client has read it."""
        if writer.can_write_eof():
            writer.write_eof()
        try:
            async with asyncio.timeout(min(1.0, self.read_timeout_s)):
                while await reader.read(65536):
                    pass
        except (TimeoutError, ConnectionError):
            pass

    def _check(self) -> tuple[bool, str]:
        try:
            got = self.ready()
        except Exception as exc:  # a broken readiness check means "not ready", never a crash
            log.exception("readiness check failed")
            return False, f"readiness check failed: {type(exc).__name__}"
        if isinstance(got, tuple):
            return bool(got[0]), str(got[1])
        return bool(got), "" if got else "not ready"

    @staticmethod
    async def _send_text(writer: asyncio.StreamWriter, text: str, head_only: bool) -> None:
        payload = text.encode()
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                f"Content-Length: {len(payload)}\r\nCache-Control: no-store\r\n"
                f"Connection: close\r\n\r\n")
        writer.write(head.encode("latin-1") + (b"" if head_only else payload))
        await writer.drain()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: HTTPStatus, body: dict[str, str], *,
                    head_only: bool = False, extra: str = "") -> None:
        payload = json.dumps(body, separators=(",", ":")).encode() + b"\n"
        head = (f"HTTP/1.1 {status.value} {status.phrase}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                f"Cache-Control: no-store\r\nConnection: close\r\n{extra}\r\n")
        writer.write(head.encode("latin-1") + (b"" if head_only else payload))
        await writer.drain()
