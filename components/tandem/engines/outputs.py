"""A Stepper's outputs (tandem.engines.stepper): what a step hands to the loop (`Step`), an output
that ends a request with no new id, and delivering a step's with one `on_step` call per sink. (What
a step's tokens do to their sequences, and their outputs, is `Stepper._postprocess`.)

Outputs are made incremental: the new ids, and their logprobs, in lists of their own (the step
already holds them); that is the default of tandem's engines. In cumulative mode `deliver` hands
out the sequence's own growing lists instead (`output_ids`, and `logprobs` when asked for): no copy
per token; a consumer bounds them by `completion_tokens` (tandem.worker.deltas).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tandem.engines.base import EngineError, EngineOutput, OutputSink
from tandem.engines.scheduler import Sequence
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


def ending(seq: Sequence, reason: FinishReason, error: EngineError | None = None) -> EngineOutput:
    """An output that ends `seq` with no new id (aborted, failed)."""
    return EngineOutput(seq.rid, [], reason, len(seq.prompt_ids), len(seq.output_ids), 0, error,
                        None if seq.logprobs is None else [])


def deliver(engine: str, items: Items, cumulative: bool) -> None:
    """Hand outputs to their sequences' sinks: one on_step call per sink. Outputs are made
    incremental; in cumulative mode they leave with their sequences' own growing lists instead
    (the one place the mode matters here: counts were fixed when the outputs were made)."""
    if not items:
        return
    if cumulative:
        for seq, out in items:
            out.output_ids = seq.output_ids
            if out.logprobs is not None:
                out.logprobs = seq.logprobs
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
