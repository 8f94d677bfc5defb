"""The reference engine's decode step, this tree's model against a baseline commit's, in one
process, in turn (old, new, old, new ...): the machine drifts by 20-30% between minutes, so only
the ratio of neighbouring runs is quoted.

    .venv/bin/python perf/micro/bench_reference_step.py --baseline 4b7c585 --model models/smollm2

Prints, per batch size, new/old for each alternation and the last pair's milliseconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import torch

from tandem.engines.reference.model import Llama, page_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULE = "components/tandem/engines/reference/model.py"


def baseline_model(commit: str) -> type:
    src = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:{MODULE}"], check=True,
                         capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "baseline_model.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("baseline_model", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["baseline_model"] = mod
    spec.loader.exec_module(mod)
    return mod.Llama


def step_s(model: Llama, kv: torch.Tensor, batch: int, ctx: int, reps: int) -> float:
    size = kv.shape[3]
    pages = [list(range(i * 8, i * 8 + ctx // size + 1)) for i in range(batch)]
    ids = torch.randint(0, model.config.vocab_size, (batch,))
    pos, table = torch.full((batch,), ctx), page_table(pages)
    model.decode(kv, ids, pos, table)
    t = time.perf_counter()
    for _ in range(reps):
        model.decode(kv, ids, pos, table)
    return (time.perf_counter() - t) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="commit whose model.py is the baseline")
    p.add_argument("--model", default="models/smollm2")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=48)
    p.add_argument("--alternations", type=int, default=4)
    p.add_argument("--reps", type=int, default=4)
    a = p.parse_args()
    new = Llama.from_checkpoint(a.model)
    old = baseline_model(a.baseline).from_checkpoint(a.model)
    kv = new.new_kv_cache(1024, 16)
    for b in (int(x) for x in a.batches.split(",")):
        ratios = []
        for _ in range(a.alternations):
            t_old = step_s(old, kv, b, a.context, a.reps)
            t_new = step_s(new, kv, b, a.context, a.reps)
            ratios.append(t_new / t_old)
        print(f"batch {b}: new/old {[round(r, 3) for r in ratios]}  "
              f"(last: old {t_old * 1e3:.0f} ms, new {t_new * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
