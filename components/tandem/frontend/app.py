"""The HTTP app: a framework-free ASGI 3 application serving the OpenAI API in front of a worker pool.

Endpoints: POST /v1/chat/completions and /v1/completions (SSE or JSON; a session header or the
`user` field is the router's conversation key), GET /v1/models and /v1/models/{id}, POST /tokenize
and /detokenize (vLLM's shapes), /health, /metrics (Prometheus, one registry shared with the pool)
and /workers (the pool's snapshot; an admin endpoint, tandem.frontend.admin). Every error is an
OpenAI error body.

A request's body becomes a GenerationJob (or a /tokenize answer) in tandem.frontend.prepare, off
the loop when it is large. Every request ends with one access line, and a summary line is logged every `--log-stats-interval` seconds
(tandem.frontend.access).

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
from tandem.frontend import admin, apikeys, schemas
from tandem.frontend.salt import Salter
from tandem.frontend.access import Traffic, log_stats
from tandem.frontend.http import (JSON, ClientGone, MethodNotAllowed, Receive, ResponseWriter, Scope,
                                  Send, content_length, lifespan, read_body, session_of,
                                  watch_disconnect)
from tandem.frontend.limits import BodyBudget
from tandem.frontend.tenants import tenant_of
from tandem.runtime import timeline
from tandem.runtime.auth import digest_key
from tandem.frontend.uvicorn_protocol import EXTENSIONS
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.prepare import Prepare
from tandem.frontend.respond import GenerationJob, Handle, new_pushes, respond
from tandem.runtime import errors, lifecycle
from tandem.runtime.metrics import CONTENT_TYPE, Registry
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

    def open(self, prompt_ids: list[int], sampling: SamplingParams, session: str = "",
             tenant: str = "", priority: int = 0, salt: str = "") -> Handle: ...


class FrontendApp:
    """ASGI 3 app. `FrontendApp(config, pool, Preprocessor.from_config(config))`; its metrics go
    in the pool's registry unless another is given."""

    def __init__(self, config: FrontendConfig, pool: Pool, preprocessor: Preprocessor,
                 max_body_bytes: int = MAX_BODY_BYTES, registry: Registry | None = None):
        self.config = config
        self.admin = admin.Gate(admin.read_token(config.admin_token_file))
        self.api_keys = apikeys.ApiKeys(apikeys.read_keys(config.api_key_file))
        self.pool = pool
        self.preprocessor = preprocessor
        self.model_name = preprocessor.model_name
        # Bodies being received, over all connections, share one budget; a body larger than the
        # whole budget could never be taken, so that is its size cap too (413, not 503).
        self.bodies = BodyBudget(config.max_body_bytes_in_flight)
        self.max_body_bytes = min(max_body_bytes, self.bodies.limit)
        self.body_timeout_s = config.http_body_timeout_s
        self.registry = registry if registry is not None else pool.registry
        self.registry.add_process_metrics()
        self.metrics = FrontendMetrics(self.registry, self.model_name)
        self.pushes = new_pushes()  # every response's deltas handled at a loop pass's end
        self.metrics.load_gauges(lambda: max(0, len(self._work) - self._queued()), self._queued)
        self.metrics.kv_usage(self._kv_usage)
        self.draining = False  # set on shutdown: /health says 503 and new requests are refused
        self._work: set[asyncio.Task[None]] = set()  # in-flight generation requests
        self.prepare = Prepare(config, preprocessor, self._max_context, lambda: pool.max_context)
        self.digest_key = digest_key(config.auth_keys)  # (keys tenants' and salts' digests)
        self.salter = Salter(config.cache_salt_by, self.digest_key)
        self.created = int(time.time())
        self.traffic = Traffic()
        self._stats: asyncio.Task[None] | None = None  # the summary logger, started on use
        self._get: dict[str, Callable[[ResponseWriter], Awaitable[None]]] = {
            "/v1/models": self._models, "/health": self._health, "/live": self._live,
            "/metrics": self._metrics, "/workers": self._workers,
        }
        self._post = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
        self._post_small: dict[str, Callable[[bytes], Awaitable[bytes]]] = {
            "/tokenize": self.prepare.tokenize, "/detokenize": self.prepare.detokenize}

    def _queued(self) -> int:
        return int(getattr(self.pool, "num_queued", 0))

    def _kv_usage(self) -> list[tuple[tuple[str], float]]:
        out: list[tuple[tuple[str], float]] = []
        for w in getattr(self.pool, "links", ()):
            load = getattr(w, "load", None)
            total = getattr(load, "pages_total", 0)
            if total:
                out.append(((w.address,), 1.0 - load.pages_free / total))  # type: ignore[union-attr]
        return out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        ext = scope.get("extensions")
        ex = ResponseWriter(send, ext.get(EXTENSIONS) if ext else None)
        t0 = time.monotonic()
        if self._stats is None and self.config.log_stats_interval_s > 0 and not self.draining:
            self._stats = asyncio.ensure_future(log_stats(
                self.traffic, self.config.log_stats_interval_s,
                lambda: (max(0, len(self._work) - self._queued()), self._queued())))
        try:
            refused = self.api_keys.refusal(path, scope)
            kind = self._post.get(path)
            if kind is not None and method == "POST" and refused is None:
                job = await self._generation(kind, scope, receive, ex, t0)
                self.traffic.record(method, path, ex.status or 499, job.rid if job else "",
                                    job.prompt_tokens if job else 0,
                                    job.completion_tokens if job else 0,
                                    job.ttft if job else None, time.monotonic() - t0)
                return
            handler = self._get.get(path)
            small = self._post_small.get(path)
            endpoint = path if handler or small or kind else "other"
            if refused is not None:
                await ex.error(refused)
            elif handler is not None and method in ("GET", "HEAD"):
                await self.admin.serve(path, scope, ex, handler)
            elif small is not None and method == "POST":
                await self._small(small, scope, receive, ex)
            elif path.startswith("/v1/models/") and method in ("GET", "HEAD"):
                endpoint = "/v1/models/{id}"
                await self._model(path[len("/v1/models/"):], ex)
            elif handler is not None or kind is not None or small is not None:
                await ex.error(MethodNotAllowed(f"Method {method} is not allowed on {path}."))
            else:
                await ex.error(errors.NotFound(f"No route for {method} {path}."))
            self.metrics.requests.labels(endpoint, str(ex.status)).inc()
            if endpoint not in ("/metrics", "/health", "/live"):  # probes, scrapes: not traffic
                self.traffic.record(method, path, ex.status, "", 0, 0, None,
                                    time.monotonic() - t0)
        except ClientGone:
            pass

    # --- generation -------------------------------------------------------------------------------

    async def _generation(self, kind: str, scope: Scope, receive: Receive, ex: ResponseWriter,
                          t0: float) -> GenerationJob | None:
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        m = self.metrics
        try:
            if self.draining:
                raise errors.Unavailable("The server is shutting down.", retry_after=1)
            job = await self.prepare.job(kind, await self._body(scope, receive), t0)
            session = session_of(scope, job.user)
            tenant = tenant_of(scope, job.user, self.config.tenant_by, self.digest_key)
            salt = self.salter(scope["headers"], job.user, job.cache_salt)
            handles = [self.pool.open(c.prompt_ids, c.sampling, session, tenant, job.priority,
                                      salt)
                       for c in job.choices]
        except errors.TandemError as e:  # refused before anything was sent to a worker
            m.error(e.type)
            await ex.error(e)
            m.requests.labels(endpoint, str(ex.status)).inc()
            return None
        # Placed here when a worker can take it now: its Generate leaves with this loop pass's
        # others, one pass sooner than if the response task placed it when it first runs (that
        # task enters what is not placed: a request that must wait in line waits there).
        if timeline.ON:
            for h in handles:
                timeline.mark("arrive", h.rid, tenant or "-", f"{t0:.6f}")
        for h in handles:
            h.enter_now()
        work = lifecycle.running_loop().create_task(self._respond(job, handles, receive, ex))
        self._work.add(work)
        work.add_done_callback(self._work.discard)
        try:
            await work
        except ClientGone:
            pass
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # this exchange was cancelled: go on
                raise
            # (else `drain` cancelled the response alone: it is over)
        finally:
            if not work.done():  # (this exchange was cancelled while the response ran)
                work.cancel()
                await asyncio.wait((work,))
            for h in handles:  # (a response cancelled before it ran did not leave them)
                h.release()
            m.requests.labels(endpoint, str(ex.status) if ex.status else "499").inc()
            m.e2e.observe(time.monotonic() - t0)
        return job

    def _body(self, scope: Scope, receive: Receive) -> Awaitable[bytes]:
        """The request's body, within the server's body limits (tandem.frontend.http read_body:
        its size cap, its deadline, the budget of bodies being received)."""
        return read_body(receive, self.max_body_bytes, self.body_timeout_s, self.bodies,
                         content_length(scope))

    async def _respond(self, job: GenerationJob, handles: list[Handle], receive: Receive,
                       ex: ResponseWriter) -> None:
        async with watch_disconnect(receive, ex):
            await respond(job, handles, ex, self.metrics, self.pushes)

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
        if self._stats is not None:
            self._stats.cancel()
        left = await lifecycle.drain(self._work, timeout_s)
        if left:
            log.warning("drain: cancelled %d request(s) still running after %.1fs", left,
                        timeout_s)

    # --- the small endpoints ----------------------------------------------------------------------

    def _card(self) -> schemas.ModelCard:
        return schemas.ModelCard(self.model_name, "model", self.created, "tandem",
                             self.config.model or self.model_name, self.pool.max_context)

    async def _models(self, ex: ResponseWriter) -> None:
        await ex.reply(200, _encode(schemas.ModelList("list", [self._card()])), JSON)

    async def _model(self, model_id: str, ex: ResponseWriter) -> None:
        if model_id != self.model_name:
            await ex.error(errors.ModelNotFound(
                f"The model `{model_id}` does not exist or you do not have access to it.",
                param="model"))
            return
        await ex.reply(200, _encode(self._card()), JSON)

    async def _small(self, handler: Callable[[bytes], Awaitable[bytes]], scope: Scope,
                     receive: Receive, ex: ResponseWriter) -> None:
        try:
            body = await handler(await self._body(scope, receive))
        except errors.TandemError as e:
            await ex.error(e)
            return
        await ex.reply(200, body, JSON)

    async def _health(self, ex: ResponseWriter) -> None:
        if self.pool.ready() and not self.draining:
            await ex.reply(200, b'{"status":"ready"}', JSON)
        else:
            status = b"draining" if self.draining else b"unavailable"
            await ex.reply(503, b'{"status":"' + status + b'"}', JSON)

    async def _live(self, ex: ResponseWriter) -> None:
        """Liveness: the process answers (whatever its workers; /health is readiness)."""
        await ex.reply(200, b'{"status":"live"}', JSON)

    async def _metrics(self, ex: ResponseWriter) -> None:
        await ex.reply(200, self.registry.render().encode(), CONTENT_TYPE)

    async def _workers(self, ex: ResponseWriter) -> None:
        await ex.reply(200, _encode({"workers": await self.pool.snapshot()}), JSON)


