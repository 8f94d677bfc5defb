"""GPUs for `tandem up`'s workers: which GPUs this machine offers, which each worker gets (its
CUDA_VISIBLE_DEVICES, handed out in the plan's order: aggregated or prefill workers first, then
decode), and what its engine is told so that it uses them (the reference engine's `--device cuda`,
SGLang's `--tp-size`).

GPUs are handed out when `--gpus` is given or a worker needs them (`--engine sglang` without
`--device cpu`, `--device cuda`, a TP above 1); then the list is `--gpus`, else
$CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists. `--cpu` hands out none: each worker gets an
empty CUDA_VISIBLE_DEVICES, and SGLang workers `--device cpu` (SGLang's CPU engine). Otherwise the
workers inherit this process's environment as it is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from tandem.up_config import UpGpus
from tandem.converters import gpu_list
from tandem.plans import Plan

ENV = "CUDA_VISIBLE_DEVICES"
SGLANG_TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")  # SGLang's spellings of its TP


def visible(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """$CUDA_VISIBLE_DEVICES when it is set, else the indexes nvidia-smi lists, else none."""
    env = os.environ if env is None else env
    if ENV in env:
        try:
            return gpu_list(env[ENV])
        except ValueError as e:
            raise ValueError(f"{ENV}={env[ENV]!r}: {e}; pass --gpus LIST, or --cpu") from None
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    if exe is None:
        return ()
    try:
        out = subprocess.run([exe, "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return gpu_list(",".join(out.stdout.split())) if out.returncode == 0 else ()


def assign(workers: Sequence[tuple[str, int]], gpus: Sequence[str]) -> list[tuple[str, ...]]:
    """The GPUs of each worker, given as (role, GPUs per worker) in plan order, handed out in
    order; ValueError when there are too few."""
    need = sum(tp for _, tp in workers)
    if need > len(gpus):
        parts = " + ".join(f"{n} {role} x TP{tp}" for (role, tp), n in Counter(workers).items())
        raise ValueError(f"not enough GPUs: {parts} need {need}, have {len(gpus)} "
                         f"({','.join(gpus) or 'none'})")
    out, at = [], 0
    for _, tp in workers:
        out.append(tuple(gpus[at:at + tp]))
        at += tp
    return out


def with_gpus(p: Plan, cfg: UpGpus, *, engine: str, device: str = "",
              engine_args: Sequence[str] = (),
              found: Callable[[], tuple[str, ...]] = visible) -> Plan:
    """`p` with each worker's GPUs (module docstring), the engine flags that make it use them,
    then `engine_args` (the engine's own flags) last. `device`: --device as given ("" = not).
    ValueError names what cannot be done."""
    tps = [cfg.tp_of(w.role) for w in p.workers]
    why = [what for what, on in (("--gpus", bool(cfg.gpus)),
                                 ("--engine sglang", engine == "sglang" and device != "cpu"
                                  and not cfg.cpu),
                                 (f"--device {device}", device.startswith("cuda")),
                                 ("a TP above 1", max(tps, default=1) > 1)) if on]
    if engine == "sglang" and any(a.split("=")[0] in SGLANG_TP_FLAGS for a in engine_args):
        raise ValueError("SGLang's TP is set by tandem up (--tp, --prefill-tp, --decode-tp: each "
                         "worker gets that many GPUs and --tp-size); remove --tp-size")
    sets: list[tuple[str, ...] | None] = [None] * len(p.workers)
    if cfg.cpu and why:
        raise ValueError(f"--cpu hands out no GPUs, but {why[0]} needs them")
    if cfg.cpu:
        sets = [()] * len(p.workers)
    elif why and p.workers:
        gpus = cfg.gpus or found()
        if not gpus:
            raise ValueError(f"no GPUs found ({why[0]} needs them; no --gpus, {ENV} or "
                             "nvidia-smi): pass --gpus LIST, or --cpu")
        if device not in ("", "cuda", "cuda:0"):
            raise ValueError(f"--device {device}: each worker sees only its own GPUs "
                             f"({ENV}); use --device cuda, and --gpus to choose them")
        sets = list(assign([(w.role, tp) for w, tp in zip(p.workers, tps)], gpus))
    workers = []
    for w, tp, mine in zip(p.workers, tps, sets):
        extra = ["--device", "cuda"] if mine and engine == "reference" and not device else []
        extra += ["--device", "cpu"] if cfg.cpu and engine == "sglang" and not device else []
        extra += ["--tp-size", str(tp)] if engine == "sglang" else []
        workers.append(replace(w, argv=(*w.argv, *extra, *engine_args), gpus=mine,
                               env=() if mine is None else ((ENV, ",".join(mine)),)))
    return replace(p, workers=tuple(workers))
