"""Build the engine a worker was asked for. Engines with heavy imports are imported only here,
and only when chosen."""

from __future__ import annotations

from tandem.engines.base import Engine
from tandem.config import WorkerConfig

ENGINES = ("reference", "mock")


def make_engine(cfg: WorkerConfig) -> Engine:
    if cfg.engine == "mock":
        from tandem.engines.mock import MockEngine, MockTiming

        return MockEngine(
            cfg.model,
            page_size=cfg.page_size,
            num_pages=cfg.num_pages,
            max_batch=cfg.max_batch,
            output_mode=cfg.output_mode,  # type: ignore[arg-type]
            timing=MockTiming(
                step_s=cfg.step_delay_ms / 1e3,
                prefill_s_per_token=cfg.mock_prefill_us_per_token / 1e6,
                decode_step_s=cfg.mock_decode_step_us / 1e6,
                decode_s_per_seq=cfg.mock_decode_us_per_seq / 1e6,
            ),
        )
    if cfg.engine == "reference":
        from tandem.engines.reference.engine import ReferenceEngine

        return ReferenceEngine(
            cfg.model,
            device=cfg.device,
            page_size=cfg.page_size,
            num_pages=cfg.num_pages,
            max_batch=cfg.max_batch,
            output_mode=cfg.output_mode,  # type: ignore[arg-type]
        )
    raise ValueError(f"unknown engine {cfg.engine!r}; choose one of {', '.join(ENGINES)}")
