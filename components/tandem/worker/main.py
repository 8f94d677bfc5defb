"""`tandem worker`: build the engine (with its side of the KV handoff, for PD roles), serve it,
drain on SIGTERM, free everything, exit. The worker knows no engine internals: the factory builds
the engine complete, and the engine announces its bootstrap address once started."""

from __future__ import annotations

import asyncio
import logging
import os

from tandem.config import WorkerConfig
from tandem.engines.factory import make_engine
from tandem.runtime import auth, lifecycle, transport
from tandem.runtime.wire import WorkerInfo
from tandem.worker.health import HealthServer
from tandem.worker.server import WorkerServer

log = logging.getLogger("tandem.worker")


def run_worker(cfg: WorkerConfig) -> None:
    lifecycle.run(lambda stop: _main(cfg, stop))


async def _main(cfg: WorkerConfig, stop: asyncio.Event) -> None:
    # Every socket of this process (frontends, KV bootstrap) authenticates with the cluster keys;
    # without them, nothing binds beyond loopback.
    transport.use_keys(auth.load_keys(cfg.auth_keys) if cfg.auth_keys else None)
    name = cfg.name or f"{cfg.role}-{cfg.engine}-{cfg.port}-{os.getpid()}"
    engine = make_engine(cfg, name)
    server: WorkerServer | None = None

    def ready() -> tuple[bool, str]:
        if server is None:
            return False, "starting"
        return (True, "") if server.ready else (False, "draining")

    health = HealthServer(ready, cfg.host, cfg.health_port) if cfg.health_port else None
    try:
        if health is not None:
            await health.start()
        await engine.start()
        info = WorkerInfo(
            name=name,
            role=cfg.role,
            engine=engine.name,
            model=engine.spec.name,
            page_size=engine.page_size,
            pages_total=engine.num_pages,
            max_context=engine.spec.max_context,
            output_mode=engine.output_mode,
            bootstrap_addr=engine.bootstrap_addr,
            eos_token_ids=tuple(engine.spec.eos_token_ids),
        )
        lifecycle.tune_gc()
        server = WorkerServer(cfg, engine, info)
        await server.run(stop)
    finally:
        await engine.shutdown()
        if health is not None:
            await health.close()
    log.info("worker stopped")
