"""`--engine sglang`: SGLang's `Engine` behind tandem's engine contract, the only module that imports
sglang (lazily; tandem runs without it everywhere else). `sglang_options` makes SGLang's flags of
tandem's settings, `sglang_stream` turns SGLang's items into tandem's outputs and `sglang_cpu` holds
everything SGLang's CPU engine needs.

What it owns:
- Building SGLang's `ServerArgs` with SGLang's own argparse: tandem's settings become SGLang flags
  (`tandem.engines.sglang_options`: model, page size, role -> `--disaggregation-mode`, output
  mode -> `--incremental-streaming-output`, `--skip-tokenizer-init` since tandem tokenizes, max
  batch, pool size, bootstrap host/port, log level, nixl transfer, device; `--device cpu` adds what
  SGLang's CPU engine needs, all of it in `tandem.engines.sglang_cpu`), then `engine_args` (every
  SGLang flag tandem did not parse) follow and override the soft defaults (log level, transfer
  backend, bootstrap bind host). A flag that would change what tandem owns, an unknown flag or a
  bad choice is a `SGLangSetupError` naming it. On a CPU, SGLang's scheduler processes start
  through `run_cpu_scheduler` (sglang_cpu.in_scheduler, then SGLang's own).
- Requests: each gets a fresh 32-hex rid for SGLang (SGLang aborts by rid PREFIX, so rids of one
  length never abort each other); tandem's sampling maps to SGLang's keys or is refused naming the
  field; a PD request's Bootstrap(host, port, room) becomes bootstrap_host/port/room. SGLang's
  prefill side ends with one "length" item once the KV is sent; its decode stream already starts
  with the first token. n>1 never reaches SGLang (the frontend fans choices out as requests).
- Outputs: cumulative mode passes SGLang's live id list through uncopied with `completion_tokens`
  as read at receipt: SGLang only appends to that list after the yield, so slicing
  `[sent:completion_tokens]` (the worker's DeltaMaker) is exact whatever happens later; incremental
  mode trims SGLang's abort echo (the last id sent, repeated) by `completion_tokens`. Empty
  non-final items are dropped; usage fields are read with defaults (the last seen value).
  An abort finish that tandem did not ask for is the request's failure: "error", with an
  `EngineRequestError` for SGLang's 400s and an `EngineError` otherwise.
- SGLang's process-wide effects: it registers SIGQUIT (a child died) to SIGKILL this process, and
  SIGTERM on the event loop to drain itself. Here SIGQUIT fails every live request, kills SGLang's
  children and stops the worker through `on_fatal`; SIGTERM is re-raised as SIGINT, which tandem's
  lifecycle treats as its own drain signal. `shutdown` kills only the processes SGLang started
  (SGLang's own shutdown SIGKILLs every child of the process) and unregisters SGLang's atexit hook.

The worker process: SGLang starts its schedulers with multiprocessing `spawn`, so the worker's entry
point must be import-safe (the `tandem` console script is; a script running a worker needs an
`if __name__ == "__main__":` guard). Importing SGLang's engine module sets uvloop's event-loop
policy. `start` must run on the main thread (signal handlers) and blocks the loop while SGLang loads
the model; at most one SGLang engine may live in a process.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import os
import signal
import sys
import uuid
from multiprocessing import resource_tracker
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any, NoReturn

import msgspec
import psutil

from tandem.config import WorkerConfig
from tandem.engines import sglang_cpu
from tandem.engines.base import EngineError, EngineOutput, EngineRequest, EngineRequestError
from tandem.engines.base import ModelSpec
from tandem.engines.grammars import refuse
from tandem.engines.iterator import IteratorEngine
from tandem.engines.sampling import check_sampling
from tandem.engines.sglang_options import (  # (re-exported: the adapter's public names)
    DISAGGREGATION_MODES, OUTPUT_MODE, OWNED, SGLangOptions, SGLangSetupError, server_argv,
)
from tandem.engines.sglang_stream import ENGINE_ENV, SGLangStream, generate_kwargs
from tandem.runtime.wire import Load

__all__ = ["DISAGGREGATION_MODES", "OUTPUT_MODE", "OWNED", "SGLangEngine", "SGLangOptions",
           "SGLangSetupError", "build_server_args", "run_cpu_scheduler", "server_argv",
           "sglang_parser"]

log = logging.getLogger("tandem.engines.sglang")

INSTALL_HINT = "pip install 'tandem[sglang]' (on a CUDA machine: SGLang runs on NVIDIA GPUs)"
CHILD_EXIT_TIMEOUT_S = 10.0  # SIGTERM to SGLang's processes, then SIGKILL after this long


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SGLangSetupError(f"SGLang flags: {message}")


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog="tandem worker --engine sglang", add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def build_server_args(opts: SGLangOptions,
                      sigquit_handler: Callable[[int, FrameType | None], Any] | None = None) -> Any:
    """SGLang's ServerArgs, through SGLang's own argparse (choices checked, no flag re-declared)."""
    from sglang.srt.server_args import ServerArgs

    parser = sglang_parser()
    argv = server_argv(opts)
    base = parser.parse_args(["--model-path", opts.model])
    theirs = parser.parse_args(["--model-path", opts.model, *opts.engine_args])
    owned = [d for d, (flag, _) in OWNED.items()
             if flag in argv or d == "incremental_streaming_output"]
    for dest in owned:
        if getattr(theirs, dest) != getattr(base, dest):
            raise SGLangSetupError(f"SGLang flags: {OWNED[dest][0]} is set by tandem "
                                   f"({OWNED[dest][1]}); remove it from the SGLang flags")
    mine = parser.parse_args(argv)
    ns = parser.parse_args([*argv, *opts.engine_args])
    for dest in owned:
        if getattr(ns, dest) != getattr(mine, dest):
            raise SGLangSetupError(f"SGLang flags: they change {dest}, which tandem sets")
    if sigquit_handler is not None:
        ns.custom_sigquit_handler = sigquit_handler
    return ServerArgs.from_cli_args(ns)


def _default_factory(server_args: Any) -> Any:
    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 0
    if gpus == 0 and not sglang_cpu.is_cpu(getattr(server_args, "device", "")):
        raise SGLangSetupError("--engine sglang needs a CUDA GPU or --device cpu (SGLang's CPU "
                               "engine), and this machine has no GPU")
    from sglang.srt.entrypoints.engine import Engine  # (sglang.Engine is a lazy stand-in)

    engine = sglang_cpu.engine_class(server_args, Engine, run_cpu_scheduler)
    return engine(server_args=server_args)


def run_cpu_scheduler(*args: Any, **kwargs: Any) -> Any:
    """SGLang's scheduler process on a CPU (sglang_cpu.in_scheduler first). Module-level, so that
    spawn can pickle it."""
    from sglang.srt.utils import common

    sglang_cpu.in_scheduler(args, common, sys.modules)
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process(*args, **kwargs)


_SIGQUIT: list[Callable[[], None]] = []  # the live engine's (at most one per process)


def on_sigquit(signum: int, frame: FrameType | None) -> None:
    """SGLang's SIGQUIT in its launch phase (a child died). Module-level: ServerArgs holds it and
    is pickled into SGLang's spawned processes, which cannot pickle a closure."""
    for callback in _SIGQUIT:
        callback()


# --- the engine -----------------------------------------------------------------------------------

class SGLangEngine(IteratorEngine):
    name = "sglang"

    def __init__(self, opts: SGLangOptions, *,
                 engine_factory: Callable[[Any], Any] = _default_factory,
                 server_args_builder: Callable[..., Any] = build_server_args,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.opts = opts
        self.output_mode = opts.output_mode
        self.page_size = opts.page_size
        # SGLang's pool: --max-total-tokens when tandem sets it (--num-pages, the CPU default),
        # else sized by SGLang in its scheduler process, where tandem cannot read it cheaply (0).
        self.num_pages = opts.pool_pages
        self.spec = ModelSpec(name=os.path.basename(os.path.normpath(opts.model)), max_context=0)
        self._factory = engine_factory
        self._build_args = server_args_builder
        self._on_fatal = on_fatal
        self._engine: Any = None
        self._children: list[psutil.Process] = []  # the processes SGLang started
        self._deterministic = False
        self._sglang_tasks: list[asyncio.Task[Any]] = []

    @classmethod
    def from_config(cls, cfg: WorkerConfig) -> SGLangEngine:
        from tandem.runtime import lifecycle

        return cls(SGLangOptions.from_config(cfg),
                   on_fatal=lambda why: lifecycle.crash(why))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        def died() -> None:
            loop.call_soon_threadsafe(self._scheduler_died)

        _SIGQUIT[:] = [died]
        os.environ.update(ENGINE_ENV)  # (before sglang is imported)
        if sglang_cpu.is_cpu(self.opts.device):
            sglang_cpu.prepare()
        try:
            server_args = self._build_args(self.opts, on_sigquit)
        except ImportError as e:
            raise SGLangSetupError(f"--engine sglang: sglang is not installed ({e}); "
                                   f"{INSTALL_HINT}") from e
        self._deterministic = bool(getattr(server_args, "enable_deterministic_inference", False))
        me = psutil.Process()
        before = {p.pid for p in me.children()}
        try:
            self._engine = self._factory(server_args)  # blocks while SGLang loads the model
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"SGLang failed to start: {e!r}") from e
        finally:  # (spawn's resource tracker ignores SIGTERM and ends with us: not SGLang's)
            tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
            self._children = [p for p in me.children() if p.pid not in {*before, tracker}]
        atexit.unregister(self._engine.shutdown)  # it would SIGKILL every child of this process
        tm = self._engine.tokenizer_manager
        if not hasattr(tm, "signal_handler_class"):
            raise SGLangSetupError("this SGLang release has no TokenizerManager."
                                   "signal_handler_class; tandem cannot contain its signals")
        tm.signal_handler_class = self._signal_handlers
        known = set(getattr(tm, "asyncio_tasks", ()))
        tm.auto_create_handle_loop()  # now, on this loop, with tandem's signal handlers
        self._sglang_tasks = [t for t in getattr(tm, "asyncio_tasks", ()) if t not in known]
        config = getattr(tm, "model_config", None)
        eos = getattr(config, "hf_eos_token_id", None) or ()
        self.spec = ModelSpec(name=self.spec.name,
                              max_context=int(getattr(tm, "context_len", 0) or 0),
                              eos_token_ids=tuple(sorted(eos)),
                              vocab_size=int(getattr(config, "vocab_size", 0) or 0))
        if self.opts.role == "prefill":
            port = getattr(server_args, "disaggregation_bootstrap_port", self.opts.bootstrap_port)
            self.bootstrap_addr = f"{self.opts.advertise_host or self.opts.host}:{port}"
        self._mark_started()

    def load(self) -> Load:
        """IteratorEngine.load, and as waiting the requests SGLang holds after tandem let them go
        (an abort on its way through SGLang, which frees their KV): idle is idle in SGLang too."""
        load = super().load()
        held = len(getattr(getattr(self._engine, "tokenizer_manager", None), "rid_to_state", ()))
        extra = held - len(self._live)
        if extra > 0:
            load = msgspec.structs.replace(load, waiting=load.waiting + extra)
        return load

    def _signal_handlers(self, tokenizer_manager: Any) -> Any:
        """What SGLang's TokenizerManager registers on the event loop (running phase)."""
        engine = self

        class Handlers:
            def sigterm_handler(self, signum: int | None = None, frame: Any = None) -> None:
                os.kill(os.getpid(), signal.SIGINT)  # tandem's lifecycle drains on SIGINT

            def running_phase_sigquit_handler(self, signum: int | None = None,
                                              frame: Any = None) -> None:
                engine._scheduler_died()

        return Handlers()

    def _scheduler_died(self) -> None:
        why = "SGLang's scheduler process died"
        log.error("%s: failing %d requests and stopping", why, len(self._live))
        self.fail_all(EngineError(why))
        self._kill_children(timeout=0.0)
        if self._on_fatal is not None:
            self._on_fatal(why)

    def _check(self, req: EngineRequest) -> None:
        if self.opts.role != "agg" and req.bootstrap is None:
            raise EngineRequestError(f"a {self.opts.role} request needs a bootstrap (host, port, "
                                     "room)")
        if self.opts.role == "agg" and req.bootstrap is not None:
            raise EngineRequestError("an aggregated sglang worker takes no bootstrap")
        if not req.prompt_ids:
            raise EngineRequestError("the prompt is empty")
        vocab = self.spec.vocab_size  # an id past it crashes SGLang's scheduler (seen live)
        if vocab and max(req.prompt_ids) >= vocab:
            raise EngineRequestError(f"token id {max(req.prompt_ids)} is past the vocabulary")
        limit = self.spec.max_context  # SGLang's own checks, made before anything is held
        if limit and len(req.prompt_ids) >= limit:
            raise EngineRequestError(f"the prompt ({len(req.prompt_ids)} tokens) is longer than "
                                     f"the model's context length ({limit})")
        if limit and len(req.prompt_ids) + req.sampling.max_tokens > limit:
            raise EngineRequestError(f"prompt ({len(req.prompt_ids)}) + max_tokens "
                                     f"({req.sampling.max_tokens}) exceed the model's context "
                                     f"length ({limit})", param="max_tokens")
        check_sampling(req.sampling, self.spec.vocab_size)
        refuse(req.sampling, self.name, " (tandem tokenizes, so SGLang has no grammar backend)")
        generate_kwargs(req, "", deterministic=self._deterministic)

    async def _stream(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        srid = uuid.uuid4().hex  # fixed length: SGLang's abort matches rids by prefix
        engine = self._engine
        stream = SGLangStream(req.rid, self.output_mode == "incremental", len(req.prompt_ids),
                              req.sampling.logprobs)
        finished = False
        try:
            gen = await engine.async_generate(
                **generate_kwargs(req, srid, deterministic=self._deterministic))
            async for item in gen:
                out = stream.convert(item)
                if out is None:
                    continue
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            if not finished:
                try:
                    engine.tokenizer_manager.abort_request(rid=srid)
                except Exception as e:  # the engine may be gone (crash, shutdown)
                    log.debug("abort of %s failed: %r", srid, e)

    async def shutdown(self) -> None:
        await super().shutdown()
        for task in self._sglang_tasks:
            task.cancel()
        if self._sglang_tasks:
            await asyncio.gather(*self._sglang_tasks, return_exceptions=True)
        self._sglang_tasks = []
        engine, self._engine = self._engine, None
        if engine is not None:
            watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
            if watchdog is not None:
                watchdog.stop()  # SGLang's children exit now on purpose
        if self._children:
            await asyncio.to_thread(self._kill_children, CHILD_EXIT_TIMEOUT_S)

    def _kill_children(self, timeout: float) -> None:
        """SIGTERM the processes SGLang started (and theirs), SIGKILL what is left after
        `timeout` seconds. Nothing else of this process is touched."""
        procs: list[psutil.Process] = []
        for p in self._children:
            try:
                procs += [*p.children(recursive=True), p]
            except psutil.NoSuchProcess:
                pass
        self._children = []
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
