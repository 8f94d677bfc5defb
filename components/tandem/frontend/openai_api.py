"""The OpenAI response builders, and the rendering of token logprobs into OpenAI's chat and
completions logprobs objects. The request and response bodies are tandem.frontend.schemas; their
decoding and validation, tandem.frontend.validate (every refusal is `errors.BadRequest` naming the
offending `param`).

Logprobs come from the engine (`wire.TokenLogprobs` on each delta); a token's text is what the
tokenizer makes of that one token (`TokenTexts`), its `bytes` the token's own bytes, so a
character a byte-level tokenizer split across tokens still adds up.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import msgspec

from tandem.frontend.schemas import (ChatChoice, ChatCompletion, ChatLogprobs, Completion,
                                     CompletionChoice, CompletionLogprobs, PromptTokensDetails,
                                     ResponseMessage, TokenLogprob, ToolCall, TopLogprob,
                                     UsageInfo)
from tandem.runtime.wire import TokenLogprobs

__all__ = ["LogprobsJson", "TokenTexts", "chat_completion", "chat_completion_choices",
           "chat_logprobs", "completion_logprobs", "new_id", "text_completion",
           "text_completion_choices", "usage_info"]

TokenTexts = Callable[[int], tuple[str, bytes]]
"""token id -> (its text, its bytes): tandem.frontend.detokenizer.DetokenizerFactory.token."""


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    return UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                     PromptTokensDetails(cached_tokens))


def chat_logprobs(lps: Sequence[TokenLogprobs], token: TokenTexts) -> ChatLogprobs:
    content: list[TokenLogprob] = []
    for lp in lps:
        text, raw = token(lp.token_id)
        top = []
        for tid, value in lp.top:
            t, b = token(tid)
            top.append(TopLogprob(t, value, list(b)))
        content.append(TokenLogprob(text, lp.logprob, list(raw), top))
    return ChatLogprobs(content)


def completion_logprobs(lps: Sequence[TokenLogprobs], token: TokenTexts,
                        offset: int = 0) -> CompletionLogprobs:
    """`offset`: characters of text before the first of these tokens (their `text_offset`)."""
    out = CompletionLogprobs([], [], [], [])
    for lp in lps:
        text, _ = token(lp.token_id)
        out.text_offset.append(offset)
        offset += len(text)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for tid, value in lp.top:
            top.setdefault(token(tid)[0], value)
        out.top_logprobs.append(top)
    return out


_encode = msgspec.json.Encoder().encode
_HOLE = b"\x00"  # never in msgspec's JSON, which escapes control characters in strings


class LogprobsJson:
    """One choice's logprobs object (ChatLogprobs or CompletionLogprobs) for a response that is
    not streamed, rendered to JSON as its tokens arrive: the response's end then costs a join,
    not the objects of every token at once (at n=64 and top_logprobs=20 that held the event loop
    for seconds). Made from the object with no tokens; `add(part)` renders the next tokens' object
    (as chat_logprobs or completion_logprobs make it); `raw()` is the JSON of all of them as one
    object, to put in the response where the object goes, once."""

    __slots__ = ("names", "shell", "parts")

    def __init__(self, empty: ChatLogprobs | CompletionLogprobs) -> None:
        # The object's JSON with a hole where each of its lists goes; each list's items, by part.
        self.names = [f for f in empty.__struct_fields__ if isinstance(getattr(empty, f), list)]
        holes = dict.fromkeys(self.names, msgspec.Raw(_HOLE))
        self.shell = _encode(msgspec.structs.replace(empty, **holes)).split(_HOLE)
        self.parts: list[list[bytes]] = [[] for _ in self.names]

    def add(self, part: ChatLogprobs | CompletionLogprobs | None) -> None:
        if part is None:
            return
        for items, name in zip(self.parts, self.names):
            values = getattr(part, name)
            if values:
                items.append(_encode(values)[1:-1])  # (without the list's brackets)

    def raw(self) -> msgspec.Raw:
        out = [self.shell[0]]
        for items, after in zip(self.parts, self.shell[1:]):
            out += (b"[", b",".join(items), b"]", after)
            items.clear()
        return msgspec.Raw(b"".join(out))


def chat_completion(rid: str, created: int, model: str, text: str, finish: str | None,
                    usage: UsageInfo) -> ChatCompletion:
    return ChatCompletion(rid, "chat.completion", created, model,
                          [ChatChoice(0, ResponseMessage("assistant", text), None, finish)], usage)


def text_completion(rid: str, created: int, model: str, text: str, finish: str | None,
                    usage: UsageInfo | None) -> Completion:
    return Completion(rid, "text_completion", created, model,
                      [CompletionChoice(0, text, None, finish)], usage)


def chat_completion_choices(rid: str, created: int, model: str,
                            outs: list[tuple[str, str | None]], usage: UsageInfo,
                            logprobs: Sequence[ChatLogprobs | msgspec.Raw | None] = (),
                            tool_calls: Sequence[list[ToolCall] | None] = ()
                            ) -> ChatCompletion:
    """Several choices, `outs[index] = (text, finish_reason)`; a choice with `tool_calls` has
    them instead of content."""
    lps = list(logprobs) or [None] * len(outs)
    calls = list(tool_calls) or [None] * len(outs)
    return ChatCompletion(rid, "chat.completion", created, model,
                          [ChatChoice(i, ResponseMessage("assistant", text) if calls[i] is None
                                      else ResponseMessage("assistant", None, calls[i]),
                                      lps[i], fin)
                           for i, (text, fin) in enumerate(outs)], usage)


def text_completion_choices(rid: str, created: int, model: str,
                            outs: list[tuple[str, str | None]], usage: UsageInfo,
                            logprobs: Sequence[CompletionLogprobs | msgspec.Raw | None] = ()
                            ) -> Completion:
    lps = list(logprobs) or [None] * len(outs)
    return Completion(rid, "text_completion", created, model,
                      [CompletionChoice(i, text, lps[i], fin)
                       for i, (text, fin) in enumerate(outs)], usage)
