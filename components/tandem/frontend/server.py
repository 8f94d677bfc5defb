"""Serves the frontend's ASGI app over HTTP in the caller's event loop (run it under `uvloop.run`),
so the app and the worker pool share one loop. Two interchangeable backends, both in-process:

- "uvicorn" (the default): uvicorn's httptools protocol on a socket we bind; everything on the
  Python thread.
- "granian": granian's embedded server; hyper/tokio do the HTTP and the socket writes on a Rust
  thread, so the Python thread spends less per streamed token. granian's docs still call embedded
  mode experimental.

Chosen by measurement (perf/results/http_servers*.md in isolation, ttft_by_http_server.md end to
end): granian spends less on the Python thread, but end to end on a small machine its Rust threads
compete for the same cores, and uvicorn streamed more tokens per CPU-µs. Throughput per CPU-µs is
what this project optimises, so uvicorn is the default; `--http-server granian` switches. Both backends pass the same live tests (tests/unit/test_frontend_server.py: streaming,
disconnect, drain, a client that does not read). The app is plain ASGI 3.

Shutdown is graceful on both: new requests get 503 and /health turns 503, in-flight requests get
`DRAIN_TIMEOUT_S` to finish (`FrontendApp.drain`), then they are cancelled — which aborts them on
the workers — and the listener closes. Access logs are off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from typing import Protocol

from tandem.frontend.app import FrontendApp, Pool
from tandem.frontend.limits import HttpLimits, raise_fd_limit
from tandem.frontend.uvicorn_protocol import guarded_protocol
from tandem.frontend.preprocess import Preprocessor
from tandem.config import DRAIN_TIMEOUT_S, FrontendConfig
from tandem.config import HttpServer as HttpServerName

Backend = HttpServerName  # (config's `--http-server` choices)
_START_TIMEOUT_S = 10.0

log = logging.getLogger("tandem.frontend")


class HttpServer(Protocol):
    app: FrontendApp

    @property
    def port(self) -> int: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening-ready socket; `reuse_port`: SO_REUSEPORT, so that several frontend processes
    bind the same port and the kernel spreads connections among them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


class UvicornServer:
    """The app on uvicorn's httptools protocol. `await start()`, then `port`; `await stop()`."""

    def __init__(self, app: FrontendApp, host: str, port: int,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, reuse_port: bool = False,
                 limits: HttpLimits | None = None):
        import uvicorn

        self.app = app
        self.host = host
        self.drain_timeout_s = drain_timeout_s
        self.reuse_port = reuse_port
        self._requested_port = port
        lim = limits or HttpLimits.of(app.config)  # connection caps, head/idle deadlines
        lim = dataclasses.replace(lim, max_connections=raise_fd_limit(lim.max_connections))
        self.protocol = guarded_protocol(lim)
        self._config = uvicorn.Config(
            app, http=self.protocol, ws="none", loop="none", lifespan="off",
            interface="asgi3", access_log=False, log_level="warning", server_header=False,
            timeout_graceful_shutdown=1, timeout_keep_alive=max(1, round(lim.idle_timeout_s)),
            backlog=4096)
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self._port = 0
        self._tick: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        import uvicorn

        config = self._config
        if not config.loaded:
            config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        self._sock = _bind(self.host, self._requested_port, self.reuse_port)
        self._port = int(self._sock.getsockname()[1])
        await server.startup(sockets=[self._sock])
        self._server = server
        self._tick = asyncio.create_task(server.main_loop(), name="uvicorn-tick")

    async def stop(self) -> None:
        server, tick = self._server, self._tick
        if server is None or tick is None:
            return
        self._server = None
        await self.app.drain(self.drain_timeout_s)
        server.should_exit = True
        await tick
        await server.shutdown(sockets=[self._sock] if self._sock else None)
        self._sock = None


class GranianServer:
    """The app on granian's embedded server, in this event loop."""

    def __init__(self, app: FrontendApp, host: str, port: int,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S):
        self.app = app
        self.host = host
        self.drain_timeout_s = drain_timeout_s
        self._port = port
        self._server: object | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> None:
        from granian.constants import Interfaces
        from granian.server.embed import Server

        logging.getLogger("_granian").setLevel(logging.ERROR)  # "embedded is experimental"
        # granian binds its own socket and cannot report the port or a failed bind before it
        # is serving: bind here first, so a port in use fails loudly and port 0 gets a number.
        with _bind(self.host, self._port) as probe:
            self._port = int(probe.getsockname()[1])
        server = Server(self.app, address=self.host, port=self._port,
                        interface=Interfaces.ASGINL, websockets=False, log_enabled=False,
                        backlog=4096, backpressure=65536)
        self._server = server
        self._task = asyncio.create_task(server.serve(), name="granian")
        try:
            await self._wait_listening()
        except BaseException:
            self._server = None
            server.stop()
            await asyncio.gather(self._task, return_exceptions=True)
            raise

    async def _wait_listening(self) -> None:
        task = self._task
        assert task is not None
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _START_TIMEOUT_S
        while not task.done():
            try:
                _, writer = await asyncio.open_connection(host, self._port)
                writer.close()
                await asyncio.sleep(0.05)  # a failed start ends the task at once
                if not task.done():
                    return
            except OSError:
                if loop.time() > deadline:
                    raise RuntimeError(f"granian did not listen on {host}:{self._port}") from None
                await asyncio.sleep(0.02)
        task.result()
        raise RuntimeError("granian stopped while starting")

    async def stop(self) -> None:
        server, task = self._server, self._task
        if server is None or task is None:
            return
        self._server = None
        await self.app.drain(self.drain_timeout_s)
        server.stop()  # type: ignore[attr-defined]
        await task


def make_server(app: FrontendApp, host: str, port: int, backend: Backend,
                drain_timeout_s: float = DRAIN_TIMEOUT_S, reuse_port: bool = False,
                limits: HttpLimits | None = None) -> HttpServer:
    if backend == "granian":
        if reuse_port:  # granian's embedded server binds its own socket, without SO_REUSEPORT
            raise ValueError("--reuse-port needs --http-server uvicorn")
        return GranianServer(app, host, port, drain_timeout_s)
    if backend == "uvicorn":
        return UvicornServer(app, host, port, drain_timeout_s, reuse_port, limits)
    raise ValueError(f"unknown HTTP backend {backend!r}")


async def serve(config: FrontendConfig, pool: Pool, stop: asyncio.Event, *,
                preprocessor: Preprocessor | None = None) -> None:
    """Serve the OpenAI API for `pool` on `config.host:config.port` until `stop` is set (by
    tandem.runtime.lifecycle.run, on SIGTERM/SIGINT); then drain and return."""
    app = FrontendApp(config, pool, preprocessor or Preprocessor.from_config(config))
    backend = config.http_server
    server = make_server(app, config.host, config.port, backend, config.drain_timeout_s,
                         config.reuse_port, HttpLimits.of(config))
    try:
        await server.start()
        log.info("serving %s on http://%s:%d (%s)", app.model_name, config.host, server.port,
                 backend)
        await stop.wait()
    finally:
        await server.stop()
