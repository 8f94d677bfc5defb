"""perf/streaming/sweep.py's outputs: JSON, CSV and a PNG whose fourth panel is CPU-µs per streamed token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from perf.streaming import sweep  # noqa: E402


def _rows(launched: bool) -> list[dict]:
    rows = []
    for c, tps in ((1, 6000.0), (8, 11000.0), (64, 15000.0)):
        r = {"concurrency": c, "requests": 64, "failed": 0, "tokens_per_s": tps,
             "ttft_p50_ms": 5.0 * c, "ttft_p99_ms": 9.0 * c, "itl_p50_ms": 0.5,
             "itl_p99_ms": 3.0, "client_cpu_us_per_token": 30.0 - c / 8}
        if launched:
            r.update(cpu_us_per_token_prefill=15.0, cpu_us_per_token_decode=60.0 - c / 4,
                     cpu_us_per_token_frontend=100.0 - c / 2)
            r["cpu_us_per_token"] = sum(v for k, v in r.items()
                                        if k.startswith("cpu_us_per_token_"))
        rows.append(r)
    return rows


def _panel(fig, title: str):
    (ax,) = [a for a in fig.axes if a.get_title() == title]
    return ax


def test_the_plot_has_a_cpu_per_token_panel_with_every_process_and_the_client() -> None:
    rows = _rows(launched=True)
    ax = _panel(sweep.plot({"title": "t"}, rows), "CPU-µs per streamed token")
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}
    assert set(lines) == {"frontend + workers", "prefill", "decode", "frontend", "load client"}
    assert lines["frontend + workers"] == [r["cpu_us_per_token"] for r in rows]
    assert lines["load client"] == [r["client_cpu_us_per_token"] for r in rows]


def test_against_a_url_the_panel_shows_the_client_only() -> None:
    ax = _panel(sweep.plot({}, _rows(launched=False)), "CPU-µs per streamed token")
    assert [ln.get_label() for ln in ax.get_lines()] == ["load client"]


def test_write_outputs_writes_json_csv_and_png(tmp_path: Path) -> None:
    rows = _rows(launched=True)
    out = str(tmp_path / "sub" / "sweep")
    sweep.write_outputs(out, {"title": "t"}, rows)
    assert json.loads(Path(out + ".json").read_text())["levels"] == rows
    assert Path(out + ".csv").read_text().splitlines()[0].startswith("concurrency,")
    assert Path(out + ".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
