"""`tandem worker`: build the engine, serve it, drain on SIGTERM, free everything, exit."""

from __future__ import annotations

import asyncio
import logging
import os

from tandem.engines.factory import make_engine
from tandem.runtime import lifecycle
from tandem.runtime.config import WorkerConfig
from tandem.runtime.protocol import WorkerInfo
from tandem.worker.server import WorkerServer

log = logging.getLogger("tandem.worker")


def run_worker(cfg: WorkerConfig) -> None:
    lifecycle.run(lambda stop: _main(cfg, stop))


async def _main(cfg: WorkerConfig, stop: asyncio.Event) -> None:
    engine = make_engine(cfg)
    try:
        await engine.start()
        info = WorkerInfo(
            name=cfg.name or f"{cfg.role}-{cfg.engine}-{cfg.port}-{os.getpid()}",
            role=cfg.role,  # type: ignore[arg-type]
            engine=engine.name,
            model=engine.spec.name,
            page_size=engine.page_size,
            pages_total=engine.num_pages,
            max_context=engine.spec.max_context,
            output_mode=engine.output_mode,
            eos_token_ids=tuple(engine.spec.eos_token_ids),
        )
        await WorkerServer(cfg, engine, info).run(stop)
    finally:
        await engine.shutdown()
    log.info("worker stopped")
