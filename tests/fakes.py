"""Test doubles for the frontend: a FakePool with the shape of tandem.router.pool.WorkerPool whose
streams play scripted deltas and record aborts, and small model directories (tokenizer only)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.runtime import errors
from tandem.runtime.wire import Delta, SamplingParams, Usage, WorkerInfo


class Hang:
    """A script item: wait forever (until the stream is cancelled)."""


# A script item is a Delta to yield, an exception to raise, a float to sleep, or Hang().
Item = Delta | BaseException | float | Hang
Script = Callable[[str, list[int], SamplingParams], list[Item]]


def deltas(rid: str, token_ids: list[int], per: int = 1, finish: str = "length",
           prompt_tokens: int = 0) -> list[Item]:
    """Deltas carrying `token_ids`, `per` tokens each, the last one finished."""
    out: list[Item] = []
    chunks = [token_ids[i:i + per] for i in range(0, len(token_ids), per)] or [[]]
    offset = 0
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        usage = Usage(prompt_tokens, offset + len(chunk)) if last else None
        out.append(Delta(rid, offset, list(chunk), finish if last else None, usage))  # type: ignore[arg-type]
        offset += len(chunk)
    return out


def one_token_script(tokens: list[int], tail: list[Item] | None = None,
                     finish: str = "length") -> Script:
    """One delta per token; without `tail` the last delta finishes, with it `tail` follows the
    tokens (an error to raise, Hang(), ...)."""

    def script(rid: str, ids: list[int], sp: SamplingParams) -> list[Item]:
        if tail is None:
            return deltas(rid, tokens, finish=finish)
        return [Delta(rid, i, [t]) for i, t in enumerate(tokens)] + list(tail)
    return script


class FakeStream:
    """A RequestStream that plays a script. Leaving the context before the finished delta records
    an abort on the pool, as the real one sends an Abort to the worker."""

    def __init__(self, pool: FakePool, rid: str, items: list[Item], burst: bool = False):
        self.pool = pool
        self.rid = rid
        self._items = list(items)
        self._burst = burst
        self.finished = False
        self.entered = False
        self.exited = False

    async def __aenter__(self) -> FakeStream:
        self.entered = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.exited = True
        if not self.finished:
            self.pool.aborted.append(self.rid)
        self.pool.exited.set()

    def __aiter__(self) -> FakeStream:
        return self

    def waiting(self) -> int:
        """Items already here. Unless the pool plays bursts, each delta arrives on its own (as
        from a worker that sends one per engine step to a frontend that keeps up)."""
        if not self._burst:
            return 0
        n = 0
        for item in self._items:
            if isinstance(item, (Hang, float)):
                break
            n += 1
        return n

    async def __anext__(self) -> Delta:
        while True:
            if self.finished or not self._items:
                raise StopAsyncIteration
            item = self._items.pop(0)
            if isinstance(item, Hang):
                await asyncio.Event().wait()
            elif isinstance(item, float):
                await asyncio.sleep(item)
            elif isinstance(item, BaseException):
                self.finished = True  # the worker ended it: nothing left to abort
                raise item
            else:
                if item.finish_reason is not None:
                    self.finished = True
                return item


class FakePool:
    """The WorkerPool API over scripted streams. `script(rid, prompt_ids, sampling)` gives each
    request's items; the default returns `reply_ids` as one-token deltas finishing with "length".
    With `burst`, a stream's scripted deltas are all already there (a frontend that lags)."""

    def __init__(self, info: WorkerInfo | None = None, reply_ids: list[int] | None = None,
                 script: Script | None = None, burst: bool = False):
        self.burst = burst
        self.info: WorkerInfo | None = info or WorkerInfo(
            name="fake-0", role="agg", engine="fake", model="tiny", page_size=16, pages_total=64,
            max_context=256)
        self.reply_ids = reply_ids or [10, 11, 12]
        self.script = script or (lambda rid, ids, sp: deltas(rid, self.reply_ids))
        self.is_ready = True
        self.unavailable: errors.TandemError | None = None
        self.opened: list[tuple[list[int], SamplingParams]] = []
        self.streams: list[FakeStream] = []
        self.aborted: list[str] = []
        self.exited = asyncio.Event()
        self._n = 0

    def ready(self) -> bool:
        return self.is_ready

    async def snapshot(self) -> list[dict[str, Any]]:
        return [{"name": "fake-0", "role": "agg", "address": "tcp://fake", "state": "up",
                 "in_flight": sum(1 for s in self.streams if s.entered and not s.exited),
                 "pages_free": 64, "pages_total": 64}]

    def open(self, prompt_ids: list[int], sampling: SamplingParams) -> FakeStream:
        if self.unavailable is not None:
            raise self.unavailable
        self._n += 1
        rid = f"fake{self._n}"
        self.opened.append((list(prompt_ids), sampling))
        stream = FakeStream(self, rid, self.script(rid, prompt_ids, sampling), self.burst)
        self.streams.append(stream)
        return stream

    def metrics(self) -> str:
        return "# TYPE tandem_worker_up gauge\ntandem_worker_up{worker=\"fake\"} 1\n"


MULTILINGUAL_CORPUS = [
    "Hello world! héllo wörld — 你好，世界 🙂🙃👍🏽 こんにちは 안녕하세요 Привет мир",
    "The quick brown fox jumps over the lazy dog. naïve café ☃ ∑ ∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ½ € ñ",
    "stop STOP Stop. END end <end> ### --- \n\n 12345 67890 3.14159",
] * 20


def train_multilingual_tokenizer(vocab_size: int = 500) -> Tokenizer:
    """Byte-level BPE whose merges split multi-byte characters across tokens (e.g. emoji)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        special_tokens=["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(MULTILINGUAL_CORPUS, trainer=trainer)
    tok.add_tokens(["<tool>", "aĠb"])  # non-special added tokens go through the decoder too
    return tok


CHATML = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' and loop.first %}{{ raise_exception('a conversation cannot start "
    "with a tool message') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_model_dir(path: Path, tokenizer: Tokenizer | None = None,
                    chat_template: str | None = CHATML) -> Path:
    """A model directory with only what the frontend reads: tokenizer.json and its config."""
    path.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or train_multilingual_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    cfg: dict[str, Any] = {"bos_token": "<|bos|>",
                           "eos_token": {"content": "<|im_end|>", "special": True}}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path
