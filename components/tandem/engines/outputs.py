"""A Stepper's outputs (tandem.engines.stepper): the one postprocess (`postprocess`: what a step's
tokens do to their sequences, and their outputs), what a step hands to the loop (`Step`), an
output that ends a request with no new id, and delivering a step's with one `on_step` call per
sink.

Outputs are made incremental: the new ids, and their logprobs, in lists of their own (the step
already holds them); that is the default of tandem's engines. In cumulative mode `deliver` hands
out the sequence's own growing lists instead (`output_ids`, and `logprobs` when asked for): no copy
per token; a consumer bounds them by `completion_tokens` (tandem.worker.deltas).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tandem.engines.base import EngineError, EngineOutput, OutputSink
from tandem.engines.scheduler import Scheduler, Sequence, SeqStatus
from tandem.runtime.kv_events import KvEvent
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
    events: list[KvEvent] = field(default_factory=list)  # the pool's, since the last step
    broken: str = ""  # the page accounting check failed after this step (why)


def ending(seq: Sequence, reason: FinishReason, error: EngineError | None = None) -> EngineOutput:
    """An output that ends `seq` with no new id (aborted, failed)."""
    return EngineOutput(seq.rid, [], reason, len(seq.prompt_ids), len(seq.output_ids),
                        seq.cached_tokens, error, None if seq.logprobs is None else [])


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


def postprocess(name: str, sched: Scheduler, seqs: list[Sequence], tokens: list[int],
                lps: list[TokenLogprobs | None] | None, error: Exception | None) -> Step:
    """The one postprocess (under the engine's lock), for a step's tokens and a decode request's
    first: each token recorded, the finish rule applied (written here once), computed full pages
    cached, finished requests' pages freed, outputs made; a prefill-only request's first token
    goes to the KV handoff."""
    step = Step()
    if error is not None:
        log.error("%s engine step failed: %r", name, error)
        err = EngineError(f"{name} engine step failed: {error!r}")
        for seq in seqs:
            seq.in_flight = False
            if last_output(seq):
                step.items.append((seq, ending(seq, "error", err)))
            if seq.handoff is not None:
                step.failed.append(seq)  # the handoff tells its peer, then frees the pages
            else:
                sched.finish(seq, "error")
        return step
    items, finished = step.items, SeqStatus.FINISHED
    for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
        seq.in_flight = False
        if seq.done or seq.status is finished:  # cancelled or failed meanwhile
            sched.finish(seq, "abort")
            continue
        out = seq.output_ids
        n_prompt = len(seq.prompt_ids)
        if not sched.samples(seq):  # a prompt's chunk, not its last: no token (the step's
            seq.num_cached = seq.prefill_end  # for it is not one)
            continue
        seq.num_cached = n_prompt + len(out)  # the K/V of every token before this one
        if seq.num_cached >= seq.publish_at:  # its prompt is computed: cache its full pages
            sched.publish(seq)
        if seq.pd == "prefill":  # first token sampled: the KV handoff takes it from here
            sched.to_sending(seq)
            step.computed.append((seq, token, lps[i] if lps is not None else None))
            continue
        if seq.grammar is not None and not seq.grammar.accept(token):  # (its other side's token)
            sched.finish(seq, "error")
            seq.done = True
            items.append((seq, ending(seq, "error", EngineError(
                f"{name} engine: token {token} does not follow the grammar of {seq.rid}"))))
            continue
        new_lps: list[TokenLogprobs] | None = None
        if seq.logprobs is not None:  # (appended before the output can be read)
            lp = lps[i] if lps is not None else None
            if lp is None:  # the compute hook's bug: fail the request, not the engine
                sched.finish(seq, "error")
                seq.done = True
                items.append((seq, ending(seq, "error", EngineError(
                    f"{name} engine: the step computed no logprobs for {seq.rid}"))))
                continue
            seq.logprobs.append(lp)
            new_lps = [lp]
        out.append(token)
        n = len(out)
        finish: FinishReason | None = None  # the finish rule
        if token in seq.stop_ids and seq.resume + n >= seq.sampling.min_tokens:
            finish = "stop"
        elif n_prompt + n >= seq.max_total:
            finish = "length"
        if finish is not None:
            if sched.pool.caching:  # the pages its completion filled
                sched.publish(seq)
            sched.finish(seq, finish)
            seq.done = True
        items.append((seq, EngineOutput(seq.rid, [token], finish, n_prompt, n,
                                        seq.cached_tokens, None, new_lps)))
    return step


def last_output(seq: Sequence) -> bool:
    """Whether `seq` may still get its last output (and mark that it got it)."""
    last, seq.done = not seq.done, True
    return last
