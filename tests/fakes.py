"""Test doubles for the frontend: a FakePool with the shape of tandem.router.pool.WorkerPool whose
request handles play scripted deltas through a real DeltaCollector and record aborts, and small
model directories (tokenizer only)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tandem.config import RouterConfig
from tandem.frontend.uvicorn_protocol import EXTENSIONS
from tandem.router.pool import WorkerPool
from tandem.runtime import errors, wire
from tandem.runtime.channel import MemoryChannel, memory_pair
from tandem.runtime.collector import DeltaCollector
from tandem.runtime.metrics import Registry
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


class _ScriptedCollector(DeltaCollector):
    """A real DeltaCollector that tells its feeder when the reader took a delta."""

    __slots__ = ("on_take",)

    def take(self) -> Delta | None:
        d = super().take()
        if d is not None:
            self.on_take()
        return d

    def take_running(self) -> Delta | None:
        d = super().take_running()
        if d is not None:
            self.on_take()
        return d


class FakeHandle:
    """A request handle (tandem.router.request.RequestHandle's shape) whose deltas follow a
    script, fed into a real DeltaCollector. Unless the pool plays bursts, the next delta arrives
    one loop pass after the reader took the previous one (a worker that sends one per engine step
    to a frontend that keeps up); with `burst`, consecutive scripted deltas arrive at once and the
    collector merges them (a frontend that lags). Leaving before the finished delta records an
    abort on the pool, as the real handle sends an Abort to the worker."""

    def __init__(self, pool: FakePool, rid: str, items: list[Item], burst: bool = False):
        self.pool = pool
        self.rid = rid
        self.collector = _ScriptedCollector()
        self.collector.on_take = self._taken
        self._items = list(items)
        self._burst = burst
        self._timer: asyncio.TimerHandle | None = None
        self._hung = False
        self.finished = False
        self.entered = False
        self.exited = False

    @property
    def remaining(self) -> int:
        """Script items not delivered yet."""
        return len(self._items)

    async def __aenter__(self) -> FakeHandle:
        self.entered = True
        self._next()
        return self

    def enter_now(self) -> bool:
        return False  # (entering starts the script)

    def release(self) -> None:
        if self.entered:
            self._leave()

    async def __aexit__(self, *exc: object) -> None:
        self._leave()

    def _leave(self) -> None:
        if self.exited:
            return
        self.exited = True
        if self._timer is not None:
            self._timer.cancel()
        if not self.finished:
            self.pool.aborted.append(self.rid)
        self.pool.exited.set()

    def _taken(self) -> None:
        if self._timer is None and not self._hung and not self.exited:
            asyncio.get_running_loop().call_soon(self._next)

    def _wake(self) -> None:
        self._timer = None
        self._next()

    def _next(self) -> None:
        if self.exited or self.finished:
            return
        while self._items:
            item = self._items[0]
            if isinstance(item, Hang):
                self._hung = True
                return
            self._items.pop(0)
            if isinstance(item, float):
                self._timer = asyncio.get_running_loop().call_later(item, self._wake)
                return
            if isinstance(item, BaseException):
                self.finished = True  # the worker ended it: nothing left to abort
                self.collector.fail(item)
                return
            if item.finish_reason is not None:
                self.finished = True
            self.collector.put(item)
            if self.finished or not self._burst:
                return
        if not self.finished:
            self.finished = True
            self.collector.fail(errors.TandemError("the script ended without a finish reason"))


class FakePool:
    """The WorkerPool API over scripted handles. `script(rid, prompt_ids, sampling)` gives each
    request's items; the default returns `reply_ids` as one-token deltas finishing with "length".
    With `burst`, a handle's consecutive scripted deltas arrive at once (a frontend that lags)."""

    def __init__(self, info: WorkerInfo | None = None, reply_ids: list[int] | None = None,
                 script: Script | None = None, burst: bool = False):
        self.burst = burst
        self.info = info or WorkerInfo(
            name="fake-0", role="agg", engine="fake", model="tiny", page_size=16, pages_total=64,
            max_context=256)
        self.max_context: int | None = self.info.max_context
        self.reply_ids = reply_ids or [10, 11, 12]
        self.script = script or (lambda rid, ids, sp: deltas(rid, self.reply_ids))
        self.is_ready = True
        self.tenants: list[tuple[str, int]] = []  # (tenant, priority) of each open()
        self.unavailable: errors.TandemError | None = None
        self.opened: list[tuple[list[int], SamplingParams]] = []
        self.salts: list[str] = []  # each opened request's cache salt
        self.streams: list[FakeHandle] = []
        self.aborted: list[str] = []
        self.exited = asyncio.Event()
        self.registry = Registry()
        self.registry.callback("tandem_worker_up", "Whether the worker is usable.",
                               lambda: [(("fake",), int(self.is_ready))], ("worker",))
        self._n = 0

    def ready(self) -> bool:
        return self.is_ready

    async def snapshot(self) -> list[dict[str, Any]]:
        return [{"name": "fake-0", "role": "agg", "address": "tcp://fake", "state": "up",
                 "in_flight": sum(1 for s in self.streams if s.entered and not s.exited),
                 "pages_free": 64, "pages_total": 64}]

    def open(self, prompt_ids: list[int], sampling: SamplingParams, session: str = "",
             tenant: str = "", priority: int = 0, salt: str = "") -> FakeHandle:
        self.tenants.append((tenant, priority))
        if self.unavailable is not None:
            raise self.unavailable
        self.salts.append(salt)
        self._n += 1
        rid = f"fake{self._n}"
        self.opened.append((list(prompt_ids), sampling))
        handle = FakeHandle(self, rid, self.script(rid, prompt_ids, sampling), self.burst)
        self.streams.append(handle)
        return handle


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


async def next_delta(c: DeltaCollector) -> Delta:
    """The collector's next (merged) delta, read as the response loop reads it (a listener, then
    `take`); raises the request's failure once nothing is pending."""
    while True:
        d = c.take()
        if d is not None:
            return d
        woken = asyncio.get_running_loop().create_future()
        c.listen(lambda: woken.done() or woken.set_result(None))
        try:
            await woken
        finally:
            c.unlisten()


async def deltas_of(handle: Any) -> AsyncIterator[Delta]:
    """A request's deltas to its last (the finish, or an error delta: its kind is the caller's to
    map), read as the response loop reads them; a router failure is raised."""
    while True:
        d = await next_delta(handle.collector)
        yield d
        if d.finish_reason is not None:
            return


class ServerCallsStub:
    """A server's calls beside ASGI (tandem.frontend.http.ServerCalls) for app tests: `body` and
    `start` stand for body_nowait and start_nowait (None: always refused, as a server that cannot
    write now); on_gone registers and never calls back (the client stays)."""

    def __init__(self, body: Callable[[bytes], bool] | None = None,
                 start: Callable[[int, Any, bytes], bool] | None = None) -> None:
        self.body, self.start = body, start

    def body_nowait(self, data: bytes) -> bool:
        return self.body is not None and self.body(data)

    def start_nowait(self, status: int, headers: Any, body: bytes) -> bool:
        return self.start is not None and self.start(status, headers, body)

    def on_gone(self, callback: Callable[[], None] | None) -> bool:
        return True


async def asgi_post(app: Any, path: str, body: bytes, out: list[bytes],
                    calls: Any | None = None, starts: list[int] | None = None) -> None:
    """One POST through an ASGI app whose client stays (its `receive` waits after the body):
    every non-empty body chunk written through `send` is appended to `out`, in order, and the
    status of every response start sent through it to `starts`. `calls`: the server's calls
    beside ASGI (a ServerCallsStub), offered in the scope as tandem's uvicorn protocol does."""
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.body" and msg.get("body"):
            out.append(msg["body"])
        elif msg["type"] == "http.response.start" and starts is not None:
            starts.append(msg["status"])

    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": path, "headers": []}
    if calls is not None:
        scope["extensions"] = {EXTENSIONS: calls}
    await app(scope, receive, send)


class MemoryWorkers:
    """The worker ends of a WorkerPool's channels, in memory (`WorkerPool(..., connect=w.connect)`):
    what the frontend sent each worker crosses the wire encoding and is kept in `sent(address)`."""

    def __init__(self) -> None:
        self.ends: dict[str, MemoryChannel[Any, Any]] = {}
        self._log: dict[str, list[Any]] = {}

    def connect(self, address: str, frontend_id: str) -> MemoryChannel[Any, Any]:
        frontend, worker = memory_pair(decoders=(wire.TO_FRONTEND, wire.TO_WORKER))
        self.ends[address] = worker
        self._log[address] = []
        return frontend

    def sent(self, address: str) -> list[Any]:
        self._log[address] += self.ends[address].received()
        return self._log[address]


def memory_pool(roles: list[str], pages: int = 100, page_size: int = 4,
                max_context: int = 4096, **router: Any) -> tuple[WorkerPool, MemoryWorkers]:
    """A WorkerPool over in-memory channels whose workers (`tcp://w0`, ...) have answered the
    handshake with `roles` and reported `pages` free pages. No task runs: tests feed the links
    (`link.on_message`) and read what they sent (`workers.sent(address)`)."""
    workers = MemoryWorkers()
    pool = WorkerPool([f"tcp://w{i}" for i in range(len(roles))], "fe-test",
                      RouterConfig(**router), connect=workers.connect)
    for i, (link, role) in enumerate(zip(pool.links, roles)):
        link.on_message(wire.HelloReply(wire.PROTOCOL_VERSION, True, WorkerInfo(
            f"w{i}", role, "mock", "m", page_size, pages, max_context,  # type: ignore[arg-type]
            bootstrap_addr="127.0.0.1:9" if role == "prefill" else "")))
        link.on_message(wire.LoadReport(0, wire.Load(pages_free=pages, pages_total=pages)))
    return pool, workers
