"""SGLang on a CPU (`tandem worker --engine sglang --device cpu`): every CPU specific of the
adapter, in one place, so that a user passes no SGLang flag beyond what any engine takes. Found by
running SGLang 0.5.23 on an x86-64 CPU (README, "SGLang on a CPU", has the install and the build of
the kernel library it needs):

- `SGLANG_USE_CPU_ENGINE=1` in this process's environment before sglang is imported (its platform
  detection reads it; the scheduler processes SGLang spawns inherit it);
- `--device cpu`, `--disable-overlap-schedule` (the overlap scheduler needs CUDA streams),
  `--attention-backend torch_native` and `--sleep-on-idle` (below, CPU_FLAGS);
- a bounded KV pool: `--max-total-tokens` from tandem's `--num-pages` x `--page-size`, else
  `DEFAULT_MAX_TOTAL_TOKENS` (unbounded, SGLang sizes it at ~72% of the free RAM: 11 GB for a tiny
  model);
- a stand-in `torchvision` (`tandem/engines/standins/`) first on sys.path when the real one is
  absent or does not import: SGLang imports it at module level, and PyPI's build needs a CUDA
  torch. SGLang's spawned processes get this process's sys.path, so they find it too.

PD (`--role prefill|decode`) goes through SGLang's own NIXL transfer, which on a CPU needs two
things more, both here:
- `--disaggregation-decode-retraction-backup cpu_tensor` on the decode side (SGLang's default
  backs a retracted request's KV up in CUDA memory);
- the KV pool described to NIXL as host memory. SGLang 0.5.23 says `VRAM` in every `nixl_agent`
  call that takes a memory type (register_memory, get_xfer_descs, prep_xfer_dlist, ...), and
  UCX refuses a host pointer called VRAM; changing only some of the calls fails later with
  NIXL_ERR_NOT_FOUND. `tandem.engines.sglang.run_cpu_scheduler` is the scheduler process's entry
  point on a CPU (SGLang's `Engine.run_scheduler_process_func`, its seam for this): `in_scheduler`
  wraps each `nixl_agent` method that takes a memory type so that `VRAM` becomes `DRAM` in that
  process, then SGLang's own scheduler runs. Nothing else changes, and nothing changes on a GPU. tests/sglang/test_sglang_cpu.py
  fails if NIXL grows a memory-typed method this does not wrap, or if SGLang's NIXL transfer calls
  a memory-typed method outside `NIXL_MEM_TYPED` with a literal memory type.

SGLang captures no graphs on a CPU. On a CPU with AMX, SGLang's own kernels (RMSNorm, the
projections) take bfloat16 or float16 only, so with `--dtype float32` the scheduler process runs
SGLang's torch paths instead (`float32_kernels`); with it SmolLM2's greedy answers and logprobs
equal transformers' in float32. bfloat16 keeps SGLang's AMX kernels (faster; answers close to
transformers' in bfloat16, not equal).

This module imports neither sglang nor nixl (`tandem.engines.sglang` and
`tandem.kv.transfer.nixl_api` do): what it needs of them is passed in.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.kv.transfer import nixl_api

log = logging.getLogger("tandem.engines.sglang")

DEFAULT_MAX_TOTAL_TOKENS = 16_384  # SmolLM2-135M in float32: 720 MiB of KV
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# torch_native attention: on a CPU with AMX SGLang picks its intel_amx backend, whose kernel call
# does not match the CPU kernel library built from an older tree (extend_attention_cpu: 22
# arguments given, 19 declared). A user's --attention-backend, later on the line, still wins.
# --sleep-on-idle: an idle scheduler waits on its sockets (woken by a request at once) instead of
# polling; without it each idle SGLang scheduler took 13% (agg) to 47% (PD) of a core here.
CPU_FLAGS = ("--device", "cpu", "--disable-overlap-schedule", "--attention-backend",
             "torch_native", "--sleep-on-idle")
DECODE_FLAGS = ("--disaggregation-decode-retraction-backup", "cpu_tensor")
# Every nixl_agent method with a memory-type parameter (NIXL 1.5.1), and that parameter's name.
NIXL_MEM_TYPED = ("get_reg_descs", "get_remote_descs", "get_xfer_descs", "prep_xfer_dlist",
                  "query_memory", "register_memory")
NIXL_MEM_PARAM = "mem_type"
STANDINS = Path(__file__).resolve().parent / "standins"
DEVICE_HELP = (  # the worker's --device (tandem.config)
    "where the engine computes: cpu, cuda, cuda:N (default: the engine's own: the CPU for "
    "reference, a GPU for sglang). sglang on cpu is SGLang's CPU engine (it needs the CPU build of "
    "SGLang's kernel library: README, \"SGLang on a CPU\"), and tandem sets what that needs: "
    "SGLANG_USE_CPU_ENGINE=1, --device cpu, --disable-overlap-schedule, --attention-backend "
    "torch_native, --sleep-on-idle, --max-total-tokens "
    f"(--num-pages x --page-size, else {DEFAULT_MAX_TOTAL_TOKENS}), for a decode worker "
    "--disaggregation-decode-retraction-backup cpu_tensor, for PD NIXL told that the KV pool is "
    "host memory, and, when the real one does not import, a stand-in torchvision")


def is_cpu(device: str) -> bool:
    return device == "cpu"


def flags(role: str) -> tuple[str, ...]:
    """SGLang's flags for its CPU engine in a worker of this role."""
    return CPU_FLAGS + DECODE_FLAGS if role == "decode" else CPU_FLAGS


def engine_class(server_args: Any, engine: type, run_scheduler: Callable[..., Any]) -> type:
    """SGLang's Engine, or on a CPU one whose scheduler processes start with `run_scheduler`
    (SGLang's seam for it, `Engine.run_scheduler_process_func`)."""
    if not is_cpu(getattr(server_args, "device", "")):
        return engine

    class CpuEngine(engine):
        run_scheduler_process_func = staticmethod(run_scheduler)

    return CpuEngine


def num_pages(pages: int, page_size: int) -> int:
    """The KV pool of a CPU engine in pages: tandem's --num-pages, else the default's."""
    return pages or max(1, DEFAULT_MAX_TOTAL_TOKENS // page_size)


def prepare() -> None:
    """This process, made ready for SGLang's CPU engine (before sglang is imported)."""
    os.environ.update(CPU_ENV)
    if use_torchvision_standin():
        log.info("torchvision is absent or does not import: SGLang gets tandem's stand-in "
                 "(text models only)")


def use_torchvision_standin() -> bool:
    """Put the stand-in first on sys.path unless a real torchvision imports; True if it is used."""
    if str(STANDINS) in sys.path:
        return True
    if importlib.util.find_spec("torchvision") is not None:
        try:
            importlib.import_module("torchvision")
            return False
        except Exception as e:  # a CUDA build on a CPU torch: "operator torchvision::nms ..."
            log.debug("torchvision does not import: %r", e)
            for name in [m for m in sys.modules if m == "torchvision"
                         or m.startswith("torchvision.")]:
                del sys.modules[name]
    sys.path.insert(0, str(STANDINS))
    importlib.invalidate_caches()
    return True


def host_mem_type(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` with its memory-type argument VRAM read as DRAM (positional or by keyword)."""
    params = list(inspect.signature(method).parameters)
    if NIXL_MEM_PARAM not in params:
        raise RuntimeError(f"nixl_agent.{method.__name__} has no {NIXL_MEM_PARAM} parameter: "
                           "this NIXL release differs from the one tandem's CPU PD was built for")
    at = params.index(NIXL_MEM_PARAM)  # counts self: args[at] once bound

    def on_host(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get(NIXL_MEM_PARAM) == "VRAM":
            kwargs[NIXL_MEM_PARAM] = "DRAM"
        elif len(args) > at and args[at] == "VRAM":
            args = (*args[:at], "DRAM", *args[at + 1:])
        return method(*args, **kwargs)

    on_host.__wrapped__ = method  # type: ignore[attr-defined]
    on_host.__name__ = method.__name__
    return on_host


def nixl_on_host(agent_class: Any, names: tuple[str, ...] = NIXL_MEM_TYPED) -> None:
    """Every memory-typed method of NIXL's agent class reads VRAM as DRAM (once per class)."""
    if "_tandem_on_host" in vars(agent_class):
        return
    for name in names:
        setattr(agent_class, name, host_mem_type(getattr(agent_class, name)))
    agent_class._tandem_on_host = True


def float32_kernels(common: Any, modules: dict[str, Any]) -> None:
    """SGLang's torch paths instead of its AMX kernels, which take bfloat16 or float16 only (float32
    fails at the first request on a CPU with AMX). SGLang decides at import, module by module, from
    `cpu_has_amx_support()`: this makes it false (`common`: sglang.srt.utils.common) before the
    model's modules are imported, and in those of `modules` (sys.modules) already imported."""
    common.is_amx_tile_supported = False
    for name, module in list(modules.items()):
        if name.startswith("sglang.") and getattr(module, "_is_cpu_amx_available", False):
            module._is_cpu_amx_available = False


def in_scheduler(args: tuple[Any, ...], common: Any, modules: dict[str, Any]) -> None:
    """SGLang's scheduler process on a CPU, before SGLang's own `run_scheduler_process(*args)`:
    float32 on SGLang's torch paths, and NIXL told the KV pool is host memory."""
    os.environ.update(CPU_ENV)
    if args and getattr(args[0], "dtype", "") == "float32":  # (args[0]: its ServerArgs)
        float32_kernels(common, modules)
    try:
        api, _ = nixl_api.load()
    except ImportError:
        return  # no NIXL: an aggregated worker, or SGLang reports the missing transfer itself
    nixl_on_host(api.nixl_agent)
