"""WorkerPool: the frontend's view of every worker, and the routing policy that picks them.

Workers announce their role in the handshake. With usable prefill and decode workers a request is
served disaggregated (PDStream: a prefill and a decode worker, a fresh 63-bit room); otherwise by
one aggregated worker. Within a role the workers that can take the request (usable, under the
per-worker limits of RouterConfig, enough free pages in their last report) are offered to the
routing policy (tandem.router.policy). `open()` raises Unavailable (HTTP 503) at once when no
worker (or pair) is usable; otherwise it returns a RoutedStream, which on entry places the request
or waits for capacity in the bounded AdmissionQueue (503 when full or past the deadline).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid

from tandem.router.admission import AdmissionQueue
from tandem.router.client import RequestStream, WorkerClient
from tandem.router.pd import PDStream, bootstrap_of
from tandem.router.policy import make_policy
from tandem.runtime import errors
from tandem.config import DEFAULT_PAGE_SIZE, RETRY_AFTER_S, RouterConfig
from tandem.runtime.wire import Delta, Generate, SamplingParams, WorkerInfo

Placed = RequestStream | PDStream


class RoutedStream:
    """What `open()` returns: entering it waits for a worker (or pair), then it is that stream."""

    __slots__ = ("rid", "prompt_ids", "sampling", "_pool", "_inner")

    def __init__(self, pool: WorkerPool, rid: str, prompt_ids: list[int],
                 sampling: SamplingParams) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self._pool = pool
        self._inner: Placed | None = None

    @property
    def placed(self) -> Placed | None:
        return self._inner

    async def __aenter__(self) -> RoutedStream:
        inner = await self._pool._admission.admit(self)
        try:
            await inner.__aenter__()
        except BaseException:
            inner.release()
            raise
        self._inner = inner
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._inner is not None:
            await self._inner.__aexit__(*exc)

    def __aiter__(self) -> Placed:
        assert self._inner is not None, "enter the stream first"
        return self._inner

    async def __anext__(self) -> Delta:
        return await self.__aiter__().__anext__()


class WorkerPool:
    def __init__(self, addresses: list[str] | tuple[str, ...], frontend_id: str | None = None,
                 router: RouterConfig | None = None) -> None:
        if not addresses:
            raise ValueError("at least one worker address is needed")
        self.frontend_id = frontend_id or f"fe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ident = self.frontend_id.encode()
        self.clients = [WorkerClient(a, ident) for a in addresses]
        self.router = router or RouterConfig()
        self.policy = make_policy(self.router.policy, [c.address for c in self.clients],
                                  self.router.prefix_cache_blocks)
        self._admission: AdmissionQueue[RoutedStream, Placed] = AdmissionQueue(
            self._place, lambda placed: placed.release(), self.router.max_queue,
            self.router.queue_timeout_s, RETRY_AFTER_S)
        for c in self.clients:
            c.on_capacity = self._on_capacity
        self._rid_prefix = uuid.uuid4().hex[:12]
        self._next_rid = 0

    async def start(self, wait_s: float = 0.0) -> None:
        for c in self.clients:
            await c.start()
        if wait_s > 0:
            await asyncio.gather(*(c.wait_up(wait_s) for c in self.clients))

    async def close(self) -> None:
        self._admission.fail_all(errors.Unavailable("the frontend is shutting down"), "shutdown")
        await asyncio.gather(*(c.close() for c in self.clients))

    @property
    def info(self) -> WorkerInfo | None:
        for c in self.clients:
            if c.info is not None and c.usable:
                return c.info
        for c in self.clients:
            if c.info is not None:
                return c.info
        return None

    def _usable(self, role: str) -> bool:
        return any(c.usable and c.info is not None and c.info.role == role for c in self.clients)

    def ready(self) -> bool:
        """Ready to serve: a usable aggregated worker, or a usable prefill AND decode worker."""
        return self._usable("agg") or (self._usable("prefill") and self._usable("decode"))

    def can_take(self, c: WorkerClient, num_tokens: int) -> bool:
        """Under the per-worker limits, with enough free pages in its last report for the prompt
        (a prompt bigger than the whole worker is let through: the worker refuses it itself)."""
        r = self.router
        if r.max_inflight_per_worker and len(c.in_flight) >= r.max_inflight_per_worker:
            return False
        info = c.info
        assert info is not None
        limit = r.max_pending_prefill_tokens_per_worker
        if limit and info.role != "decode" and c.pending_prefill_tokens \
                and c.pending_prefill_tokens + num_tokens > limit:
            return False
        total = c.load.pages_total
        need = -(-num_tokens // info.page_size)
        return not (total and need <= total and c.load.pages_free < need)

    def _choose(self, role: str, prompt_ids: list[int]) -> WorkerClient | None:
        n = len(prompt_ids)
        candidates = [c for c in self.clients if c.usable and c.info is not None
                      and c.info.role == role and self.can_take(c, n)]
        if not candidates:
            return None
        chosen = self.policy.choose(role, candidates, prompt_ids, self._page_size())
        assert isinstance(chosen, WorkerClient)
        return chosen

    def _page_size(self) -> int:
        info = self.info
        return info.page_size if info is not None else DEFAULT_PAGE_SIZE

    def _place(self, s: RoutedStream) -> Placed | None:
        """Start `s` on the workers the policy picks among those that can take it; None if all
        are full. Raises Unavailable when no worker (or pair) is usable at all."""
        ids, page_size = s.prompt_ids, self._page_size()
        placed: Placed
        if self._usable("prefill") and self._usable("decode"):
            p, d = self._choose("prefill", ids), self._choose("decode", ids)
            if p is None or d is None:
                return None
            msg = Generate(s.rid, ids, s.sampling, bootstrap_of(p, secrets.randbits(63)))
            placed = PDStream(p, d, msg)
            placed.start()
            self.policy.served("prefill", p, ids, page_size)
            self.policy.served("decode", d, ids, page_size)
            return placed
        if not self._usable("agg"):
            raise errors.Unavailable("no worker is available", retry_after=RETRY_AFTER_S)
        agg = self._choose("agg", ids)
        if agg is None:
            return None
        placed = RequestStream(agg, Generate(s.rid, ids, s.sampling))
        placed.start()
        self.policy.served("agg", agg, ids, page_size)
        return placed

    def _on_capacity(self) -> None:
        if not len(self._admission):
            return
        if self.ready():
            self._admission.wake()
        else:
            self._admission.fail_all(
                errors.Unavailable("no worker is available", retry_after=RETRY_AFTER_S))

    def new_rid(self) -> str:
        self._next_rid += 1
        return f"{self._rid_prefix}-{self._next_rid}"

    def open(self, prompt_ids: list[int], sampling: SamplingParams) -> RoutedStream:
        if not self.ready():
            self._admission.rejected.labels("no_worker").inc()
            raise errors.Unavailable("no worker is available", retry_after=RETRY_AFTER_S)
        return RoutedStream(self, self.new_rid(), prompt_ids, sampling)

    async def snapshot(self) -> list[dict]:
        loads = await asyncio.gather(*(c.query_load() for c in self.clients))
        out = []
        for c, load in zip(self.clients, loads):
            info = c.info
            out.append({
                "name": info.name if info else "",
                "role": info.role if info else "",
                "engine": info.engine if info else "",
                "address": c.address,
                "state": c.state,
                "in_flight": len(c.in_flight),
                "pending_prefill_tokens": c.pending_prefill_tokens,
                "active_decode_tokens": c.active_decode_tokens,
                "running": load.running,
                "waiting": load.waiting,
                "pages_free": load.pages_free,
                "pages_total": load.pages_total,
                "pages_reserved": load.pages_reserved,
            })
        return out

    def metrics(self) -> str:
        lines = [
            *self._admission.render(),
            "# HELP tandem_worker_up Whether the worker is usable (1) or not (0).",
            "# TYPE tandem_worker_up gauge",
        ]
        for c in self.clients:
            lines.append(f'tandem_worker_up{{worker="{c.address}"}} {int(c.usable)}')
        for name, help_, get in (
            ("tandem_worker_in_flight_requests", "Requests in flight on the worker.",
             lambda c: len(c.in_flight)),
            ("tandem_worker_pending_prefill_tokens",
             "Prompt tokens sent to the worker whose first delta has not come back.",
             lambda c: c.pending_prefill_tokens),
            ("tandem_worker_active_decode_tokens",
             "Prompt and generated tokens of the requests decoding on the worker.",
             lambda c: c.active_decode_tokens),
            ("tandem_worker_running_requests", "Requests running on the worker (last report).",
             lambda c: c.load.running),
            ("tandem_worker_pages_free", "KV pages free on the worker (last report).",
             lambda c: c.load.pages_free),
            ("tandem_worker_pages_total", "KV pages on the worker.", lambda c: c.load.pages_total),
            ("tandem_worker_waiting_requests", "Requests waiting on the worker (last report).",
             lambda c: c.load.waiting),
            ("tandem_delta_protocol_errors_total", "Deltas refused for a gap or an overlap.",
             lambda c: c.protocol_errors),
        ):
            kind = "counter" if name.endswith("_total") else "gauge"
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for c in self.clients:
                lines.append(f'{name}{{worker="{c.address}"}} {get(c)}')
        return "\n".join(lines) + "\n"
