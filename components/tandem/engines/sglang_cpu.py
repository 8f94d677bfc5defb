"""SGLang on a CPU (`tandem worker --engine sglang --device cpu`): every CPU specific of the
adapter, in one place, so that a user passes no SGLang flag beyond what any engine takes. Found by
running SGLang 0.5.23 on an x86-64 CPU (README, "SGLang on a CPU", has the install and the build of
the kernel library it needs):

- `SGLANG_USE_CPU_ENGINE=1` in this process's environment before sglang is imported (its platform
  detection reads it; the scheduler processes SGLang spawns inherit it);
- `--device cpu`, `--disable-overlap-schedule` (the overlap scheduler needs CUDA streams) and
  `--attention-backend torch_native` (below, CPU_FLAGS);
- a bounded KV pool: `--max-total-tokens` from tandem's `--num-pages` x `--page-size`, else
  `DEFAULT_MAX_TOTAL_TOKENS` (unbounded, SGLang sizes it at ~72% of the free RAM: 11 GB for a tiny
  model);
- a stand-in `torchvision` (`tandem/engines/standins/`) first on sys.path when the real one is
  absent or does not import: SGLang imports it at module level, and PyPI's build needs a CUDA
  torch. SGLang's spawned processes get this process's sys.path, so they find it too.

SGLang captures no graphs on a CPU. On a CPU with AMX, SGLang's own kernels (RMSNorm) take
bfloat16 or float16 only: `--dtype float32` fails there at the first request; `--dtype bfloat16`
works.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("tandem.engines.sglang")

DEFAULT_MAX_TOTAL_TOKENS = 16_384  # SmolLM2-135M in float32: 720 MiB of KV
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# torch_native attention: on a CPU with AMX SGLang picks its intel_amx backend, whose kernel call
# does not match the CPU kernel library built from an older tree (extend_attention_cpu: 22
# arguments given, 19 declared). A user's --attention-backend, later on the line, still wins.
CPU_FLAGS = ("--device", "cpu", "--disable-overlap-schedule", "--attention-backend",
             "torch_native")
STANDINS = Path(__file__).resolve().parent / "standins"
DEVICE_HELP = (  # the worker's --device (tandem.config)
    "where the engine computes: cpu, cuda, cuda:N (default: the engine's own: the CPU for "
    "reference, a GPU for sglang). sglang on cpu is SGLang's CPU engine (it needs the CPU build of "
    "SGLang's kernel library: README, \"SGLang on a CPU\"), and tandem sets what that needs: "
    "SGLANG_USE_CPU_ENGINE=1, --device cpu, --disable-overlap-schedule, --attention-backend "
    "torch_native, --max-total-tokens "
    f"(--num-pages x --page-size, else {DEFAULT_MAX_TOTAL_TOKENS}) and, when the real one does not "
    "import, a stand-in torchvision")


def is_cpu(device: str) -> bool:
    return device == "cpu"


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
