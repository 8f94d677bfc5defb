"""Stepper: the engine loop shared by the mock and the reference engine (ARCHITECTURE.md, "Engine
contract"): schedule -> compute -> postprocess, over tandem.engines.scheduler. Computing a step
(the mock's `run`, the reference engine's `compute`) and a request's grammar (`constraint`) are
the engine-specific hooks; admission, finishing, cancelling, page accounting, the PD handoff
(tandem.engines.handoff), grammar compiles (tandem.engines.grammars) and output delivery are here.

Two drivers of the same step (tandem.engines.steps): on the loop (`run`, the mock), or on a step
thread (`compute`, the reference engine). Either way the scheduler and the pool are touched under
`self._lock`, a step's sequences are in flight while it computes, and their pages are not freed
until it ends.

Outputs (tandem.engines.outputs): ONE `sink.on_step(outputs)` per sink per step. Events outside
a step (a decode request's first token after its KV arrived, a prefill's end once its KV is
written, a handoff or grammar failure, shutdown) are delivered when they happen, one call each.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from tandem.engines.base import (Engine, EngineError, EngineOutput, EngineRequest,
                                 EngineRequestError, OutputSink)
from tandem.engines.outputs import deliver, ending, last_output
from tandem.engines.handoff import Handoff, HandoffSpec
from tandem.engines.grammars import Compiles, Deferred
from tandem.engines.sampling import adjusts_logits, check_request, stop_ids
from tandem.engines.scheduler import Scheduler, Sequence, SeqStatus
from tandem.engines.host_tier import HostTier
from tandem.engines.pages import PagePool
from tandem.engines.prefix import page_keys, salt_root
from tandem.engines.steps import StepDrivers
from tandem.runtime.wire import FinishReason, Load, OutputMode, TokenLogprobs

log = logging.getLogger("tandem.engine")

CHECK_ENV = "TANDEM_CHECK_KV"  # "1": every engine checks its page accounting after every step


class _Handle:
    __slots__ = ("engine", "seq")

    def __init__(self, engine: Stepper, seq: Sequence) -> None:
        self.engine, self.seq = engine, seq

    def cancel(self) -> None:
        self.engine.cancel(self.seq)


class Stepper(StepDrivers, Engine):
    """An engine made of schedule -> compute -> postprocess. Subclasses set `spec` and
    `page_bytes`, and implement `run` (loop driver) or set `step_thread` and implement `compute`
    (thread driver); they may override `load_memory` (called by `start`; returns the KV memory a
    mover registers) and `check_prompt`."""

    page_bytes: int = 0  # bytes of one KV page: what a mover moves
    step_thread = False
    output_mode: OutputMode = "incremental"  # the default: a step holds just the new token

    def __init__(self, *, page_size: int, num_pages: int, max_batch: int,
                 output_mode: OutputMode | None, max_prefill_tokens: int,
                 handoff: HandoffSpec | None = None, prefix_cache: bool = True,
                 check_pages: bool = False, host_pages: int = 0) -> None:
        output_mode = output_mode or self.output_mode
        if output_mode not in ("cumulative", "incremental"):
            raise ValueError(f"output_mode must be cumulative or incremental, not {output_mode!r}")
        if page_size <= 0 or max_batch <= 0 or num_pages <= 0:
            raise ValueError("page_size, max_batch and num_pages must be positive")
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_batch = max_batch
        self.output_mode = output_mode
        self.pool = PagePool(num_pages, page_size, caching=prefix_cache,
                             host=HostTier(host_pages) if host_pages and prefix_cache else None)
        self.check_pages = check_pages or os.environ.get(CHECK_ENV) == "1"
        self.on_kv_events = None  # (nobody takes KV events yet: the pool records none)
        self.broken = ""  # why the page accounting check failed: the engine takes no more work
        self.sched = Scheduler(self.pool, max_batch, max_prefill_tokens)
        self._handoff_spec = handoff
        self.handoff: Handoff | None = None
        self._cumulative = output_mode == "cumulative"
        self._owner_ids = itertools.count()
        self._lock = threading.Condition(threading.RLock())  # the scheduler and the pool
        self._wake = asyncio.Event()  # loop driver: there may be work
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._started = self._running = self._closed = self._stopping = False
        self._compiles = Compiles()  # grammars being compiled off the loop

    async def load_memory(self) -> Any:
        """Load what the step needs; return the KV memory a mover registers (None: no bytes)."""
        return None

    def check_prompt(self, prompt: list[int]) -> None:
        """Refuse a prompt this engine cannot take (raise EngineRequestError)."""

    # The request's grammar state: None, a ready one, or Deferred (tandem.engines.grammars); or
    # EngineRequestError naming the field (engines.grammars `refuse`: an engine that cannot).
    constraint: Callable[[EngineRequest], Any]

    def new_sequence(self, req: EngineRequest, pd: str) -> Sequence:
        prompt, p = list(req.prompt_ids), req.sampling
        check_request(prompt, p, self.spec,
                      pd == "" or self.handoff is None or self.handoff.carries_logprobs)
        self.check_prompt(prompt)
        # A prefill-only request holds pages for its prompt alone: only its K/V is handed over.
        max_total = len(prompt) if pd == "prefill" else \
            min(len(prompt) + p.max_tokens, self.spec.max_context)
        if not self.sched.fits_at_all(max_total):
            raise EngineRequestError(f"{max_total} tokens need {self.pool.pages_for(max_total)} "
                                     f"KV pages; this engine has {self.num_pages}")
        return Sequence(rid=req.rid, prompt_ids=prompt, sampling=p, grammar=self.constraint(req),
                        max_total=max_total, stop_ids=stop_ids(p, self.spec.eos_token_ids),
                        owner=f"{req.rid}#{next(self._owner_ids)}", pd=pd,
                        bootstrap=req.bootstrap, resume=req.resume_offset, tenant=req.tenant,
                        priority=req.priority, logprobs=None if p.logprobs is None else [],
                        extras=p.logprobs is not None or adjusts_logits(p),
                        salt=req.cache_salt,
                        keys=page_keys(prompt, self.page_size, salt_root(req.cache_salt))
                        if self.pool.caching else [])

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started or self._closed:
            raise EngineError("start() called twice or after shutdown()")
        self._started = True
        loop = asyncio.get_running_loop()
        memory = await self.load_memory()
        if self._handoff_spec is not None:
            self.handoff = self._handoff_spec.build(self, memory)
            await self.handoff.start()
            self.bootstrap_addr = self.handoff.address
        if self.step_thread:
            self._thread = threading.Thread(target=self._thread_main, args=(loop,), daemon=True,
                                            name=f"tandem-{self.name}-step")
            self._thread.start()
        else:
            self._task = loop.create_task(self._loop(), name=f"{self.name}-engine")
        self._running = True

    async def shutdown(self) -> None:
        """End every request with "abort", stop stepping, close the handoff, free every page.
        Safe after a partial or failed start, and twice."""
        if self._closed:
            return
        self._closed, self._running = True, False
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        thread, self._thread = self._thread, None
        if thread is not None:  # a step still computing ends before its pages are freed; the
            await asyncio.to_thread(thread.join)  # steps it handed over are delivered first
        with self._lock:
            seqs = self.sched.all()
            for seq in seqs:
                seq.in_flight = False
            ended = [s for s in [*seqs, *self._compiles.close()] if last_output(s)]
        deliver(self.name, [(s, ending(s, "abort")) for s in ended], self._cumulative)
        if self.handoff is not None:  # ends the transfers: no write can land after this
            await self.handoff.close()
        with self._lock:
            for seq in self.sched.all():
                self.sched.finish(seq, "abort")

    # --- requests ---------------------------------------------------------------------------------
    def submit(self, req: EngineRequest, sink: OutputSink) -> _Handle:
        if not self._running or self.broken:
            raise EngineError(f"engine is not running{': ' if self.broken else ''}{self.broken}")
        pd = ""  # a bootstrap on an engine with no handoff is served aggregated
        if req.bootstrap is not None and self.handoff is not None:
            pd = self.handoff.role
        seq = self.new_sequence(req, pd)
        seq.sink = sink
        if isinstance(seq.grammar, Deferred):  # its pages once its grammar is compiled
            self._compiles.start(seq.grammar, partial(self._admit, seq, pd),
                                 partial(self.failed, seq), seq, req.tenant)
        else:
            self._admit(seq, pd)
        return _Handle(self, seq)

    def _admit(self, seq: Sequence, pd: str, grammar: Any = None) -> None:
        if grammar is not None:  # (compiled for it: tandem.engines.grammars)
            seq.grammar = grammar
        reserved: list[Sequence] = []
        with self._lock:
            self.sched.add(seq)
            if pd == "decode":  # its pages now, if it is next: the fetch starts mid-step
                reserved = self.sched.reserve_waiting()
            self._notify()
        if pd == "prefill":
            assert self.handoff is not None
            self.handoff.submitted(seq)
        elif reserved:
            self._reserved(reserved)

    def cancel(self, seq: Sequence) -> None:
        """No output after this; pages back at once, after the step computing on them, or (in a
        KV handoff) once no transfer can write into them."""
        with self._lock:
            if seq.done:
                return
            seq.done = seq.cancelled = True
        if self._compiles.drop(seq):  # (compiling: it holds nothing yet)
            return
        if seq.handoff is not None and self.handoff is not None:
            self.handoff.cancel(seq)
        else:
            self.free(seq)

    def load(self) -> Load:
        with self._lock:
            return self.sched.load()

    # --- what the handoff calls (tandem.engines.handoff.Host), on the loop; then the step -------
    def free(self, seq: Sequence, reason: FinishReason = "abort") -> None:
        """Its pages are safe to reuse: give them back (after its step, if one computes now)."""
        with self._lock:
            seq.handoff = None
            if seq.in_flight or seq.status is SeqStatus.FINISHED:
                return  # postprocess frees it
            self.sched.finish(seq, reason)
            self._notify()

    def joined(self, seq: Sequence, first: int, logprobs: TokenLogprobs | None = None,
               cached_tokens: int = 0) -> None:
        """Decode: the prompt's K/V is in place; the request runs on from `first`, which is
        postprocessed as a step's token is (`cached_tokens`: what the prefill side had cached)."""
        seq.cached_tokens = cached_tokens
        with self._lock:
            seq.handoff = None
            if seq.done or self._closed:
                self.sched.finish(seq, "abort")  # nothing writes into the pages any more
                self._notify()
                return
            self.sched.join(seq)
            step = self._postprocess([seq], [first], [logprobs], None)
        self._events(step)
        deliver(self.name, step.items, self._cumulative)

    def written(self, seq: Sequence, first: int, logprobs: TokenLogprobs | None = None) -> None:
        """Prefill: the K/V is in the decode engine's pages; the request ends with `first`."""
        with self._lock:
            last = last_output(seq)
            if last:
                seq.output_ids.append(first)
                if seq.logprobs is not None and logprobs is not None:
                    seq.logprobs.append(logprobs)
        if last:
            lps = seq.logprobs
            out = EngineOutput(seq.rid, [first], "length", len(seq.prompt_ids),
                               len(seq.output_ids), seq.cached_tokens, None,
                               None if lps is None else lps[-1:])
            deliver(self.name, [(seq, out)], self._cumulative)
        self.free(seq, "length")

    def failed(self, seq: Sequence, error: EngineError) -> None:
        """The request ends with `error` (its pages are the caller's to free)."""
        with self._lock:
            last = last_output(seq)
        if last:
            deliver(self.name, [(seq, ending(seq, "error", error))], self._cumulative)
