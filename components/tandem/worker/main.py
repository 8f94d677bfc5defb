"""`tandem worker`: build the engine (and, for PD roles, its KV handoff side), serve it, drain on
SIGTERM, free everything, exit."""

from __future__ import annotations

import asyncio
import logging
import os

from tandem.engines.base import Engine
from tandem.engines.factory import make_engine
from tandem.kv.handoff import DecodeSide, KvMover, PrefillSide
from tandem.runtime import lifecycle
from tandem.config import WorkerConfig
from tandem.runtime.wire import WorkerInfo
from tandem.worker.server import WorkerServer

log = logging.getLogger("tandem.worker")


def run_worker(cfg: WorkerConfig) -> None:
    lifecycle.run(lambda stop: _main(cfg, stop))


def make_mover(cfg: WorkerConfig, engine: Engine, name: str) -> KvMover:
    page_bytes = int(getattr(engine, "page_bytes"))
    if cfg.engine == "mock":
        from tandem.kv.movers import SimulatedMover

        return SimulatedMover(name, page_bytes, engine.num_pages, cfg.kv_bytes_per_s)
    from tandem.kv.movers import NixlMover

    return NixlMover(name, getattr(engine, "kv"), page_bytes, engine.num_pages)


async def attach_handoff(cfg: WorkerConfig, engine: Engine, name: str) -> str:
    """Give a PD engine its side of the KV handoff; returns the bootstrap address ("" for agg)."""
    if cfg.role == "prefill":
        side = PrefillSide(make_mover(cfg, engine, name), cfg.host, cfg.bootstrap_port,
                           room_timeout_s=cfg.kv_room_timeout_s,
                           transfer_timeout_s=cfg.kv_transfer_timeout_s)
        await side.start()
        engine.prefill_side = side  # type: ignore[attr-defined]
        return side.address
    if cfg.role == "decode":
        engine.decode_side = DecodeSide(  # type: ignore[attr-defined]
            make_mover(cfg, engine, name), name, done_timeout_s=cfg.kv_done_timeout_s,
            transfer_timeout_s=cfg.kv_transfer_timeout_s)
    return ""


async def detach_handoff(engine: Engine) -> None:
    for attr in ("prefill_side", "decode_side"):
        side = getattr(engine, attr, None)
        if side is not None:
            setattr(engine, attr, None)
            await side.close()


async def _main(cfg: WorkerConfig, stop: asyncio.Event) -> None:
    engine = make_engine(cfg)
    name = cfg.name or f"{cfg.role}-{cfg.engine}-{cfg.port}-{os.getpid()}"
    try:
        await engine.start()
        bootstrap = await attach_handoff(cfg, engine, name)
        info = WorkerInfo(
            name=name,
            role=cfg.role,  # type: ignore[arg-type]
            engine=engine.name,
            model=engine.spec.name,
            page_size=engine.page_size,
            pages_total=engine.num_pages,
            max_context=engine.spec.max_context,
            output_mode=engine.output_mode,
            bootstrap_addr=bootstrap,
            eos_token_ids=tuple(engine.spec.eos_token_ids),
        )
        lifecycle.tune_gc()
        await WorkerServer(cfg, engine, info).run(stop)
    finally:
        await engine.shutdown()
        await detach_handoff(engine)
    log.info("worker stopped")
