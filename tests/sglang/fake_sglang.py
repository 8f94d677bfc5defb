"""A fake of `sglang.Engine` with the shapes and edges of SGLang 0.5.23's streamed outputs, for the
adapter's tests on machines without a GPU.

What it reproduces: `await engine.async_generate(...)` returns an async generator; validation errors
(empty ids, unknown sampling key, too long, duplicate rid) raise from its first `__anext__`; items are
`{"output_ids", "meta_info"}` (no "text": the tokenizer is skipped); cumulative intermediate items
carry THE SAME live list, appended to by the scheduler after the yield (only the final item is a
copy) and a lagging consumer sees only the newest item; incremental items carry new ids and are
concatenated for a lagging consumer; the abort echo of incremental mode repeats the last id and
lacks prompt_tokens/cached_tokens; `tokenizer_manager.abort_request(rid=...)` aborts every request
whose rid STARTS WITH the given one (the scheduler's prefix match); a PD prefill ends with one
"length" item once its "KV" is sent (to a registry keyed by bootstrap port and room) and the decode
stream starts with the first token; a room listed in `World.fail_rooms` aborts both sides with 500;
`World.crash()` stops the scheduler and calls the SIGQUIT handler SGLang's TokenizerManager
registered. Logprobs (`return_logprob`, `top_logprobs_num`) as SGLang's TokenizerManager hands
them out: `output_token_logprobs` and `output_top_logprobs`, (logprob, id, None) triples; in
cumulative mode every token's so far (a live list, like the ids), in incremental mode the item's
own, but the abort echo's are every token's (SGLang slices them only on the normal path).
Knobs: `drop_usage`, `empty_items`, `tokens_per_step`, `step_s`, `spawn_child`.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

SAMPLING_KEYS = {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
                 "n", "json_schema", "regex", "ebnf", "ignore_eos", "skip_special_tokens",
                 "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params"}
VOCAB = 4096
EOS = 2


def logprob(tid: int) -> float:
    """The fake's logprob of token `tid` (its top alternatives are less likely)."""
    return -0.01 - (tid % 97) / 100


def top(tid: int, k: int) -> list[tuple[float, int, None]]:
    return [(logprob(tid) - 0.5 * j, (tid + j) % VOCAB, None) for j in range(k)]


def token(prompt: list[int], i: int) -> int:
    """The fake model: token i of a prompt's completion (never EOS)."""
    return (sum(prompt) * 31 + i * 7) % (VOCAB - 3) + 3


@dataclass
class World:
    """What every fake engine of one test shares: knobs, and the PD bootstrap registry."""

    drop_usage: bool = False
    empty_items: bool = False  # an empty non-final item before every real one
    tokens_per_step: int = 1
    step_s: float = 0.0
    spawn_child: bool = False  # the fake "scheduler" is a real child process (killed on shutdown)
    fail_rooms: set[int] = field(default_factory=set)
    rooms: dict[tuple[int, int], asyncio.Future[int]] = field(default_factory=dict)
    engines: list[FakeEngine] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # rids passed to abort_request

    def room(self, port: int, room: int) -> asyncio.Future[int]:
        key = (port, room)
        if key not in self.rooms:
            self.rooms[key] = asyncio.get_running_loop().create_future()
        return self.rooms[key]

    def crash(self) -> None:
        for engine in self.engines:
            engine.tokenizer_manager.crashed = True
            engine.tokenizer_manager.handlers.running_phase_sigquit_handler()

    def factory(self, server_args: Any) -> FakeEngine:
        engine = FakeEngine(self, server_args)
        self.engines.append(engine)
        return engine


def fake_server_args(opts: Any, sigquit_handler: Any = None) -> SimpleNamespace:
    """What the adapter reads back from ServerArgs, built as the real builder would."""
    return SimpleNamespace(
        model_path=opts.model, incremental_streaming_output=opts.output_mode == "incremental",
        disaggregation_mode={"agg": "null"}.get(opts.role, opts.role),
        disaggregation_bootstrap_port=opts.bootstrap_port or 8998,
        enable_deterministic_inference="--enable-deterministic-inference" in opts.engine_args,
        page_size=opts.page_size, max_total_tokens=opts.num_pages * opts.page_size or None,
        custom_sigquit_handler=sigquit_handler)


class _Req:
    def __init__(self, rid: str, prompt: list[int], sp: dict[str, Any], bootstrap: Any) -> None:
        self.rid = rid
        self.prompt = prompt
        self.sp = sp
        self.bootstrap = bootstrap
        self.ids: list[int] = []  # the live list
        self.sent = 0  # incremental: ids already queued
        self.queue: list[dict[str, Any]] = []
        self.wake = asyncio.Event()
        self.finished = False
        self.empty_sent = False
        self.admitted = False
        self.pages = 0  # what admission reserved: (prompt + max_new_tokens) in pages
        self.logprobs: int | None = None  # top_logprobs_num, when return_logprob
        self.lps: list[tuple[float, int, None]] = []  # live, like ids
        self.tops: list[list[tuple[float, int, None]]] = []


class FakeTokenizerManager:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.signal_handler_class: Any = None
        self.asyncio_tasks: set[asyncio.Task[Any]] = set()
        self.context_len = 4096
        self.model_config = SimpleNamespace(hf_eos_token_id={EOS}, vocab_size=VOCAB)
        self._subprocess_watchdog = None
        self.handlers: Any = None
        self.crashed = False

    @property
    def rid_to_state(self) -> dict[str, _Req]:
        """SGLang's requests in flight, by rid (until their last item is taken)."""
        return self.engine.reqs

    def auto_create_handle_loop(self) -> None:
        if self.handlers is None:
            self.handlers = self.signal_handler_class(self)
            loop = asyncio.get_running_loop()
            self.asyncio_tasks.add(loop.create_task(self.engine.scheduler()))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.engine.world.aborts.append(rid)
        for req in list(self.engine.reqs.values()):
            if req.rid.startswith(rid) and not req.finished:  # SGLang's scheduler: by prefix
                self.engine.finish(req, {"type": "abort", "message": "Abort in waiting queue"},
                                   echo=True)


class FakeEngine:
    def __init__(self, world: World, server_args: Any) -> None:
        self.world = world
        self.server_args = server_args
        self.incremental = bool(server_args.incremental_streaming_output)
        self.mode = server_args.disaggregation_mode
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.reqs: dict[str, _Req] = {}
        self.work = asyncio.Event()
        self.child = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
                      if world.spawn_child else None)

    def shutdown(self) -> None:  # what atexit would call; the adapter unregisters it
        raise AssertionError("the adapter must not call SGLang's shutdown")

    async def async_generate(self, *, input_ids: list[int], sampling_params: dict[str, Any],
                             stream: bool, rid: str, bootstrap_host: str | None = None,
                             bootstrap_port: int | None = None,
                             bootstrap_room: int | None = None, return_logprob: bool = False,
                             top_logprobs_num: int | None = None,
                             logprob_start_len: int | None = None) -> Any:
        assert stream is True
        assert not return_logprob or logprob_start_len == -1  # (no prompt logprobs asked)
        bootstrap = (bootstrap_host, bootstrap_port, bootstrap_room)
        return self._generate(rid, list(input_ids), dict(sampling_params), bootstrap,
                              top_logprobs_num or 0 if return_logprob else None)

    async def _generate(self, rid: str, prompt: list[int], sp: dict[str, Any],
                        bootstrap: tuple[Any, Any, Any], logprobs: int | None = None) -> Any:
        unknown = set(sp) - SAMPLING_KEYS
        if unknown:
            raise TypeError(f"Unexpected keyword argument {sorted(unknown)[0]!r}")
        if not prompt:
            raise ValueError("The input_ids is empty")
        if max(prompt) >= VOCAB:  # live: the scheduler process dies (IndexError)
            self.world.crash()
            raise RuntimeError("SGLang's scheduler process died")
        if len(prompt) + int(sp.get("max_new_tokens", 128)) > self.tokenizer_manager.context_len:
            raise ValueError("the request is longer than the model's context length")
        if rid in self.reqs:
            raise ValueError(f"Duplicate request ID: {rid}")
        req = self.reqs[rid] = _Req(rid, prompt, sp, bootstrap)
        req.logprobs = logprobs
        if {"json_schema", "regex", "ebnf"} & set(sp):  # live, with --skip-tokenizer-init
            self.finish(req, {"type": "abort", "status_code": 400, "message": "Grammar-based "
                              "generation (json_schema, regex, ebnf, structural_tag) is not "
                              "supported when the server is launched with --grammar-backend none"})
        if self.mode != "null" and bootstrap[2] is None:
            self.finish(req, {"type": "abort", "message": "bootstrap room required",
                              "status_code": 400})
        self.work.set()
        try:
            while True:
                await req.wake.wait()
                req.wake.clear()
                item = self._take(req)
                if item is None:
                    continue
                yield item
                if item["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            self.reqs.pop(rid, None)

    def _take(self, req: _Req) -> dict[str, Any] | None:
        if not req.queue:
            return None
        if not self.incremental:  # a lagging consumer gets only the newest item
            item, req.queue = req.queue[-1], []
            return item
        items, req.queue = req.queue, []
        out = dict(items[-1])
        out["output_ids"] = [i for it in items for i in it["output_ids"]]
        if "output_token_logprobs" in out["meta_info"] and not out["meta_info"].get("echo"):
            out["meta_info"] = {**out["meta_info"], **{
                k: [x for it in items for x in it["meta_info"][k]]
                for k in ("output_token_logprobs", "output_top_logprobs")}}
        return out

    def _meta(self, req: _Req, finish: Any, *, echo: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": req.rid, "finish_reason": finish}
        if not self.world.drop_usage:
            meta["completion_tokens"] = len(req.ids)
            if not echo:
                meta.update(prompt_tokens=len(req.prompt), cached_tokens=0)
        if req.logprobs is not None:
            if self.incremental and not echo:  # (the echo's: every token's)
                start = req.sent
                meta.update(output_token_logprobs=req.lps[start:],
                            output_top_logprobs=req.tops[start:])
            else:
                meta.update(output_token_logprobs=req.lps, output_top_logprobs=req.tops)
            if echo:
                meta["echo"] = True  # (the fake's own mark: not merged with other items)
        return meta

    def push(self, req: _Req, finish: Any = None, *, echo: bool = False) -> None:
        meta = self._meta(req, finish, echo=echo)  # (before `sent` moves: the item's slice)
        if self.incremental:
            new = req.ids[req.sent:]
            if echo and not new and req.ids:
                new = [req.ids[-1]]  # the abort echo: the last id again
            req.sent = len(req.ids)
            ids = new
        else:
            ids = req.ids if finish is None else list(req.ids)  # live list, final a copy
        req.queue.append({"output_ids": ids, "meta_info": meta})
        req.wake.set()

    @staticmethod
    def _emit(req: _Req, tid: int) -> None:
        """One more token on the live lists (its logprobs too, when asked for)."""
        req.ids.append(tid)
        if req.logprobs is not None:
            req.lps.append((logprob(tid), tid, None))
            req.tops.append(top(tid, req.logprobs))

    def finish(self, req: _Req, finish: dict[str, Any], *, echo: bool = False) -> None:
        req.finished = True
        self.push(req, finish, echo=echo)

    async def scheduler(self) -> None:
        """One step: every running request gets `tokens_per_step` tokens (or its PD event)."""
        while not self.tokenizer_manager.crashed:
            await self.work.wait()
            await asyncio.sleep(self.world.step_s)
            if self.tokenizer_manager.crashed:
                break
            self._admit()
            running = [r for r in self.reqs.values() if not r.finished and r.admitted]
            if not running:
                self.work.clear()
            for req in running:
                await self._step(req)

    def _admit(self) -> None:
        """Requests start in order while their pages fit the pool (--max-total-tokens)."""
        cap = self.server_args.max_total_tokens
        size = self.server_args.page_size
        used = sum(r.pages for r in self.reqs.values() if r.admitted and not r.finished)
        for r in self.reqs.values():
            if r.admitted or r.finished:
                continue
            need = -(-(len(r.prompt) + int(r.sp.get("max_new_tokens", 128))) // size)
            if cap is not None and used + need > cap // size:
                return
            r.admitted, r.pages, used = True, need, used + need

    async def _step(self, req: _Req) -> None:
        _, port, room = req.bootstrap
        if self.mode == "prefill":
            if room in self.world.fail_rooms:
                self.world.room(port, room).set_exception(RuntimeError("KV transfer failed"))
                self.finish(req, {"type": "abort", "message": "KV transfer failed",
                                  "status_code": 500})
                return
            self._emit(req, token(req.prompt, 0))
            self.world.room(port, room).set_result(req.ids[0])
            self.finish(req, {"type": "length", "length": 0})
            return
        if self.mode == "decode" and not req.ids:
            fut = self.world.room(port, room)
            if not fut.done():
                return
            if fut.exception() is not None:
                self.finish(req, {"type": "abort", "message": "prefill failed: KV transfer failed",
                                  "status_code": 500})
                return
            self._emit(req, fut.result())
        else:
            if self.world.empty_items and req.ids and not req.empty_sent:
                req.empty_sent = True
                self.push(req)  # nothing new since the last item; tokens come next step
                return
            req.empty_sent = False
            for _ in range(self.world.tokens_per_step):
                self._emit(req, token(req.prompt, len(req.ids)))
                if self._done(req):
                    break
        if self._done(req):
            stop = req.ids[-1] in set(req.sp.get("stop_token_ids") or ())
            self.finish(req, {"type": "stop", "matched": req.ids[-1]} if stop else
                        {"type": "length", "length": len(req.ids)})
        else:
            self.push(req)

    def _done(self, req: _Req) -> bool:
        return (len(req.ids) >= int(req.sp.get("max_new_tokens", 128))
                or req.ids[-1] in set(req.sp.get("stop_token_ids") or ()))
