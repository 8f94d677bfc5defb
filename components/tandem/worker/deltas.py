"""The decode handler's one job: turn engine outputs into deltas (ARCHITECTURE.md, "Decode
handler").

Cumulative outputs (all ids so far; SGLang hands out a live list) are sliced by the count already
sent, which copies at once and bounds the slice by `completion_tokens` so a list that grew after
the output was made cannot leak extra ids. Incremental outputs (only new ids: tandem's own engines
by default) pass through uncopied: the engine contract (tandem.engines.base) makes them the
consumer's. Every delta carries its offset; `offset + len(token_ids) == completion_tokens` is
checked on each one. Logprobs, when the request asked for them, follow the ids exactly: sliced the
same way, one per token (checked), in a list of the delta's own (merging extends it in place:
`Delta.extend`). SGLang's item edges (its abort echo) are handled before this, in
tandem.engines.sglang_stream.
"""

from __future__ import annotations

from tandem.engines.base import EngineError, EngineOutput
from tandem.runtime.wire import Delta, OutputMode, Usage


class DeltaMaker:
    __slots__ = ("rid", "cumulative", "sent")

    def __init__(self, rid: str, mode: OutputMode) -> None:
        self.rid = rid
        self.cumulative = mode == "cumulative"
        self.sent = 0

    def make(self, out: EngineOutput) -> Delta | None:
        """The delta for one output, or None when it carries no new token and no finish.
        (Called once per output: the worker's one path, kept short.)"""
        offset, end = self.sent, out.completion_tokens
        new = out.output_ids[offset:end] if self.cumulative else out.output_ids
        if offset + len(new) != end:
            raise EngineError(f"{self.rid}: engine output out of step: sent "
                              f"{offset + len(new)} tokens but engine says {end}")
        lps = out.logprobs
        if lps is not None:
            if self.cumulative:
                lps = lps[offset:end]
            if len(lps) != len(new):
                raise EngineError(f"{self.rid}: engine output has {len(lps)} logprobs for "
                                  f"{len(new)} tokens")
        self.sent = end
        if out.finish_reason is None:
            if offset or not out.cached_tokens:
                return Delta(self.rid, offset, new, logprobs=lps) if new else None
            # (the first delta says how much of the prompt was cached: a stream a stop string
            # ends early never reads the last one)
            return Delta(self.rid, 0, new, None, Usage(out.prompt_tokens, end, out.cached_tokens),
                         logprobs=lps) if new else None
        usage = Usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        return Delta(self.rid, offset, new, out.finish_reason, usage, logprobs=lps)
