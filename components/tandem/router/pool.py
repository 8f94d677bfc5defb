"""WorkerPool: the frontend's view of every worker, and the routing policy that picks them.

Workers announce their role in the handshake. With usable prefill and decode workers a request is
served disaggregated (PDStream: a prefill and a decode worker, a fresh 63-bit room); otherwise by
one aggregated worker. Within a role the pick is the usable worker with the fewest requests in
flight, ties broken by its last reported free pages. `open()` raises Unavailable (HTTP 503) when
no worker (or pair) is usable.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import uuid

from tandem.router.client import RequestStream, WorkerClient
from tandem.router.pd import PDStream, bootstrap_of
from tandem.runtime import errors
from tandem.runtime.protocol import Generate, SamplingParams, WorkerInfo


class WorkerPool:
    def __init__(self, addresses: list[str] | tuple[str, ...], frontend_id: str | None = None) -> None:
        if not addresses:
            raise ValueError("at least one worker address is needed")
        self.frontend_id = frontend_id or f"fe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ident = self.frontend_id.encode()
        self.clients = [WorkerClient(a, ident) for a in addresses]
        self._rid_prefix = uuid.uuid4().hex[:12]
        self._next_rid = 0

    async def start(self, wait_s: float = 0.0) -> None:
        for c in self.clients:
            await c.start()
        if wait_s > 0:
            await asyncio.gather(*(c.wait_up(wait_s) for c in self.clients))

    async def close(self) -> None:
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

    def _pick(self, role: str) -> WorkerClient | None:
        best: WorkerClient | None = None
        for c in self.clients:
            if not c.usable or c.info is None or c.info.role != role:
                continue
            if best is None or (len(c.in_flight), -c.load.pages_free) < (
                len(best.in_flight), -best.load.pages_free
            ):
                best = c
        return best

    def new_rid(self) -> str:
        self._next_rid += 1
        return f"{self._rid_prefix}-{self._next_rid}"

    def open(self, prompt_ids: list[int], sampling: SamplingParams) -> RequestStream | PDStream:
        p, d = self._pick("prefill"), self._pick("decode")
        if p is not None and d is not None:
            room = secrets.randbits(63)
            msg = Generate(self.new_rid(), prompt_ids, sampling, bootstrap_of(p, room))
            return PDStream(p, d, msg)
        agg = self._pick("agg")
        if agg is None:
            raise errors.Unavailable("no worker is available", retry_after=1.0)
        return RequestStream(agg, Generate(self.new_rid(), prompt_ids, sampling))

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
                "running": load.running,
                "waiting": load.waiting,
                "pages_free": load.pages_free,
                "pages_total": load.pages_total,
                "pages_reserved": load.pages_reserved,
            })
        return out

    def metrics(self) -> str:
        lines = [
            "# HELP tandem_worker_up Whether the worker is usable (1) or not (0).",
            "# TYPE tandem_worker_up gauge",
        ]
        for c in self.clients:
            lines.append(f'tandem_worker_up{{worker="{c.address}"}} {int(c.usable)}')
        for name, help_, get in (
            ("tandem_worker_in_flight_requests", "Requests in flight on the worker.",
             lambda c: len(c.in_flight)),
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
