"""A Stepper's outputs (tandem.engines.stepper): what a step hands to the loop (`Step`), a
sequence's step result off the common path (`step_rare`; the common one is inline in the
Stepper), making one output, and delivering a step's with one `on_step` call per sink.

Cumulative mode hands out the sequence's own growing lists (`output_ids`, and `logprobs` when asked
for): no copy per token; a consumer bounds them by `completion_tokens` (tandem.worker.deltas).
Incremental mode hands out the new ids and their logprobs only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tandem.engines.base import EngineError, EngineOutput, OutputSink
from tandem.engines.scheduler import Scheduler, Sequence, SeqStatus
from tandem.runtime.wire import FinishReason, TokenLogprobs

log = logging.getLogger("tandem.engine")

Items = list[tuple[Sequence, EngineOutput]]


@dataclass(slots=True)
class Step:
    """What a step hands to the loop: outputs to deliver, prefills whose first token (and its
    logprobs) was sampled, PD requests that failed. (Decode requests whose pages a schedule
    reserved are handed over before the step runs: `Stepper._reserved`.)"""

    items: Items = field(default_factory=list)
    computed: list[tuple[Sequence, int, TokenLogprobs | None]] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)


def step_rare(engine: str, sched: Scheduler, cumulative: bool, step: Step, seq: Sequence,
              token: int, lp: TokenLogprobs | None) -> None:
    """A sequence's step result off the Stepper's common path (under its lock): cancelled or
    failed meanwhile, a prefill-only one, or one with logprobs."""
    if seq.done or seq.status is SeqStatus.FINISHED:  # cancelled or failed meanwhile
        sched.finish(seq, "abort")
        return
    seq.num_cached = seq.num_tokens
    if seq.pd == "prefill":  # first token sampled: the KV handoff takes it from here
        sched.to_sending(seq)
        step.computed.append((seq, token, lp))
        return
    if seq.logprobs is not None:  # (appended before the output can be read)
        if lp is None:  # the compute hook's bug: fail the request, not the engine
            sched.finish(seq, "error")
            seq.done = True
            step.items.append((seq, make_output(seq, [], "error", cumulative, EngineError(
                f"{engine} engine: the step computed no logprobs for {seq.rid}"))))
            return
        seq.logprobs.append(lp)
    finish = seq.finish_after(token)
    if finish is not None:
        sched.finish(seq, finish)
        seq.done = True
    step.items.append((seq, make_output(seq, [token], finish, cumulative)))


def make_output(seq: Sequence, new: list[int], finish: FinishReason | None, cumulative: bool,
                error: EngineError | None = None) -> EngineOutput:
    """`seq`'s output now; `new` are the ids it got since its last one."""
    lps = seq.logprobs
    if lps is not None and not cumulative:
        lps = lps[len(lps) - len(new):]
    return EngineOutput(seq.rid, seq.output_ids if cumulative else new, finish,
                        len(seq.prompt_ids), len(seq.output_ids), 0, error, lps)


def deliver(engine: str, items: Items) -> None:
    """Hand outputs to their sequences' sinks: one on_step call per sink."""
    if not items:
        return
    sink = items[0][0].sink
    outs = [out for seq, out in items if seq.sink is sink]
    if len(outs) == len(items):  # the usual case: one sink (the worker)
        try:
            sink.on_step(outs)
        except Exception:  # a consumer's bug must not stop the engine
            log.exception("%s engine: output sink failed", engine)
        return
    groups: dict[int, tuple[OutputSink, list[EngineOutput]]] = {}
    for seq, out in items:  # (usually one group: the worker)
        group = groups.get(id(seq.sink))
        if group is None:
            group = groups[id(seq.sink)] = (seq.sink, [])
        group[1].append(out)
    for sink, outs in groups.values():
        try:
            sink.on_step(outs)
        except Exception:  # a consumer's bug must not stop the engine
            log.exception("%s engine: output sink failed", engine)
