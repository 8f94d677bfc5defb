"""A Stepper's outputs (tandem.engines.stepper): what a step hands to the loop (`Step`), making
one output, and delivering a step's with one `on_step` call per sink. (What a step's tokens do to
their sequences, the postprocess, is `Stepper._postprocess`.)

Incremental mode (the default of tandem's engines) hands out the new ids and their logprobs only,
in lists of their own: the step already holds them. Cumulative mode hands out the sequence's own
growing lists (`output_ids`, and `logprobs` when asked for): no copy per token; a consumer bounds
them by `completion_tokens` (tandem.worker.deltas).
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
