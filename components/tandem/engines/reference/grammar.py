"""Constrained output for the reference engine (a request's `json_schema` or `regex`), through
xgrammar, the grammar library SGLang and vLLM use; it runs on a CPU.

`Grammars` is the engine's: the model's tokenizer as xgrammar sees it (byte-level vocabulary, its
special tokens marked, the model's EOS ids as the stop tokens), one compiler, and the grammars it
compiled (up to CACHE_BYTES: a schema that requests repeat compiles once). `Grammars.constraint`
takes a request's grammar at submit: ready from the cache, or compiled off the event loop within
a deadline, in fair order across clients (tandem.engines.grammars), first in a process that is
killed past it (tandem.engines.reference.grammar_procs); a bad one fails its request (an EngineRequestError naming
the field: the frontend's 400). What it is given is bounded: a grammar is at most
MAX_GRAMMAR_CHARS characters (tandem.runtime.sampling, checked before), and JSON is compiled
compact (no free whitespace, so a model cannot pad its output forever). JSON never needs a control
character (below 0x20) raw, and xgrammar 0.2.8's rule for a string with a maxLength lets them
through, which JSON parsers refuse: a JSON request's mask also drops every token that holds one
(each byte has a token of its own, so no text becomes impossible).

`GrammarState` is one request's state, a matcher that has accepted every completion token of the
request, however it got it: the engine's own steps (the one postprocess, tandem.engines.outputs),
the prefill side's first token in PD (postprocessed on the decode side the same way), an earlier
leg's tokens when a request resumes after a migration (`resume`, at submit). Before each step
`mask` turns the logits of the tokens the grammar does not allow next into -inf (after the
logprobs are taken: those stay the model's own), so the sampler picks an allowed token whatever
its settings; once the grammar is complete only the stop tokens are allowed, so the request ends
with "stop". `ignore_eos` and `min_tokens` could force a token the grammar does not allow: they
are refused with a grammar.
"""

from __future__ import annotations

import json
import threading
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tandem.engines.base import EngineRequest
from tandem.engines.grammars import SLOTS, Deferred
from tandem.engines.reference.grammar_procs import ProbeProcs, first_line
from tandem.engines.sampling import grammar_param
from tandem.runtime.errors import EngineRequestError

JSON_ANY_WHITESPACE = False  # compact JSON: whitespace is never free (see the module docstring)
CACHE_BYTES = 64 << 20  # compiled grammars kept for the requests that repeat them


class GrammarState:
    """One request's grammar state (see the module docstring)."""

    __slots__ = ("matcher", "json")

    def __init__(self, matcher: Any, json: bool) -> None:
        self.matcher = matcher
        self.json = json  # a JSON schema's: no token with a raw control character

    def accept(self, token: int) -> bool:
        """The request's next completion token; False when the grammar does not allow it."""
        return bool(self.matcher.accept_token(token))

    def resume(self, tokens: list[int]) -> None:
        """An earlier leg's completion tokens (a migrated request): refused if they break it."""
        for t in tokens:
            if not self.accept(t):
                raise EngineRequestError("the completion this request resumes from does not "
                                         "follow its grammar", param="resume_offset")


class Grammars:
    """The engine's grammar compiler over the model's tokenizer (see the module docstring)."""

    def __init__(self, model_dir: Path, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self.why_not = ""  # why this model cannot constrain its output ("" when it can)
        self.vocab_size = vocab_size
        self._xgr: Any = None
        self._compiler: Any = None
        self._cache: dict[tuple[str, Any], Any] = {}  # compiled grammars, oldest first
        self._cached = 0  # their bytes
        self._lock = threading.Lock()
        self.probes: ProbeProcs | None = None  # the compile processes (stopped at a deadline)
        try:
            import xgrammar
        except ImportError as e:
            self.why_not = f"xgrammar is not installed ({e}): install tandem[reference]"
            return
        try:
            info = tokenizer_info(xgrammar, model_dir, vocab_size, stop_ids)
        except Exception as e:  # (a tokenizer it cannot read: that model has no grammars)
            self.why_not = f"the model's tokenizer cannot be used for grammars: {e}"
            return
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._no_control = _packed([not any(b < 0x20 for b in t) for t in info.decoded_vocab])
        self.probes = ProbeProcs(info.serialize_json(), SLOTS)
        self._xgr = xgrammar

    def constraint(self, req: EngineRequest, engine: str) -> GrammarState | Deferred | None:
        """The request's constraint: None without a grammar, ready when its grammar was compiled
        before (the cache), else Deferred (compiled off the loop: tandem.engines.grammars); or
        EngineRequestError naming the field for a combination it cannot honour."""
        p = req.sampling
        param = grammar_param(p)
        if param is None:
            return None
        if self._compiler is None:
            raise EngineRequestError(f"{param} (constrained output) is not available on this "
                                     f"{engine} engine: {self.why_not}", param=param)
        if p.ignore_eos:
            raise EngineRequestError("ignore_eos cannot be combined with constrained output (the "
                                     "grammar ends the completion)", param="ignore_eos")
        if p.min_tokens:
            raise EngineRequestError("min_tokens cannot be combined with constrained output (the "
                                     "grammar decides where the completion ends)",
                                     param="min_tokens")
        key = (param, p.json_schema if p.json_schema is not None else p.regex)
        n = req.resume_offset
        resume = list(req.prompt_ids[len(req.prompt_ids) - n:]) if n else []
        compiled = self._cache.get(key)
        if compiled is not None:
            return self._matcher(compiled, param, resume)
        return Deferred(partial(self._compiled, key, resume), param)

    def _compiled(self, key: tuple[str, Any], resume: list[int], deadline_s: float
                  ) -> GrammarState:
        """(On a compile slot's thread.) Compile in a process within `deadline_s` (killed past
        it: tandem.engines.reference.grammar_procs), then here; remember; make the matcher."""
        param, text = key
        if param == "json_schema":
            try:
                json.loads(text)  # (a clear message for JSON that does not parse)
            except ValueError as e:
                raise EngineRequestError(f"{param} cannot be used as a grammar: {e}",
                                         param=param) from None
        assert self.probes is not None
        self.probes.probe(param, text, JSON_ANY_WHITESPACE, deadline_s, param)
        try:
            if param == "json_schema":
                compiled = self._compiler.compile_json_schema(
                    text, any_whitespace=JSON_ANY_WHITESPACE, strict_mode=True)
            else:
                compiled = self._compiler.compile_regex(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise EngineRequestError(f"{param} cannot be used as a grammar: {first_line(e)}",
                                     param=param) from None
        with self._lock:  # (the slots' threads)
            cache = self._cache
            cache[key] = compiled
            self._cached += compiled.memory_size_bytes
            while self._cached > CACHE_BYTES and len(cache) > 1:  # (the oldest first)
                self._cached -= cache.pop(next(iter(cache))).memory_size_bytes
        return self._matcher(compiled, param, resume)

    def _matcher(self, compiled: Any, param: str, resume: list[int]) -> GrammarState:
        c = GrammarState(self._xgr.GrammarMatcher(compiled), param == "json_schema")
        c.resume(resume)
        return c

    def close(self) -> None:
        """Stop the compile processes (the engine's shutdown)."""
        if self.probes is not None:
            self.probes.close()

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, GrammarState]]) -> None:
        """Set the logits of every token the grammar does not allow next to -inf, for each
        (row of `logits`, constraint)."""
        xgr = self._xgr
        batch, vocab = logits.shape
        bitmask = xgr.allocate_token_bitmask(batch, vocab)  # (every token allowed)
        for i, c in rows:
            c.matcher.fill_next_token_bitmask(bitmask, i)
        json_rows = [i for i, c in rows if c.json]
        if json_rows:
            bitmask[json_rows] &= self._no_control
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab,
                                        indices=[i for i, _ in rows])


def tokenizer_info(xgrammar: Any, model_dir: Path, vocab_size: int, stop_ids: tuple[int, ...]
                   ) -> Any:
    """xgrammar's view of the model's tokenizer.json (byte-level BPE: its special tokens marked,
    which xgrammar's own reading of a tokenizer.json misses, its EOS ids the stop tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    decoder = (json.loads(tok.to_str()).get("decoder") or {}).get("type")
    if decoder != "ByteLevel":
        raise ValueError(f"its decoder is {decoder}; grammars take byte-level BPE tokenizers "
                         f"(the tiny model's, Llama 3's)")
    vocab: list[str] = [""] * vocab_size
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            vocab[i] = text
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special and 0 <= i < vocab_size:
            vocab[i] = ""  # (xgrammar: an empty token is special, never part of the text)
    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                  stop_token_ids=list(stop_ids))


def _packed(allowed: list[bool]) -> torch.Tensor:
    """xgrammar's bitmask layout (token t: bit t % 32 of int32 word t // 32) of one row."""
    words = torch.zeros(-(-len(allowed) // 32), dtype=torch.int64)
    for t, ok in enumerate(allowed):
        if ok:
            words[t // 32] |= 1 << (t % 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
