"""Incremental detokenization of one request's output tokens, with stop strings.

Two promises to the client: a chunk never carries a broken UTF-8 character (bytes of a character
that byte-level BPE split across tokens are held back until it completes), and a chunk never
carries part of a stop string (the last `max(len(stop)) - 1` characters are held back; when a stop
string completes, the text is cut before it and `Detokenizer.stopped` turns true so the caller
leaves the request's stream, which aborts it on the worker).

Each step costs O(new tokens), not O(tokens so far):
- byte-level tokenizers (GPT-2/Llama-3/Qwen style, `decoders.ByteLevel`) map every token id to its
  bytes once, at load, and feed those bytes to Python's incremental UTF-8 decoder (a token that
  is whole characters by itself, with nothing pending, is its text from a table made at load);
- any other tokenizer decodes a small window — the tokens of the previous emission plus the new
  ones — and emits the difference (vLLM's prefix/read offsets), so decoders that strip a leading
  space (SentencePiece) see the same context the full decode would.

"First stop string" means the one whose occurrence ends first (ties: the longer one), so the
result does not depend on how the tokens were chunked.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer, decoders

# How many prompt tokens the windowed decoder keeps as context for the first output tokens.
CONTEXT_TOKENS = 5
# The windowed decoder drops consumed ids once this many have piled up before its window.
_TRIM_AT = 256


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def byte_table(tokenizer: Tokenizer, skip_special_tokens: bool = True) -> list[bytes]:
    """Bytes of every token id of a byte-level tokenizer, as `tokenizer.decode` would produce them
    before UTF-8 decoding. Special tokens map to b"" when skipped. Added tokens go through the
    ByteLevel decoder like any other (that is what `tokenizers` does)."""
    to_byte = _byte_level_chars()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    table: list[bytes] = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        piece = tokenizer.id_to_token(i)
        if piece is None or (skip_special_tokens and i in special):
            table.append(b"")
            continue
        out = bytearray()
        for ch in piece:
            b = to_byte.get(ch)
            if b is None:
                out += ch.encode()
            else:
                out.append(b)
        table.append(bytes(out))
    return table


class _TextSource(Protocol):
    def feed(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


def text_table(table: list[bytes]) -> list[str | None]:
    """Each token's text where its bytes are whole UTF-8 characters by themselves (None where
    they are not: part of a character), so the common step, one token and nothing pending,
    is one list lookup."""
    out: list[str | None] = []
    for raw in table:
        try:
            out.append(raw.decode())
        except UnicodeDecodeError:
            out.append(None)
    return out


class _ByteLevelText:
    """Token bytes through an incremental UTF-8 decode: the bytes of an incomplete character wait
    in `_pending` until it completes (or the request finishes)."""

    __slots__ = ("_table", "_texts", "_pending")

    def __init__(self, table: list[bytes], texts: list[str | None]):
        self._table = table
        self._texts = texts
        self._pending = b""

    def feed(self, ids: Sequence[int]) -> str:
        table = self._table
        n = len(table)
        if len(ids) == 1:
            i = ids[0]
            if not 0 <= i < n:
                data = b""
            elif not self._pending:
                text = self._texts[i]
                if text is not None:
                    return text
                data = table[i]
            else:
                data = table[i]
        else:
            data = b"".join([table[i] if 0 <= i < n else b"" for i in ids])
        if self._pending:
            data = self._pending + data
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._pending = data[used:] if used < len(data) else b""
        return text

    def flush(self) -> str:
        data, self._pending = self._pending, b""
        return codecs.utf_8_decode(data, "replace", True)[0]


class _WindowText:
    """Decode `ids[prefix:]` and `ids[prefix:read]`, emit the difference; hold back while the text
    ends in U+FFFD (an incomplete character)."""

    __slots__ = ("_tok", "_skip", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, context_ids: Sequence[int]):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        self._prefix = 0
        self._read = len(self._ids)

    def _diff(self) -> str:
        ids = self._ids
        prefix_text = self._tok.decode(ids[self._prefix:self._read], skip_special_tokens=self._skip)
        new_text = self._tok.decode(ids[self._prefix:], skip_special_tokens=self._skip)
        if len(new_text) <= len(prefix_text):
            return ""
        return new_text[len(prefix_text):]

    def _advance(self) -> None:
        self._prefix = self._read
        self._read = len(self._ids)
        if self._prefix >= _TRIM_AT:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    def feed(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        text = self._diff()
        if not text or text.endswith("\ufffd"):
            return ""
        self._advance()
        return text

    def flush(self) -> str:
        text = self._diff()
        self._advance()
        return text


class _StopText:
    """Holds back the tail that might begin a stop string; finds the first complete one."""

    __slots__ = ("_stops", "_hold", "_pending", "_include")

    def __init__(self, stops: Sequence[str], include: bool = False):
        self._stops = tuple(stops)
        self._include = include
        self._hold = max(len(s) for s in self._stops) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string completed)."""
        pending = self._pending + text if self._pending else text
        best_end = -1
        best_start = 0
        for s in self._stops:
            i = pending.find(s)
            if i >= 0:
                end = i + len(s)
                if best_end < 0 or end < best_end or (end == best_end and i < best_start):
                    best_end, best_start = end, i
        if best_end >= 0:
            self._pending = ""
            return pending[:best_end if self._include else best_start], True
        cut = len(pending) - self._hold
        if cut <= 0:
            self._pending = pending
            return "", False
        self._pending = pending[cut:]
        return pending[:cut], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class Detokenizer:
    """One request's detokenizer. Call `step(ids)` per delta and `step(ids, final=True)` for the
    last one (or `finish()` when the stream ends without tokens); each returns the text to emit.
    Once `stopped` is true every later call returns "", and `used` is how many ids of the step
    that stopped were needed: the one that completed the stop string is the last (the client is
    given those, not the ones after it). `direct`, when not None, is what `step(ids)` (not final)
    comes to with no stop strings: the text source's own step."""

    __slots__ = ("_text", "_stop", "stopped", "used", "direct")

    def __init__(self, text: _TextSource, stops: Sequence[str] = (), include_stop: bool = False):
        self._text = text
        self._stop = _StopText(stops, include_stop) if stops else None
        self.stopped = False
        self.used = 0
        self.direct = text.feed if self._stop is None else None

    def step(self, ids: Sequence[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        if self._stop is not None and len(ids) > 1:  # one id at a time: which one completes it
            out, last = "", len(ids) - 1
            for k in range(len(ids)):
                out += self._step(ids[k:k + 1], final and k == last)
                if self.stopped:
                    self.used = k + 1
                    return out
            return out
        out = self._step(ids, final)
        if self.stopped:
            self.used = len(ids)
        return out

    def _step(self, ids: Sequence[int], final: bool) -> str:
        text = self._text.feed(ids) if ids else ""
        if final:
            text += self._text.flush()
        stop = self._stop
        if stop is None:
            return text
        out, hit = stop.feed(text)
        if hit:
            self.stopped = True
            return out
        if final:
            out += stop.flush()
        return out

    def finish(self) -> str:
        return self.step((), final=True)


class DetokenizerFactory:
    """Built once per tokenizer; makes a `Detokenizer` per request."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 byte_level: bool | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if byte_level is None:
            byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._byte_level = byte_level
        self._table = byte_table(tokenizer, skip_special_tokens) if byte_level else None
        self._texts = text_table(self._table) if self._table is not None else None
        self._other: list[bytes] | None = None  # the table with the other skip_special_tokens
        self._other_texts: list[str | None] | None = None
        self._tokens: dict[int, tuple[str, bytes]] = {}

    @property
    def byte_level(self) -> bool:
        return self._table is not None

    def _table_for(self, skip_special_tokens: bool) -> list[bytes] | None:
        if not self._byte_level:
            return None
        if skip_special_tokens == self.skip_special_tokens:
            return self._table
        if self._other is None:  # built once, the first time a request asks for it
            self._other = byte_table(self.tokenizer, skip_special_tokens)
        return self._other

    def _texts_for(self, skip_special_tokens: bool) -> list[str | None]:
        if skip_special_tokens == self.skip_special_tokens:
            assert self._texts is not None
            return self._texts
        if self._other_texts is None:
            table = self._table_for(skip_special_tokens)
            assert table is not None
            self._other_texts = text_table(table)
        return self._other_texts

    def new(self, stops: Sequence[str] = (), context_ids: Sequence[int] = (),
            skip_special_tokens: bool | None = None, include_stop: bool = False) -> Detokenizer:
        """`context_ids`: the prompt's ids (only its last few are used, by the windowed decoder).
        `skip_special_tokens` None: the factory's default. `include_stop`: a stop string that
        ends the text stays in it."""
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        text: _TextSource
        table = self._table_for(skip)
        if table is not None:
            text = _ByteLevelText(table, self._texts_for(skip))
        else:
            text = _WindowText(self.tokenizer, skip, context_ids)
        return Detokenizer(text, stops, include_stop)

    def token(self, token_id: int) -> tuple[str, bytes]:
        """One token on its own, as logprobs show it: (its text, its bytes); special tokens
        included. Text of a token that is part of a character has U+FFFD for the missing part."""
        hit = self._tokens.get(token_id)
        if hit is not None:
            return hit
        table = self._table_for(False)
        if table is not None:
            raw = table[token_id] if 0 <= token_id < len(table) else b""
            text = raw.decode("utf-8", "replace")
        else:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = text.encode()
        if len(self._tokens) < 1 << 20:
            self._tokens[token_id] = (text, raw)
        return text, raw
