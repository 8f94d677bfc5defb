"""`tandem frontend`: load the cluster keys, find and connect the workers, serve the OpenAI API,
drain on SIGTERM.

Order matters. The CURVE keys (`--auth-keys`) are loaded before any socket exists, so every
connection to a worker authenticates. `--workers` becomes a tandem.router.discovery.Discovery whose
changes go to the WorkerPool (`pool.apply`): static addresses and the first resolution of every DNS
name are known before anything connects; DNS names are then re-resolved in discovery's own
(supervised) task while serving. On shutdown the HTTP side drains first (`--drain-timeout`), then
discovery stops (so no worker is added while the pool closes), then the pool closes.
"""

from __future__ import annotations

import asyncio

from tandem.config import FrontendConfig
from tandem.frontend.server import serve
from tandem.router.discovery import Discovery
from tandem.router.pool import WorkerPool
from tandem.runtime import auth, lifecycle, transport
from tandem.runtime.config import STARTUP_WAIT_S


def run_frontend(cfg: FrontendConfig) -> None:
    lifecycle.run(lambda stop: _main(cfg, stop))


async def _main(cfg: FrontendConfig, stop: asyncio.Event) -> None:
    transport.use_keys(auth.load_keys(cfg.auth_keys) if cfg.auth_keys else None)
    pool = WorkerPool(router=cfg.router, start_timeout_s=cfg.worker_start_timeout_s)
    discovery = Discovery(cfg.workers, on_change=pool.apply)
    try:
        await discovery.start()  # the first set, added to the pool before anything connects
        # Serve at once; workers that are not up yet join when they answer the handshake.
        await pool.start(wait_s=STARTUP_WAIT_S if not stop.is_set() else 0)
        lifecycle.tune_gc()
        await serve(cfg, pool, stop)
    finally:
        await discovery.close()
        await pool.close()
