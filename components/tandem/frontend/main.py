"""`tandem frontend`: connect to the workers, serve the OpenAI API, drain on SIGTERM."""

from __future__ import annotations

import asyncio

from tandem.frontend.server import serve
from tandem.router.pool import WorkerPool
from tandem.runtime import lifecycle
from tandem.runtime.config import HELLO_TIMEOUT_S
from tandem.config import FrontendConfig


def run_frontend(cfg: FrontendConfig) -> None:
    lifecycle.run(lambda stop: _main(cfg, stop))


async def _main(cfg: FrontendConfig, stop: asyncio.Event) -> None:
    pool = WorkerPool(cfg.workers, router=cfg.router)
    try:
        # Serve at once; workers that are not up yet join when they answer the handshake.
        await pool.start(wait_s=HELLO_TIMEOUT_S if not stop.is_set() else 0)
        lifecycle.tune_gc()
        await serve(cfg, pool, stop, backend=cfg.http_server)
    finally:
        await pool.close()
