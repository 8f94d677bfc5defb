"""The two drivers of the step loop the mock and the reference engine share (tandem.engines.stepper
owns the engine around them): schedule -> compute -> postprocess, then the step handed to the
loop.

On the loop (`run`, the mock): the step is a task that awaits `run`. On a step thread (`compute`,
the reference engine): the thread schedules, computes and postprocesses, and hands the step to
the loop with ONE `call_soon_threadsafe`, which delivers it with one `on_step` per sink; the
thread goes on with the next step at once. Either way the scheduler and the pool are touched under
`_lock`, a step's sequences are in flight while it computes, and their pages are not freed until
it ends. What a step hands over, on the loop: its KV events (to `on_kv_events`), a failed page
check (the process goes down), its handoff events, then its outputs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from tandem.engines.handoff import Handoff
from tandem.engines.outputs import Step, deliver, postprocess
from tandem.engines.pages import PagePool
from tandem.engines.scheduler import Batch, Scheduler, Sequence, SeqStatus
from tandem.runtime import timeline
from tandem.runtime.errors import PagePoolError
from tandem.runtime.kv_events import KvEvent
from tandem.runtime.lifecycle import crash
from tandem.runtime.wire import TokenLogprobs

__all__ = ["BROKEN", "IDLE_WAIT_S", "StepDrivers"]

IDLE_WAIT_S = 0.5  # an idle step thread re-checks for work this often, even without a wake-up
BROKEN: list[str] = []  # every failed check of this process, for the test suite to assert on


class StepDrivers:
    """The step loop of tandem.engines.stepper.Stepper, which sets everything declared here."""

    name: str
    step_thread: bool
    pool: PagePool
    sched: Scheduler
    handoff: Handoff | None
    check_pages: bool
    broken: str
    _lock: threading.Condition
    _wake: asyncio.Event
    _stopping: bool
    _closed: bool
    _cumulative: bool
    _on_kv_events: Callable[[list[KvEvent]], None] | None

    @property
    def on_kv_events(self) -> Callable[[list[KvEvent]], None] | None:
        """Who takes the KV events of each step (the worker's publisher); while nobody does, the
        pool does not record them."""
        return self._on_kv_events

    @on_kv_events.setter
    def on_kv_events(self, take: Callable[[list[KvEvent]], None] | None) -> None:
        self._on_kv_events = take
        self.pool.recording = take is not None

    # --- hooks ------------------------------------------------------------------------------------
    async def run(self, batch: Batch) -> list[int]:
        """Loop driver: compute one step, one sampled token per sequence of `batch.all()`."""
        raise NotImplementedError

    def compute(self, batch: Batch) -> list[int]:
        """Thread driver: the same, on the step thread."""
        raise NotImplementedError

    def _notify(self) -> None:
        """There may be work (called holding the lock)."""
        if self.step_thread:
            self._lock.notify()
        else:
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            with self._lock:
                batch = self.sched.schedule()
            seqs = batch.all()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            if batch.reserved:  # (their fetches need no step: they start now)
                self._reserved(batch.reserved)
            tokens: list[int] = []
            error: Exception | None = None
            if seqs:
                if timeline.ON:
                    self._mark(batch)
                try:
                    tokens = await self.run(batch)
                except Exception as e:  # a failing step fails its requests, not the engine
                    error = e
            with self._lock:
                step = self._postprocess(seqs, tokens, batch.logprobs, error)
            if seqs and timeline.ON:
                timeline.mark("end")
            self._handed_over(step)

    def _thread_main(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            with self._lock:
                while not self._stopping:
                    batch = self.sched.schedule()
                    if batch:
                        break
                    self._lock.wait(IDLE_WAIT_S)
                else:
                    return
            seqs = batch.all()
            if batch.reserved:  # (their fetches need no step: they start now)
                try:
                    loop.call_soon_threadsafe(self._reserved, batch.reserved)
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    return
            tokens: list[int] = []
            error: Exception | None = None
            if seqs:
                if timeline.ON:
                    self._mark(batch)
                try:
                    tokens = self.compute(batch)
                except Exception as e:
                    error = e
            with self._lock:
                step = self._postprocess(seqs, tokens, batch.logprobs, error)
            if seqs and timeline.ON:
                timeline.mark("end")
            try:
                loop.call_soon_threadsafe(self._handed_over, step)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                return

    @staticmethod
    def _mark(batch: Batch) -> None:
        """A step begins (tandem.runtime.timeline)."""
        timeline.mark("step", Scheduler.prefill_tokens(batch), len(batch.decode),
                      *(s.rid for s in batch.prefill))

    def _postprocess(self, seqs: list[Sequence], tokens: list[int],
                     lps: list[TokenLogprobs | None] | None, error: Exception | None) -> Step:
        """The one postprocess (tandem.engines.outputs), under the lock."""
        step = postprocess(self.name, self.sched, seqs, tokens, lps, error)
        self._notify()
        pool = self.pool
        step.events = pool.take_events()  # (the pool's KV events go with the step)
        if self.check_pages:
            try:
                pool.check()
            except PagePoolError as e:
                step.broken = str(e)
        return step

    def _events(self, step: Step) -> None:
        """On the loop: hand the step's KV events on; act on a failed check."""
        if step.events and self.on_kv_events is not None:
            self.on_kv_events(step.events)
        if step.broken and not self.broken:
            self.broken = f"{self.name} engine: {step.broken}"
            BROKEN.append(self.broken)
            crash(self.broken)

    def _reserved(self, seqs: list[Sequence]) -> None:
        """On the loop: decode requests whose pages were reserved; their K/V is fetched now."""
        handoff = self.handoff
        if handoff is None or self._closed:
            return
        for seq in seqs:
            if seq.status is SeqStatus.FETCHING:  # (not cancelled since)
                handoff.admitted(seq, seq.pages[seq.skip: self.pool.pages_for(seq.num_tokens)])

    def _handed_over(self, step: Step) -> None:
        """On the loop: the step's handoff events, then its outputs (none for a request
        cancelled since the step made them)."""
        self._events(step)
        handoff = self.handoff
        if handoff is not None:
            for seq, token, lp in step.computed:
                handoff.computed(seq, token, lp)
            for seq in step.failed:
                handoff.cancel(seq)
        items = step.items
        if self.step_thread:
            items = [item for item in items if not item[0].cancelled]
        deliver(self.name, items, self._cumulative)
