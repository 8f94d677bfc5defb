"""MockEngine: the engine contract with no compute, for scale and runtime-overhead measurements.

Token ids are deterministic (a function of the prompt and the position), so two runs agree and a
test can predict them. Everything else is the shared step loop (tandem.engines.stepper): real page
accounting (pages for min(prompt + max_tokens, context) tokens taken at admission, back on
finish or cancel), a running batch capped at `max_batch`, admission that waits for pages, and the
PD handoff of tandem.engines.pd (its transfers simulated by tandem.kv.movers.SimulatedMover).

Timing (`MockTiming`): a step sleeps for its prefill cost (per prompt token admitted that step)
plus its decode cost (per step, and per sequence in the step), plus an optional fixed delay; with
every cost zero a step sleeps not at all and yields to the event loop once.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

from tandem.engines.base import ModelSpec
from tandem.engines.pd import HandoffSpec
from tandem.engines.scheduler import Batch
from tandem.engines.stepper import Stepper
from tandem.kv.pages import page_bytes
from tandem.runtime.wire import OutputMode

UNLIMITED_PREFILL_TOKENS = 1 << 62  # the mock admits every prompt that fits, as it always has


def mock_token(prompt_ids: list[int], position: int, vocab: int, avoid: frozenset[int]) -> int:
    """The id the mock engine emits at `position` for this prompt (stable across processes)."""
    seed = (sum(prompt_ids) * 1_000_003 + len(prompt_ids)) & 0xFFFFFFFF
    tok = (seed + position * 7919 + 13) % vocab
    while tok in avoid:
        tok = (tok + 1) % vocab
    return tok


def read_model_config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg: dict[str, Any] = json.load(f)
    return cfg


def spec_from_config(model_dir: str, cfg: dict[str, Any]) -> ModelSpec:
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelSpec(
        name=os.path.basename(os.path.normpath(model_dir)),
        max_context=int(cfg.get("max_position_embeddings", 2048)),
        eos_token_ids=eos_ids,
        vocab_size=int(cfg["vocab_size"]),
    )


@dataclass(frozen=True, slots=True)
class MockTiming:
    """What a mock engine step costs, in seconds; all zero = overhead runs (no sleeps at all)."""

    step_s: float = 0.0  # every step, whatever it does
    prefill_s_per_token: float = 0.0  # per prompt token admitted in the step
    decode_step_s: float = 0.0  # a step that decodes at least one sequence
    decode_s_per_seq: float = 0.0  # per sequence decoded in the step

    def step_cost(self, num_prompt_tokens: int, num_decoding: int) -> float:
        cost = self.step_s + self.prefill_s_per_token * num_prompt_tokens
        if num_decoding:
            cost += self.decode_step_s + self.decode_s_per_seq * num_decoding
        return cost


class MockEngine(Stepper):
    name = "mock"

    def __init__(self, model_dir: str, *, page_size: int = 16, num_pages: int = 0,
                 max_batch: int = 64, output_mode: OutputMode = "cumulative",
                 step_delay_s: float = 0.0, timing: MockTiming | None = None,
                 handoff: HandoffSpec | None = None) -> None:
        cfg = read_model_config(model_dir)
        self.spec = spec_from_config(model_dir, cfg)
        heads = int(cfg.get("num_attention_heads", 8))
        head_dim = int(cfg.get("head_dim", int(cfg.get("hidden_size", 512)) // heads))
        # What one page would take in the reference engine's layout (float32).
        self.page_bytes = page_bytes(int(cfg.get("num_hidden_layers", 2)), page_size,
                                     int(cfg.get("num_key_value_heads", heads)), head_dim, 4)
        num_pages = num_pages or max(1, (max_batch * self.spec.max_context) // page_size)
        super().__init__(page_size=page_size, num_pages=num_pages, max_batch=max_batch,
                         output_mode=output_mode, max_prefill_tokens=UNLIMITED_PREFILL_TOKENS,
                         handoff=handoff)
        self.timing = timing if timing is not None else MockTiming(step_s=step_delay_s)
        self._avoid = frozenset(self.spec.eos_token_ids)

    async def run(self, batch: Batch) -> list[int]:
        num_prompt_tokens = sum(len(s.prompt_ids) - s.num_cached for s in batch.prefill)
        cost = self.timing.step_cost(num_prompt_tokens, len(batch.prefill) + len(batch.decode))
        # The step's tokens come out when its compute would have finished (sleep(0): a yield).
        await asyncio.sleep(cost)
        vocab, avoid = self.spec.vocab_size, self._avoid
        return [mock_token(s.prompt_ids, len(s.output_ids), vocab, avoid)
                for s in (*batch.prefill, *batch.decode)]
