"""The in-process micro benchmarks still run against the code they measure (their fakes follow
the pool's and the app's signatures): a few requests each, their figures' shape checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _last_line(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'components'}"}
    out = subprocess.run([sys.executable, str(ROOT / "perf" / "micro" / script), *args],
                         env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT / "perf" / "micro")  # (where count_instructions.sh runs it)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def _run(script: str, *args: str) -> dict[str, object]:
    result: dict[str, object] = json.loads(_last_line(script, *args))
    return result


def test_the_app_bench_streams_every_token() -> None:
    for route in ([], ["--nowait"]):
        r = _run("bench_app_inprocess.py", "--requests", "6", "--tokens", "5",
                 "--concurrency", "2", *route)
        assert r["tokens"] == 30 and r["body_writes"] == 30, r


def test_the_worker_bench_serves_every_request() -> None:
    line = _last_line("bench_worker_inprocess.py", "--requests", "40", "--tokens", "2",
                      "--concurrency", "8", "--repeats", "1")
    assert re.fullmatch(r"\d+\.\d+ us CPU per request \(2 tokens, 8 in flight\)", line), line
