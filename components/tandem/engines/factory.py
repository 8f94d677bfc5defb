"""Build the engine a worker was asked for, with its side of the PD handoff. Engines with heavy
imports are imported only here, and only when chosen; the worker knows no engine internals."""

from __future__ import annotations

import secrets
from typing import Any

from tandem.config import ENGINES, MockTiming, WorkerConfig
from tandem.engines.base import Engine
from tandem.engines.handoff import HandoffConfig
from tandem.kv.transfer.movers import KvMover


def handoff_config(cfg: WorkerConfig, name: str) -> HandoffConfig | None:
    """The PD handoff of a prefill or decode worker (None for an aggregated one): simulated
    transfers for the mock engine, NIXL for engines with real KV memory."""
    if cfg.role not in ("prefill", "decode"):
        return None

    def make_mover(kv: Any, page_bytes: int, num_pages: int) -> KvMover:
        if kv is None:  # no KV memory (mock engine): transfers only cost time
            from tandem.kv.transfer.movers import SimulatedMover

            return SimulatedMover(name, page_bytes, num_pages, cfg.kv_bytes_per_s)
        from tandem.kv.transfer.movers import NixlMover

        # An agent name of this process start: a worker that restarts under its name is a new
        # agent to its peers' NIXL, which refuses an agent whose name it still knows.
        return NixlMover(f"{name}-{secrets.token_hex(4)}", kv, page_bytes, num_pages)

    return HandoffConfig(
        role=cfg.role, name=name, make_mover=make_mover,
        room_timeout_s=cfg.kv_room_timeout_s, done_timeout_s=cfg.kv_done_timeout_s,
        transfer_timeout_s=cfg.kv_transfer_timeout_s,
        host=cfg.host, port=cfg.bootstrap_port, advertise_host=cfg.reach_host,
        trusted=bool(cfg.auth_keys))


def make_engine(cfg: WorkerConfig, name: str = "") -> Engine:
    """The engine for `cfg`, built with its handoff; `name` names this worker's transfer agent."""
    handoff = handoff_config(cfg, name or f"{cfg.role}-{cfg.engine}-{cfg.port}")
    if cfg.engine == "mock":
        from tandem.engines.mock import MockEngine

        return MockEngine(
            cfg.model, page_size=cfg.page_size, num_pages=cfg.num_pages, max_batch=cfg.max_batch,
            output_mode=cfg.output_mode or None, handoff=handoff, timing=MockTiming.of(cfg),
            prefix_cache=cfg.prefix_cache, check_pages=cfg.check_kv,
            max_prefill_tokens=cfg.max_prefill_tokens, host_pages=cfg.host_kv_pages)
    if cfg.engine == "reference":
        from tandem.engines.reference.engine import DEFAULT_MAX_PREFILL_TOKENS as PREFILL_TOKENS
        from tandem.engines.reference.engine import ReferenceEngine

        return ReferenceEngine(cfg.model, device=cfg.device, page_size=cfg.page_size,
                               num_pages=cfg.num_pages, max_batch=cfg.max_batch,
                               output_mode=cfg.output_mode or None, handoff=handoff,
                               prefix_cache=cfg.prefix_cache, check_pages=cfg.check_kv,
                               threads=cfg.threads, host_pages=cfg.host_kv_pages,
                               max_prefill_tokens=cfg.max_prefill_tokens or PREFILL_TOKENS)
    if cfg.engine == "sglang":  # PD through SGLang's own bootstrap server: no tandem handoff
        from tandem.engines.sglang import SGLangEngine

        return SGLangEngine.from_config(cfg)
    raise ValueError(f"unknown engine {cfg.engine!r}; choose one of {', '.join(ENGINES)}")
