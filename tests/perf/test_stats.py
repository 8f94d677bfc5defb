"""perf/common/stats.py, the quantile every benchmark reports, and bench_tenants' pooled p99 over
several runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from perf.common.stats import quantile
from perf.streaming.bench_tenants import pooled


def test_quantile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 201)]  # 1..200; the order given does not matter
    assert quantile(reversed(values), 0.5) == 101.0
    assert quantile(values, 0.99) == 199.0  # the 2nd largest of 200
    assert quantile(values, 1.0) == 200.0
    assert quantile(values, 0.0) == 1.0
    assert quantile([5.0, math.nan, 1.0], 1.0) == 5.0  # NaNs are left out
    assert math.isnan(quantile([], 0.5))
    assert math.isnan(quantile([math.nan], 0.5))


def _run(alone: list[float], loaded: list[float]) -> dict:
    return {"quiet_alone": {"ttfts_ms": alone}, "quiet_loaded": {"ttfts_ms": loaded}}


def test_pooled_takes_every_runs_requests_together():
    # One run's p99 of 100 requests is its largest; over two runs' 200, the 2nd largest.
    a = _run([10.0] * 99 + [30.0], [20.0] * 97 + [40.0, 41.0, 90.0])
    b = _run([10.0] * 98 + [25.0, 26.0], [20.0] * 100)
    got = pooled([a, b])
    assert got["alone_p99_ms"] == 26.0
    assert got["loaded_p99_ms"] == 41.0
    assert got["p99_ratio"] == 41.0 / 26.0
    assert (got["requests_alone"], got["requests_loaded"]) == (200, 200)


def test_pool_reads_out_files(tmp_path):
    files = []
    for i, run in enumerate([_run([10.0, 20.0], [30.0, 50.0]), _run([10.0, 40.0], [30.0, 60.0])]):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps({"runs": [run]}))
        files.append(str(path))
    out = subprocess.run([sys.executable, "perf/streaming/bench_tenants.py", "--pool", *files],
                         capture_output=True, text=True, check=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    got = json.loads(out.stdout)
    assert (got["alone_p99_ms"], got["loaded_p99_ms"]) == (40.0, 60.0)
    assert got["requests_loaded"] == 4
