"""The HTTP app: a framework-free ASGI 3 application serving the OpenAI API in front of a worker pool.

Endpoints: POST /v1/chat/completions and /v1/completions (SSE or JSON), GET /v1/models, /health,
/metrics (Prometheus text, one registry shared with the pool) and /workers (the pool's snapshot).

A generation request is validated, templated and tokenized before anything is sent, then opened on
the pool (one request handle per choice) and answered by tandem.frontend.respond. Each request runs
in a task the app owns (so `drain` can wait for it, then cancel it) inside a disconnect watcher: a
client that goes away (seen by the watcher, or by a failed write) makes the response leave its
request handles at once, which aborts them on the workers and frees their pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from tandem.config import FrontendConfig
from tandem.frontend import openai_api as api
from tandem.frontend.http import (JSON, ClientGone, MethodNotAllowed, Receive, ResponseWriter,
                                  Scope, Send, read_body, watch_disconnect)
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.respond import ChoiceSpec, GenerationJob, Handle, respond
from tandem.runtime import errors, lifecycle
from tandem.runtime.metrics import Registry
from tandem.runtime.wire import SamplingParams

log = logging.getLogger("tandem.frontend")
MAX_BODY_BYTES = 32 * 1024 * 1024
_encode = msgspec.json.Encoder().encode


class Pool(Protocol):
    """The part of tandem.router.pool.WorkerPool the frontend uses."""

    @property
    def registry(self) -> Registry: ...

    @property
    def max_context(self) -> int | None: ...

    def ready(self) -> bool: ...

    async def snapshot(self) -> list[dict[str, Any]]: ...

    def open(self, prompt_ids: list[int], sampling: SamplingParams) -> Handle: ...


class FrontendApp:
    """ASGI 3 app. `FrontendApp(config, pool, Preprocessor.from_config(config))`; its metrics go
    in the pool's registry unless another is given."""

    def __init__(self, config: FrontendConfig, pool: Pool, preprocessor: Preprocessor,
                 max_body_bytes: int = MAX_BODY_BYTES, registry: Registry | None = None):
        self.config = config
        self.pool = pool
        self.preprocessor = preprocessor
        self.model_name = preprocessor.model_name
        self.max_body_bytes = max_body_bytes
        self.registry = registry if registry is not None else pool.registry
        self.metrics = FrontendMetrics(self.registry)
        self.draining = False  # set on shutdown: /health says 503 and new requests are refused
        self._work: set[asyncio.Task[None]] = set()  # in-flight generation requests
        self.created = int(time.time())
        self._get: dict[str, Callable[[ResponseWriter], Awaitable[None]]] = {
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
        ex = ResponseWriter(send)
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

    async def _generation(self, kind: str, receive: Receive, ex: ResponseWriter) -> None:
        t0 = time.monotonic()
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        m = self.metrics
        try:
            body = await read_body(receive, self.max_body_bytes)
            job = self._prepare(kind, body, t0)
            handles = [self.pool.open(c.prompt_ids, c.sampling) for c in job.choices]
        except errors.TandemError as e:  # refused before anything was sent to a worker
            m.errors.labels(e.type).inc()
            await ex.error(e)
            m.requests.labels(endpoint, str(ex.status)).inc()
            return
        m.in_flight.inc()
        work = asyncio.ensure_future(self._respond(job, handles, receive, ex))
        self._work.add(work)
        work.add_done_callback(self._work.discard)
        try:
            await asyncio.wait((work,))
        finally:
            work.cancel()
            await asyncio.wait((work,))
            m.in_flight.dec()
            m.requests.labels(endpoint, str(ex.status) if ex.status else "499").inc()
            m.e2e.observe(time.monotonic() - t0)
        if not work.cancelled():
            exc = work.exception()
            if exc is not None and not isinstance(exc, ClientGone):
                raise exc

    async def _respond(self, job: GenerationJob, handles: list[Handle], receive: Receive,
                       ex: ResponseWriter) -> None:
        async with watch_disconnect(receive, ex):
            await respond(job, handles, ex, self.metrics)

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
            max_context = self._max_context()
            prompts = [pre.encode_chat(messages, req.tools, req.chat_template_kwargs)]
        else:
            req = api.decode_request(body, api.CompletionRequest)
            api.check_model(req, self.model_name)
            texts = api.validate_completion(req)
            max_tokens = req.max_tokens
            default_max = self.config.default_max_tokens
            max_context = self._max_context()
            prompts = [pre.encode_prompt(p) for p in texts]
        stops = api.stops_of(req)
        choices: list[ChoiceSpec] = []
        for p, prompt_ids in enumerate(prompts):
            sampling = api.sampling_params(req, max_tokens, len(prompt_ids), max_context,
                                           default_max)
            for i in range(req.n):
                sp = sampling if i == 0 or sampling.seed is None else \
                    msgspec.structs.replace(sampling, seed=sampling.seed + i)
                detok = pre.detokenizers.new(stops, prompt_ids)
                choices.append(ChoiceSpec(p, prompt_ids, sp, detok))
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return GenerationJob(
            kind="chat" if kind == "chat" else "completion", model=self.model_name,
            stream=req.stream, include_usage=include_usage,
            interval=req.stream_interval or self.config.stream_interval, t0=t0, choices=choices)

    def _max_context(self) -> int:
        max_context = self.pool.max_context
        if max_context is None:
            raise errors.Unavailable("No worker is ready yet.", retry_after=1)
        return max_context

    @property
    def num_in_flight(self) -> int:
        return len(self._work)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, give in-flight ones `timeout_s` to finish, then cancel the rest
        (leaving their request handles aborts them on the workers)."""
        self.draining = True
        left = await lifecycle.drain(self._work, timeout_s)
        if left:
            log.warning("drain: cancelled %d request(s) still running after %.1fs", left,
                        timeout_s)

    # --- the small endpoints ----------------------------------------------------------------------

    async def _models(self, ex: ResponseWriter) -> None:
        card = api.ModelCard(self.model_name, "model", self.created, "tandem",
                             self.config.model or self.model_name, self.pool.max_context)
        await ex.reply(200, _encode(api.ModelList("list", [card])), JSON)

    async def _health(self, ex: ResponseWriter) -> None:
        if self.pool.ready() and not self.draining:
            await ex.reply(200, b'{"status":"ready"}', JSON)
        else:
            status = b"draining" if self.draining else b"unavailable"
            await ex.reply(503, b'{"status":"' + status + b'"}', JSON)

    async def _metrics(self, ex: ResponseWriter) -> None:
        text = self.registry.render()
        await ex.reply(200, text.encode(), b"text/plain; version=0.0.4; charset=utf-8")

    async def _workers(self, ex: ResponseWriter) -> None:
        await ex.reply(200, _encode({"workers": await self.pool.snapshot()}), JSON)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
