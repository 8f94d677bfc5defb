"""`tandem worker`: build the engine (with its side of the KV handoff, for PD roles), serve it,
drain on SIGTERM, free everything, exit. The worker knows no engine internals: the factory builds
the engine complete, and the engine announces its bootstrap address once started (on the address
other processes reach it at, `--advertise-host`; KV transfers are kept on that address's network
interface, tandem.kv.transfer.net). The health port serves `/live`, `/health` (not ready from the first
moment of a drain) and `/metrics` (tandem.worker.metrics). With KV events on and a tandem engine,
a publisher (tandem.worker.kv_events) binds before the engine starts, becomes the engine's
`on_kv_events`, is advertised in the handshake's WorkerInfo and closes after the engine; with
`--engine sglang` the handshake advertises SGLang's own publisher, if its `--kv-events-config`
has one. A supervised task that dies ends the process with status 1 (tandem.runtime.lifecycle)."""

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
from tandem.worker.kv_events import KvEventPublisher, sglang_event_addrs
from tandem.worker.metrics import worker_registry
from tandem.worker.server import WorkerServer

log = logging.getLogger("tandem.worker")


def run_worker(cfg: WorkerConfig) -> None:
    lifecycle.run(lambda stop: _main(cfg, stop))


async def _main(cfg: WorkerConfig, stop: asyncio.Event) -> None:
    # Every socket of this process (frontends, KV bootstrap) authenticates with the cluster keys;
    # without them, nothing binds beyond loopback.
    keys = auth.load_keys(cfg.auth_keys) if cfg.auth_keys else None
    transport.use_keys(keys)
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

    events = KvEventPublisher(cfg.host, cfg.kv_events_port, cfg.kv_events_replay_port,
                              advertise_host=cfg.reach_host) \
        if cfg.publishes_kv_events else None
    metrics = worker_registry(lambda: server.num_requests if server else 0,
                              lambda: server.draining if server else False,
                              lambda: server.load() if server else None,
                              kv_events=lambda: events.counts if events else None)
    health = HealthServer(ready, cfg.host, cfg.health_port,
                          metrics=metrics.render) if cfg.health_port else None
    try:
        if health is not None:
            await health.start()
        if events is not None:
            await events.start()  # (a taken port fails the worker before the model loads)
            engine.on_kv_events = events.publish
        await engine.start()
        events_addr, replay_addr = _event_addrs(cfg, events)
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
            kv_events_addr=events_addr,
            kv_replay_addr=replay_addr,
        )
        lifecycle.tune_gc()
        server = WorkerServer(cfg, engine, info)
        await server.run(stop)
    finally:
        await engine.shutdown()
        if events is not None:
            await events.close()
        if health is not None:
            await health.close()
    log.info("worker stopped")


def _event_addrs(cfg: WorkerConfig, events: KvEventPublisher | None) -> tuple[str, str]:
    """Where this worker's KV events are published and replayed, for the handshake."""
    if events is not None:
        return events.events_addr, events.replay_addr
    if not (cfg.kv_events and cfg.engine == "sglang"):
        return "", ""
    addrs = sglang_event_addrs(cfg.engine_args, cfg.reach_host)
    if not addrs[0]:
        log.info("no KV events: SGLang publishes its own when given --kv-events-config "
                 "'{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:PORT\", ...}'")
    return addrs
