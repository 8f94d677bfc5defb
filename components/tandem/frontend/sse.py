"""Server-sent events as the OpenAI streaming API writes them: `data: {json}\\n\\n` per chunk and a
final `data: [DONE]\\n\\n`.

`ChunkEncoder` holds one request's chunk prefix and suffix as bytes, so the per-chunk hot path is
one JSON encode of the new text between two constant byte strings. The bytes equal what encoding
the `openai_api` chunk Structs gives (a unit test holds them to that). `RichChunkEncoder` is the
one a request gets when its chunks carry more (logprobs, usage in every chunk): it encodes the
Structs, so a plain stream never pays for what it did not ask for.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import msgspec

from tandem.frontend import schemas

DONE = b"data: [DONE]\n\n"
HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

_encode = msgspec.json.Encoder().encode
_FINISH: dict[str | None, bytes] = {None: b"null", "stop": b'"stop"', "length": b'"length"',
                                    "abort": b'"abort"'}

Kind = Literal["chat", "completion"]


def event(obj: Any) -> bytes:
    """One SSE event carrying `obj` as JSON."""
    return b"data: " + _encode(obj) + b"\n\n"


class ChunkEncoder:
    """Encodes one request's streamed chunks (`chat.completion.chunk` or `text_completion`)."""

    __slots__ = ("kind", "rid", "created", "model", "index", "_head", "_mid", "_tail")

    def __init__(self, kind: Kind, rid: str, created: int, model: str, index: int = 0):
        self.kind = kind
        self.index = index
        self.rid = rid
        self.created = created
        self.model = model
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = (b'data: {"id":' + _encode(rid) + b',"object":"' + obj.encode() + b'","created":'
                + str(created).encode() + b',"model":' + _encode(model) + b',"choices":[{"index":'
                + str(index).encode() + b",")
        if kind == "chat":
            self._head = head + b'"delta":{"content":'
            self._mid = b'},"logprobs":null,"finish_reason":'
        else:
            self._head = head + b'"text":'
            self._mid = b',"logprobs":null,"finish_reason":'
        self._tail = self._mid + b"null}]}\n\n"  # (a chunk that does not finish)

    def text(self, text: str, finish: str | None = None) -> bytes:
        """A chunk carrying new text (and, on the last one, the finish reason)."""
        if finish is None:
            return self._head + _encode(text) + self._tail  # (faster than % or join here)
        fin = _FINISH.get(finish)
        if fin is None:
            fin = _encode(finish)
        return self._head + _encode(text) + self._mid + fin + b"}]}\n\n"

    def role(self) -> bytes:
        """The chat stream's first chunk: the assistant role and empty content."""
        return event(schemas.ChatCompletionChunk(
            self.rid, "chat.completion.chunk", self.created, self.model,
            [schemas.ChatChunkChoice(self.index, schemas.ChatDelta(role="assistant", content=""), None,
                                 None)]))

    def finish(self, finish: str) -> bytes:
        """A last chunk with no new text: chat sends an empty delta, as OpenAI does."""
        if self.kind == "completion":
            return self.text("", finish)
        return event(schemas.ChatCompletionChunk(
            self.rid, "chat.completion.chunk", self.created, self.model,
            [schemas.ChatChunkChoice(self.index, schemas.ChatDelta(), None, finish)]))

    def tool_call(self, arguments: str, call_id: str | None = None,
                  name: str | None = None) -> bytes:
        """A chat chunk carrying a part of the choice's tool call (`delta.tool_calls`, index 0):
        its first part names it (`call_id`, `name`), every part adds to its arguments."""
        call = schemas.ToolCallDelta(0, call_id, None if call_id is None else "function",
                                     schemas.FunctionCallDelta(name, arguments))
        return event(schemas.ChatCompletionChunk(
            self.rid, "chat.completion.chunk", self.created, self.model,
            [schemas.ChatChunkChoice(self.index, schemas.ChatDelta(tool_calls=[call]), None,
                                     None)]))

    def usage(self, usage: schemas.UsageInfo) -> bytes:
        """The `stream_options.include_usage` chunk: empty choices, the request's usage."""
        if self.kind == "chat":
            return event(schemas.ChatCompletionChunk(self.rid, "chat.completion.chunk", self.created,
                                                 self.model, [], usage))
        return event(schemas.Completion(self.rid, "text_completion", self.created, self.model, [],
                                    usage))


class ChunkExtras(Protocol):
    """What a RichChunkEncoder asks its choice for, per chunk."""

    def take_logprobs(self) -> schemas.ChatLogprobs | schemas.CompletionLogprobs | None: ...

    def usage_now(self) -> schemas.UsageInfo | None: ...


class RichChunkEncoder(ChunkEncoder):
    """Chunks that carry the logprobs of their tokens and/or the usage so far."""

    __slots__ = ("extras",)

    def __init__(self, kind: Kind, rid: str, created: int, model: str, index: int,
                 extras: ChunkExtras):
        super().__init__(kind, rid, created, model, index)
        self.extras = extras

    def _chunk(self, text: str | None, finish: str | None) -> bytes:
        x = self.extras
        lp = x.take_logprobs()
        if self.kind == "chat":
            assert lp is None or isinstance(lp, schemas.ChatLogprobs)
            delta = schemas.ChatDelta() if text is None else schemas.ChatDelta(content=text)
            return event(schemas.ChatCompletionChunk(
                self.rid, "chat.completion.chunk", self.created, self.model,
                [schemas.ChatChunkChoice(self.index, delta, lp, finish)], x.usage_now()))
        assert lp is None or isinstance(lp, schemas.CompletionLogprobs)
        return event(schemas.Completion(
            self.rid, "text_completion", self.created, self.model,
            [schemas.CompletionChoice(self.index, text or "", lp, finish)], x.usage_now()))

    def text(self, text: str, finish: str | None = None) -> bytes:
        return self._chunk(text, finish)

    def finish(self, finish: str) -> bytes:
        return self._chunk(None, finish)
