"""The HTTP app: a framework-free ASGI 3 application serving the OpenAI API in front of a worker pool.

Endpoints: POST /v1/chat/completions and /v1/completions (SSE or JSON), GET /v1/models, /health,
/metrics (Prometheus text) and /workers (the pool's snapshot).

A generation request is validated, templated and tokenized before anything is sent; the response
headers wait for the first delta, so an error before the first token still gets its own status
(Unavailable with `Retry-After`). After that, errors become a `data: {"error": ...}` event, then
`data: [DONE]`. Each request runs in a task of its own beside a watcher of `http.disconnect`; a
client that goes away (seen by the watcher, or by a failed write) makes the request leave its
`RequestStream` context at once, which aborts it on the worker and frees its pages. A request with
several choices (prompts and/or n > 1) runs in tandem.frontend.choices.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from tandem.frontend import openai_api as api
from tandem.frontend.choices import run_choices
from tandem.frontend.generate import (ChoiceSpec, ClientGone, Exchange, FrontendMetrics,
                                      GenerationJob, Pool, run_generation)
from tandem.frontend.preprocess import Preprocessor
from tandem.runtime import errors
from tandem.config import FrontendConfig
from tandem.runtime.wire import WorkerInfo

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("tandem.frontend")
MAX_BODY_BYTES = 32 * 1024 * 1024
_JSON = b"application/json"
_encode = msgspec.json.Encoder().encode


class PayloadTooLarge(errors.TandemError):
    status = 413
    type = "invalid_request_error"


class MethodNotAllowed(errors.TandemError):
    status = 405
    type = "invalid_request_error"


class FrontendApp:
    """ASGI 3 app. `FrontendApp(config, pool, Preprocessor.from_config(config))`."""

    def __init__(self, config: FrontendConfig, pool: Pool, preprocessor: Preprocessor,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.config = config
        self.pool = pool
        self.preprocessor = preprocessor
        self.model_name = preprocessor.model_name
        self.max_body_bytes = max_body_bytes
        self.metrics = FrontendMetrics()
        self.draining = False  # set on shutdown: /health says 503 and new requests are refused
        self._work: set[asyncio.Task[None]] = set()  # in-flight generation requests
        self.created = int(time.time())
        self._get: dict[str, Callable[[Exchange], Awaitable[None]]] = {
            "/v1/models": self._models, "/health": self._health, "/metrics": self._metrics,
            "/workers": self._workers,
        }
        self._post = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await _lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        ex = Exchange(send)
        try:
            kind = self._post.get(path)
            if kind is not None and method == "POST":
                await self._generation(kind, receive, ex)
                return
            handler = self._get.get(path)
            if handler is not None and method in ("GET", "HEAD"):
                await handler(ex)
            elif handler is not None or kind is not None:
                await ex.error(MethodNotAllowed(f"Method {method} is not allowed on {path}."))
            else:
                await ex.error(errors.NotFound(f"No route for {method} {path}."))
            self.metrics.requests.labels(path if handler else "other", str(ex.status)).inc()
        except ClientGone:
            pass

    # --- generation -------------------------------------------------------------------------------

    async def _generation(self, kind: str, receive: Receive, ex: Exchange) -> None:
        t0 = time.monotonic()
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        m = self.metrics
        try:
            body = await self._read_body(receive)
            job = self._prepare(kind, body, t0)
        except errors.TandemError as e:
            m.errors.labels(e.type).inc()
            await ex.error(e)
            m.requests.labels(endpoint, str(ex.status)).inc()
            return
        m.in_flight.inc()
        try:
            run = run_choices if job.choices else run_generation
            await _watched(receive, ex, run(self.pool, job, ex, m), self._work)
        except errors.TandemError as e:  # refused on entering the stream (router queue full...)
            if ex.started:
                raise
            m.errors.labels(e.type).inc()
            await ex.error(e)
        finally:
            m.in_flight.dec()
            m.requests.labels(endpoint, str(ex.status) if ex.status else "499").inc()
            m.e2e.observe(time.monotonic() - t0)

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            data = msg.get("body", b"")
            size += len(data)
            if size > self.max_body_bytes:
                raise PayloadTooLarge(f"Request body is larger than {self.max_body_bytes} bytes.")
            chunks.append(data)
            if not msg.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _prepare(self, kind: str, body: bytes, t0: float) -> GenerationJob:
        """Validate, template, tokenize and size one request; every refusal raises."""
        if self.draining:
            raise errors.Unavailable("The server is shutting down.", retry_after=1)
        pre = self.preprocessor
        req: api.ChatCompletionRequest | api.CompletionRequest
        if kind == "chat":
            req = api.decode_request(body, api.ChatCompletionRequest)
            api.check_model(req, self.model_name)
            messages = api.validate_chat(req)
            max_tokens = api.chat_max_tokens(req)
            default_max: int | None = None  # vLLM: the rest of the context
            info = self._info()
            prompts = [pre.encode_chat(messages, req.tools, req.chat_template_kwargs)]
        else:
            req = api.decode_request(body, api.CompletionRequest)
            api.check_model(req, self.model_name)
            texts = api.validate_completion(req)
            max_tokens = req.max_tokens
            default_max = self.config.default_max_tokens
            info = self._info()
            prompts = [pre.encode_prompt(p) for p in texts]
        stops = api.stops_of(req)
        choices: list[ChoiceSpec] = []
        for p, prompt_ids in enumerate(prompts):
            sampling = api.sampling_params(req, max_tokens, len(prompt_ids), info.max_context,
                                           default_max)
            for i in range(req.n):
                sp = sampling if i == 0 or sampling.seed is None else \
                    msgspec.structs.replace(sampling, seed=sampling.seed + i)
                detok = pre.detokenizers.new(stops, prompt_ids)
                choices.append(ChoiceSpec(p, prompt_ids, sp, detok))
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        first = choices[0]
        return GenerationJob(
            kind="chat" if kind == "chat" else "completion", model=self.model_name,
            stream=req.stream, include_usage=include_usage,
            interval=req.stream_interval or self.config.stream_interval,
            prompt_ids=first.prompt_ids, sampling=first.sampling, detokenizer=first.detokenizer,
            t0=t0, choices=choices if len(choices) > 1 else [])

    def _info(self) -> WorkerInfo:
        info = self.pool.info
        if info is None:
            raise errors.Unavailable("No worker is ready yet.", retry_after=1)
        return info

    @property
    def num_in_flight(self) -> int:
        return len(self._work)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, give in-flight ones `timeout_s` to finish, then cancel the rest
        (leaving their stream contexts aborts them on the workers)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._work and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._work)
        for task in left:
            task.cancel()
        if left:
            log.warning("drain: cancelled %d request(s) still running after %.1fs", len(left),
                        timeout_s)
            await asyncio.gather(*left, return_exceptions=True)

    # --- the small endpoints ----------------------------------------------------------------------

    async def _models(self, ex: Exchange) -> None:
        info = self.pool.info
        card = api.ModelCard(self.model_name, "model", self.created, "tandem",
                             self.config.model or self.model_name,
                             info.max_context if info is not None else None)
        await ex.reply(200, _encode(api.ModelList("list", [card])), _JSON)

    async def _health(self, ex: Exchange) -> None:
        if self.pool.ready() and not self.draining:
            await ex.reply(200, b'{"status":"ready"}', _JSON)
        else:
            status = b"draining" if self.draining else b"unavailable"
            await ex.reply(503, b'{"status":"' + status + b'"}', _JSON)

    async def _metrics(self, ex: Exchange) -> None:
        text = self.metrics.registry.render() + self.pool.metrics()
        if text and not text.endswith("\n"):
            text += "\n"
        await ex.reply(200, text.encode(), b"text/plain; version=0.0.4; charset=utf-8")

    async def _workers(self, ex: Exchange) -> None:
        await ex.reply(200, _encode({"workers": await self.pool.snapshot()}), _JSON)


async def _watched(receive: Receive, ex: Exchange, work_coro: Awaitable[None],
                   registry: set[asyncio.Task[None]]) -> None:
    """Run one request's work beside a watcher of `http.disconnect`; a disconnect cancels the work
    (its stream context then aborts the request). Both tasks are cancelled and awaited here. The
    work task sits in `registry` while it runs, so `FrontendApp.drain` can cancel it."""
    work = asyncio.ensure_future(work_coro)
    registry.add(work)
    work.add_done_callback(registry.discard)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not work.done() and not ex.finished:
            ex.gone = True
            work.cancel()
        await asyncio.wait((work,))
    finally:
        work.cancel()
        watcher.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    if not work.cancelled():
        exc = work.exception()
        if exc is not None and not isinstance(exc, ClientGone):
            raise exc


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
