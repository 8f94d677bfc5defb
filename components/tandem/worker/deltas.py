"""The decode handler's one job: turn engine outputs into deltas (ARCHITECTURE.md, "Decode
handler").

Cumulative outputs (all ids so far; SGLang hands out a live list) are sliced by the count already
sent, which copies at once and bounds the slice by `completion_tokens` so a list that grew after
the output was made cannot leak extra ids. Incremental outputs (only new ids) pass through. Every
delta carries its offset; `offset + len(token_ids) == completion_tokens` is checked on each one.
Logprobs, when the request asked for them, follow the ids exactly: sliced the same way, one per
token (checked), in a list of the delta's own (merging extends it in place: `Delta.extend`).
"""

from __future__ import annotations

from tandem.engines.base import EngineError, EngineOutput
from tandem.runtime.wire import Delta, OutputMode, Usage


class DeltaMaker:
    __slots__ = ("rid", "cumulative", "sent", "_last_id")

    def __init__(self, rid: str, mode: OutputMode) -> None:
        self.rid = rid
        self.cumulative = mode == "cumulative"
        self.sent = 0
        self._last_id: int | None = None

    def make(self, out: EngineOutput) -> Delta | None:
        """The delta for one output, or None when it carries no new token and no finish."""
        offset = self.sent
        if self.cumulative and out.finish_reason is None and out.logprobs is None:
            end = out.completion_tokens  # the common case, inline (once per token)
            new = out.output_ids[offset:end]
            if offset + len(new) != end:
                raise EngineError(f"{self.rid}: engine output out of step: sent "
                                  f"{offset + len(new)} tokens but engine says {end}")
            self.sent = end
            return Delta(self.rid, offset, new) if new else None
        if self.cumulative:
            new = out.output_ids[offset : out.completion_tokens]
        else:
            new = list(out.output_ids)
            # SGLang's abort chunk in incremental mode repeats the last id it already sent.
            if (
                out.finish_reason == "abort"
                and new
                and offset + len(new) > out.completion_tokens
                and new[-1] == self._last_id
            ):
                new = new[: out.completion_tokens - offset]
        self.sent = offset + len(new)
        if self.sent != out.completion_tokens:
            raise EngineError(
                f"{self.rid}: engine output out of step: sent {self.sent} tokens but engine says "
                f"{out.completion_tokens}"
            )
        if new:
            self._last_id = new[-1]
        lps = out.logprobs
        if lps is not None:
            lps = lps[offset : self.sent] if self.cumulative else lps[len(lps) - len(new):]
            if len(lps) != len(new):
                raise EngineError(f"{self.rid}: engine output has {len(lps)} logprobs for "
                                  f"{len(new)} tokens")
        if out.finish_reason is None:
            return Delta(self.rid, offset, new, logprobs=lps) if new else None
        usage = Usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        return Delta(self.rid, offset, new, out.finish_reason, usage, logprobs=lps)
