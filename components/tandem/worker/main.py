"""`tandem worker`: build the engine (with its side of the KV handoff, for PD roles), serve it,
drain on SIGTERM, free everything, exit. The worker knows no engine internals: the factory builds
the engine complete, and the engine announces its bootstrap address once started (on the address
other processes reach it at, `--advertise-host`; KV transfers are kept on that address's network
interface, tandem.kv.transfer.net). The health port serves `/live`, `/health` (not ready from the first
moment of a drain) and `/metrics` (tandem.worker.metrics). A supervised task that dies ends the
process with status 1 (tandem.runtime.lifecycle)."""

from __future__ import annotations

import asyncio
import logging
import os

from tandem.config import WorkerConfig
from tandem.engines.factory import make_engine
from tandem.kv.transfer.net import bind_ucx_to
from tandem.runtime import auth, lifecycle, transport
from tandem.runtime.wire import WorkerInfo
from tandem.worker.health import HealthServer
from tandem.worker.metrics import worker_registry
from tandem.worker.server import WorkerServer

log = logging.getLogger("tandem.worker")


def run_worker(cfg: WorkerConfig) -> None:
    lifecycle.run(lambda stop: _main(cfg, stop))


async def _main(cfg: WorkerConfig, stop: asyncio.Event) -> None:
    # Every socket of this process (frontends, KV bootstrap) authenticates with the cluster keys;
    # without them, nothing binds beyond loopback.
    transport.use_keys(auth.load_keys(cfg.auth_keys) if cfg.auth_keys else None)
    name = cfg.name or f"{cfg.role}-{cfg.engine}-{cfg.port}-{os.getpid()}"
    if cfg.role in ("prefill", "decode"):
        bind_ucx_to(cfg.reach_host)  # before any transfer agent (or engine subprocess) exists
    engine = make_engine(cfg, name)
    server: WorkerServer | None = None

    def ready() -> tuple[bool, str]:
        if stop.is_set():  # from the signal on, before the drain's first step
            return False, "draining"
        if server is None:
            return False, "starting"
        return (True, "") if server.ready else (False, "draining")

    metrics = worker_registry(lambda: server.num_requests if server else 0,
                              lambda: server.draining if server else False,
                              lambda: server.load() if server else None)
    health = HealthServer(ready, cfg.host, cfg.health_port,
                          metrics=metrics.render) if cfg.health_port else None
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
