"""MockEngine: the engine contract with no compute, for scale and runtime-overhead measurements.

Token ids are deterministic (a function of the prompt and the position), so two runs agree and a
test can predict them. Page accounting is real (a PagePool, pages allocated at admission for
min(prompt + max_tokens, max_context) tokens and freed on finish/abort). Timing (`MockTiming`): a
step sleeps for its prefill cost (per prompt token admitted that step) plus its decode cost (per
step, and per running sequence), plus an optional fixed delay; with every cost zero a step sleeps
not at all and yields to the event loop once. The running batch is capped at `max_batch` and
admission waits for pages, so the page budget and the batch cap shape latency as in a real engine.

Outputs reach their consumer through `generate()` (an async iterator per request), or through
the fast path `open_stream()` (tandem.engines.base): the step calls the worker's sink directly, with
no task woken per request per step (at 2048 streams the wakeups were over half the worker's CPU).

PD roles follow the same handoff protocol as the reference engine (tandem.kv.handoff), with a
SimulatedMover instead of NIXL: the prefill side holds the prompt's pages until its "write" is done,
the decode side reserves pages for the whole request and decodes from the first token on. A PD
prefill runs outside the step loop, one at a time, for its prompt's prefill cost; the transfer
cost per byte is the SimulatedMover's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem.engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    ModelSpec,
    OutputSink,
)
from tandem.kv.handoff import DecodeSide, KvHandoffError, PrefillSide
from tandem.kv.pages import PagePool
from tandem.runtime.mailbox import Mailbox
from tandem.runtime.wire import FinishReason, Load, OutputMode

log = logging.getLogger("tandem.engine")


def mock_token(prompt_ids: list[int], position: int, vocab: int, avoid: frozenset[int]) -> int:
    """The id the mock engine emits at `position` for this prompt (stable across processes)."""
    seed = (sum(prompt_ids) * 1_000_003 + len(prompt_ids)) & 0xFFFFFFFF
    tok = (seed + position * 7919 + 13) % vocab
    while tok in avoid:
        tok = (tok + 1) % vocab
    return tok


def _read_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def spec_from_model_dir(model_dir: str) -> ModelSpec:
    cfg = _read_config(model_dir)
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


class _Stream:
    """The handle of a fast-path request: cancelling it aborts the request, wherever it is."""

    __slots__ = ("engine", "seq", "handoff")

    def __init__(self, engine: MockEngine, seq: _Seq | None,
                 handoff: asyncio.Task[None] | None) -> None:
        self.engine = engine
        self.seq = seq
        self.handoff = handoff  # PD decode: the task receiving the KV, until it is in place

    def cancel(self) -> None:
        if self.seq is not None:
            self.engine._finish(self.seq, "abort", deliver=False)
        elif self.handoff is not None:
            self.handoff.cancel()


@dataclass(eq=False, slots=True)
class _Seq:
    req: EngineRequest
    queue: Mailbox[EngineOutput] | OutputSink  # the consumer: generate()'s iterator, or a fast-path sink
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
        timing: MockTiming | None = None,
    ) -> None:
        self.spec = spec_from_model_dir(model_dir)
        cfg = _read_config(model_dir)
        heads = int(cfg.get("num_attention_heads", 8))
        head_dim = int(cfg.get("head_dim", int(cfg.get("hidden_size", 512)) // heads))
        # The bytes one page would take in the reference engine's layout (float32).
        self.page_bytes = (int(cfg.get("num_hidden_layers", 2)) * 2 * page_size
                           * int(cfg.get("num_key_value_heads", heads)) * head_dim * 4)
        self.prefill_side: PrefillSide | None = None
        self.decode_side: DecodeSide | None = None
        self._handoffs = 0  # PD requests between admission and the decode batch
        self._freed = asyncio.Event()
        self.page_size = page_size
        self.num_pages = num_pages or max(1, (max_batch * self.spec.max_context) // page_size)
        self.pool = PagePool(self.num_pages, page_size)
        self.max_batch = max_batch
        self.output_mode = output_mode
        self.timing = timing if timing is not None else MockTiming(step_s=step_delay_s)
        self._prefill_lock = asyncio.Lock()  # PD prefill: one prompt computes at a time
        self._avoid = frozenset(self.spec.eos_token_ids)
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._handoff_tasks: set[asyncio.Task[None]] = set()  # fast-path PD decodes, owned here

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="mock-engine")

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        handoffs = list(self._handoff_tasks)
        for t in handoffs:
            t.cancel()
        await asyncio.gather(*handoffs, return_exceptions=True)
        for seq in list(self._running.values()) + list(self._waiting):
            self._finish(seq, "abort")

    def load(self) -> Load:
        return Load(
            running=len(self._running) + self._handoffs,
            waiting=len(self._waiting),
            pages_free=self.pool.num_free,
            pages_total=self.num_pages,
            pages_reserved=self.pool.num_reserved,
        )

    async def abort(self, rid: str) -> None:
        seq = self._running.get(rid) or next((s for s in self._waiting if s.req.rid == rid), None)
        if seq is not None:
            self._finish(seq, "abort")

    def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        if req.bootstrap is not None and self.prefill_side is not None:
            return self._prefill(req, self.prefill_side)
        if req.bootstrap is not None and self.decode_side is not None:
            return self._decode(req, self.decode_side)
        return self._agg(req)

    def open_stream(self, req: EngineRequest, sink: OutputSink) -> _Stream | None:
        """The fast path for agg and decode requests (a prefill has one output: no need)."""
        if req.bootstrap is None:
            seq = _Seq(req, sink, self._budget(req))
            self._waiting.append(seq)
            self._wake.set()
            return _Stream(self, seq, None)
        if self.decode_side is not None:
            budget = self._budget(req)
            stream = _Stream(self, None, None)
            task = asyncio.get_running_loop().create_task(
                self._decode_into(req, self.decode_side, budget, sink, stream), name=req.rid)
            self._handoff_tasks.add(task)
            task.add_done_callback(self._handoff_tasks.discard)
            stream.handoff = task
            return stream
        return None

    async def _decode_into(self, req: EngineRequest, side: DecodeSide, budget: int,
                           sink: OutputSink, stream: _Stream) -> None:
        try:
            first = await self._receive_kv(req, side, budget)
        except EngineError as e:
            sink.fail(e)
            return
        except Exception as e:  # a bug fails this request, loudly, not the worker
            log.exception("%s: KV handoff failed", req.rid)
            sink.fail(EngineError(f"engine failed: {e}"))
            return
        stream.seq, first_out = self._start_decoding(req, sink, budget, first)
        sink.put(first_out)

    def _budget(self, req: EngineRequest) -> int:
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
        return budget

    async def _agg(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        seq = _Seq(req, Mailbox(), self._budget(req))
        self._waiting.append(seq)
        self._wake.set()
        async with contextlib.aclosing(self._outputs(seq)) as outs:
            async for out in outs:
                yield out

    async def _outputs(self, seq: _Seq) -> AsyncIterator[EngineOutput]:
        queue = seq.queue
        assert isinstance(queue, Mailbox)
        try:
            while True:
                out = await queue.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if not seq.done:
                self._finish(seq, "abort", deliver=False)

    # --- PD ---------------------------------------------------------------------------------------
    async def _take_pages(self, rid: str, num_pages: int, reserve: bool) -> None:
        """Pages for a PD request, waiting (behind nobody: the mock is not fair) until some free."""
        while not self.pool.can_allocate(num_pages):
            self._freed.clear()
            await self._freed.wait()
        if reserve:
            self.pool.reserve(rid, num_pages)
        else:
            self.pool.allocate(rid, num_pages)

    def _free(self, rid: str) -> None:
        if self.pool.free(rid):
            self._freed.set()

    async def _prefill(self, req: EngineRequest, side: PrefillSide) -> AsyncIterator[EngineOutput]:
        self._budget(req)
        assert req.bootstrap is not None
        room, n_prompt = req.bootstrap.room, len(req.prompt_ids)
        sent = False
        self._handoffs += 1
        try:
            await self._take_pages(req.rid, self.pool.pages_for(n_prompt), reserve=False)
            cost = self.timing.prefill_s_per_token * n_prompt
            if cost > 0:
                async with self._prefill_lock:
                    await asyncio.sleep(cost)
            dest = await side.wait_room(room)
            first = mock_token(req.prompt_ids, 0, self.spec.vocab_size, self._avoid)
            sent = True
            await side.send(room, dest, self.pool.pages_of(req.rid), first)
        except KvHandoffError as e:
            raise EngineError(str(e)) from e
        finally:
            self._handoffs -= 1
            if not sent:
                side.fail(room, "the prefill request was aborted")
            self._free(req.rid)
        yield EngineOutput([first], "length", n_prompt, 1)

    async def _receive_kv(self, req: EngineRequest, side: DecodeSide, budget: int) -> int:
        """Reserve the request's pages, have its prompt's KV written into them; the first token."""
        assert req.bootstrap is not None
        rid, n_prompt = req.rid, len(req.prompt_ids)
        self._handoffs += 1
        try:
            await self._take_pages(rid, self.pool.pages_for(n_prompt + budget), reserve=True)
            pages = self.pool.pages_of(rid)[: self.pool.pages_for(n_prompt)]
            # On failure fetch() calls release once no write can land in the pages any more.
            first = await side.fetch(req.bootstrap, pages, lambda: self._free(rid))
        except KvHandoffError as e:
            raise EngineError(str(e)) from e
        finally:
            self._handoffs -= 1
        self.pool.commit(rid)
        return first

    def _start_decoding(self, req: EngineRequest, queue: Mailbox[EngineOutput] | OutputSink, budget: int,
                        first: int) -> tuple[_Seq, EngineOutput]:
        """Join the batch after the handoff (or finish at once); the first token's output."""
        seq = _Seq(req, queue, budget, [first])
        reason = self._finish_reason(seq, first, 0)
        if reason is not None:
            seq.done = True
            self._free(req.rid)
        else:
            self._running[req.rid] = seq
            self._wake.set()
        return seq, self._output(seq, [first], reason)

    async def _decode(self, req: EngineRequest, side: DecodeSide) -> AsyncIterator[EngineOutput]:
        budget = self._budget(req)
        first = await self._receive_kv(req, side, budget)
        seq, out = self._start_decoding(req, Mailbox(), budget, first)
        try:
            yield out
        except BaseException:
            self._finish(seq, "abort", deliver=False)
            raise
        if out.finish_reason is not None:
            return
        async with contextlib.aclosing(self._outputs(seq)) as outs:
            async for out in outs:
                yield out

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
        self._free(seq.req.rid)
        if deliver:
            seq.queue.put(self._output(seq, [], reason))

    def _output(self, seq: _Seq, new: list[int], reason: FinishReason | None) -> EngineOutput:
        n = len(seq.output_ids)
        # Cumulative: the live list, as SGLang hands it out (no O(length) copy per token); the
        # consumer bounds it by `completion_tokens`, so later growth cannot leak in.
        ids = seq.output_ids if self.output_mode == "cumulative" else new
        return EngineOutput(ids, reason, len(seq.req.prompt_ids), n)

    def _admit(self) -> int:
        """Move waiting requests into the batch while it and the pages allow; returns the number
        of prompt tokens admitted (this step's prefill work)."""
        num_prompt_tokens = 0
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            need = self.pool.pages_for(len(seq.req.prompt_ids) + seq.budget)
            if not self.pool.can_allocate(need):
                break
            self._waiting.popleft()
            self.pool.allocate(seq.req.rid, need)
            self._running[seq.req.rid] = seq
            num_prompt_tokens += len(seq.req.prompt_ids)
        return num_prompt_tokens

    def _step(self) -> None:
        vocab = self.spec.vocab_size
        for seq in list(self._running.values()):
            pos = len(seq.output_ids)
            tok = mock_token(seq.req.prompt_ids, pos, vocab, self._avoid)
            seq.output_ids.append(tok)
            reason = self._finish_reason(seq, tok, pos)
            out = self._output(seq, [tok], reason)
            if reason is not None:
                seq.done = True
                del self._running[seq.req.rid]
                self._free(seq.req.rid)
            seq.queue.put(out)

    @staticmethod
    def _finish_reason(seq: _Seq, tok: int, pos: int) -> FinishReason | None:
        sp = seq.req.sampling
        if tok in sp.stop_token_ids and pos + 1 >= sp.min_tokens:
            return "stop"
        if pos + 1 >= seq.budget:
            return "length"
        return None

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            num_prompt_tokens = self._admit()
            num_decoding = len(self._running)
            cost = self.timing.step_cost(num_prompt_tokens, num_decoding)
            if cost > 0:
                # The step's tokens come out when its compute would have finished.
                await asyncio.sleep(cost)
            if self._running:
                self._step()
            await asyncio.sleep(0)
