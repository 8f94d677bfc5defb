"""SGLang's own HTTP server on this CPU, for the side-by-side benchmark: SGLang's
`sglang.launch_server` with what its CPU engine needs here, taken from tandem's adapter so that
both systems run the very same engine (tandem.engines.sglang_cpu: the environment, the stand-in
torchvision, and the scheduler entry point, tandem.engines.sglang.run_cpu_scheduler, that describes
the KV pool to NIXL as host memory, without which SGLang's own 1P1D fails on a CPU, and runs
float32 on SGLang's torch paths). Every other flag is SGLang's, passed as given:

    python -m perf.peers.sglang_server --model-path models/smollm2 --device cpu ...
"""

from __future__ import annotations

import sys


def main() -> None:
    from tandem.engines import sglang_cpu
    from tandem.engines.sglang import run_cpu_scheduler

    sglang_cpu.prepare()
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args

    launch_server(prepare_server_args(sys.argv[1:]),
                  run_scheduler_process_func=run_cpu_scheduler)


if __name__ == "__main__":  # (SGLang spawns its processes: this module must be import-safe)
    main()
