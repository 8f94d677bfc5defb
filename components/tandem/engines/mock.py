"""MockEngine: the engine contract with no compute, for scale and runtime-overhead measurements.

Token ids are deterministic (a function of the prompt and the position), so two runs agree and a
test can predict them. Page accounting is real (a PagePool, pages allocated at admission for
min(prompt + max_tokens, max_context) tokens and freed on finish/abort). Timing: an optional fixed
delay per engine step; with zero delay each step yields to the event loop once.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem.engines.base import (
    Engine,
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    ModelSpec,
)
from tandem.kv.pages import PagePool
from tandem.runtime.protocol import FinishReason, Load, OutputMode


def mock_token(prompt_ids: list[int], position: int, vocab: int, avoid: frozenset[int]) -> int:
    """The id the mock engine emits at `position` for this prompt (stable across processes)."""
    seed = (sum(prompt_ids) * 1_000_003 + len(prompt_ids)) & 0xFFFFFFFF
    tok = (seed + position * 7919 + 13) % vocab
    while tok in avoid:
        tok = (tok + 1) % vocab
    return tok


def spec_from_model_dir(model_dir: str) -> ModelSpec:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelSpec(
        name=os.path.basename(os.path.normpath(model_dir)),
        max_context=int(cfg.get("max_position_embeddings", 2048)),
        eos_token_ids=eos_ids,
        vocab_size=int(cfg["vocab_size"]),
    )


@dataclass(eq=False, slots=True)
class _Seq:
    req: EngineRequest
    queue: asyncio.Queue[EngineOutput]
    budget: int  # completion tokens this request may produce
    output_ids: list[int] = field(default_factory=list)
    done: bool = False


class MockEngine(Engine):
    name = "mock"

    def __init__(
        self,
        model_dir: str,
        *,
        page_size: int = 16,
        num_pages: int = 0,
        max_batch: int = 256,
        output_mode: OutputMode = "cumulative",
        step_delay_s: float = 0.0,
    ) -> None:
        self.spec = spec_from_model_dir(model_dir)
        self.page_size = page_size
        self.num_pages = num_pages or max(1, (max_batch * self.spec.max_context) // page_size)
        self.pool = PagePool(self.num_pages, page_size)
        self.max_batch = max_batch
        self.output_mode = output_mode
        self.step_delay_s = step_delay_s
        self._avoid = frozenset(self.spec.eos_token_ids)
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="mock-engine")

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for seq in list(self._running.values()) + list(self._waiting):
            self._finish(seq, "abort")

    def load(self) -> Load:
        return Load(
            running=len(self._running),
            waiting=len(self._waiting),
            pages_free=self.pool.num_free,
            pages_total=self.num_pages,
            pages_reserved=self.pool.num_reserved,
        )

    async def abort(self, rid: str) -> None:
        seq = self._running.get(rid) or next((s for s in self._waiting if s.req.rid == rid), None)
        if seq is not None:
            self._finish(seq, "abort")

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        n_prompt = len(req.prompt_ids)
        if n_prompt == 0:
            raise EngineRequestError("prompt is empty")
        if n_prompt >= self.spec.max_context:
            raise EngineRequestError(
                f"prompt has {n_prompt} tokens; the context is {self.spec.max_context}"
            )
        budget = min(req.sampling.max_tokens, self.spec.max_context - n_prompt)
        if self.pool.pages_for(n_prompt + budget) > self.num_pages:
            raise EngineRequestError("request needs more KV pages than the worker has")
        seq = _Seq(req, asyncio.Queue(), budget)
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                out = await seq.queue.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if not seq.done:
                self._finish(seq, "abort", deliver=False)

    # --- the step loop ----------------------------------------------------------------------------
    def _finish(self, seq: _Seq, reason: FinishReason, deliver: bool = True) -> None:
        if seq.done:
            return
        seq.done = True
        self._running.pop(seq.req.rid, None)
        try:
            self._waiting.remove(seq)
        except ValueError:
            pass
        self.pool.free(seq.req.rid)
        if deliver:
            seq.queue.put_nowait(self._output(seq, [], reason))

    def _output(self, seq: _Seq, new: list[int], reason: FinishReason | None) -> EngineOutput:
        n = len(seq.output_ids)
        ids = seq.output_ids[:] if self.output_mode == "cumulative" else new
        return EngineOutput(ids, reason, len(seq.req.prompt_ids), n)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            need = self.pool.pages_for(len(seq.req.prompt_ids) + seq.budget)
            if not self.pool.can_allocate(need):
                return
            self._waiting.popleft()
            self.pool.allocate(seq.req.rid, need)
            self._running[seq.req.rid] = seq

    def _step(self) -> None:
        vocab = self.spec.vocab_size
        for seq in list(self._running.values()):
            sp = seq.req.sampling
            pos = len(seq.output_ids)
            tok = mock_token(seq.req.prompt_ids, pos, vocab, self._avoid)
            seq.output_ids.append(tok)
            reason: FinishReason | None = None
            if tok in sp.stop_token_ids and pos + 1 >= sp.min_tokens:
                reason = "stop"
            elif pos + 1 >= seq.budget:
                reason = "length"
            out = self._output(seq, [tok], reason)
            if reason is not None:
                seq.done = True
                del self._running[seq.req.rid]
                self.pool.free(seq.req.rid)
            seq.queue.put_nowait(out)

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            self._admit()
            if self._running:
                self._step()
            if self.step_delay_s > 0:
                await asyncio.sleep(self.step_delay_s)
            else:
                await asyncio.sleep(0)
