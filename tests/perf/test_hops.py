"""perf/streaming/hops.py on timelines written by hand: the hops it finds are the ones the lines
say (a prompt chunked over two steps, steps it waited out on its worker and not on another, a
request with no step of its own, one cut short)."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest

from perf.streaming import hops

FRONTEND = """\
10.000 arrive a T1 9.998
10.001 placed a
10.010 arrive b T2 10.009
10.011 placed b
10.020 arrive c T1 10.019
10.020 placed c
10.100 first a
10.101 chunk a
10.200 first b
10.230 chunk b
10.300 first c
10.301 chunk c
10.400 arrive d T2 10.399
"""

WORKER = """\
10.002 recv a
10.003 step 0 4
10.012 recv b
10.013 end
10.013 step 512 4 a
10.040 end
10.040 step 256 5 a b
10.060 end
10.061 out a
10.061 out b
10.061 step 0 6
10.08
"""

# A second worker: its steps are not the ones `a` and `b` waited out.
OTHER = """\
10.005 step 0 1
10.006 end
10.021 recv c
10.290 out c
"""


@pytest.fixture
def timeline(tmp_path: Any) -> hops.Timeline:
    for name, text in (("1.tl", FRONTEND), ("2.tl", WORKER), ("3.tl", OTHER)):
        (tmp_path / name).write_text(text)
    return hops.read(str(tmp_path))


def test_a_chunked_prompt(timeline: hops.Timeline) -> None:
    row = hops.hops(timeline, "a", (9.990, 10.105))
    assert row is not None
    assert row["http"] == pytest.approx(10.0)  # 10.000 - 9.990
    assert row["admit"] == pytest.approx(1.0) and row["to_worker"] == pytest.approx(1.0)
    assert row["wait"] == pytest.approx(11.0)  # recv 10.002 -> its first step 10.013
    assert row["waited"] == 1  # the step of 10.003 on its worker; not the other worker's
    assert row["compute"] == pytest.approx(47.0)  # 10.013 -> the second chunk's end, 10.060
    assert (row["prefill_tokens"], row["decodes"]) == (512, 4)  # its first step's batch
    assert row["out"] == pytest.approx(1.0) and row["first"] == pytest.approx(39.0)
    assert row["held"] == pytest.approx(1.0) and row["to_client"] == pytest.approx(4.0)
    assert row["ttft"] == pytest.approx(115.0)  # the client's own


def test_held_back_text_and_no_client(timeline: hops.Timeline) -> None:
    row = hops.hops(timeline, "b")
    assert row is not None
    assert row["held"] == pytest.approx(30.0)  # first 10.200 -> chunk 10.230
    assert row["waited"] == 1 and row["wait"] == pytest.approx(28.0)  # the step of 10.013 ran
    assert math.isnan(row["http"]) and math.isnan(row["to_client"])
    assert row["ttft"] == pytest.approx(221.0)  # from the frontend's arrival, t0 10.009


def test_no_step_of_its_own_and_unfinished(timeline: hops.Timeline) -> None:
    row = hops.hops(timeline, "c")
    assert row is not None
    assert math.isnan(row["wait"]) and math.isnan(row["compute"])
    assert row["out"] == pytest.approx(269.0)  # recv 10.021 -> out 10.290
    assert hops.hops(timeline, "d") is None  # never placed: the run ended first
    table = hops.rows(timeline)
    assert [r["rid"] for r in table] == ["a", "b", "c"]
    s = hops.summary(table)
    assert s["held"]["p100"] == pytest.approx(30.0) and s["waited"]["p100"] == 1
    assert "| held |" in hops.render(table, 2)


def test_steps_pair_per_file(timeline: hops.Timeline) -> None:
    # The worker's last step never ended (the line after it was cut short): not a step.
    assert len(timeline.steps) == 4
    assert [s.prefill_tokens for s in timeline.steps] == [0, 0, 512, 256]
    assert timeline.prompt_steps == {"a": [2, 3], "b": [3]}


def test_collections_within_a_request(tmp_path: Any) -> None:
    """`gc` counts the pauses of one process that fall inside the request's TTFT window (from
    9.998 to 10.101): the frontend's 30 ms and 5 ms, not the worker's 8 ms, which are fewer; the
    part of a pause before it arrived counts nothing."""
    (tmp_path / "1.tl").write_text(FRONTEND + "10.000 gc 2 50.000\n10.040 gc 2 30.000\n"
                                   "10.090 gc 0 5.000\n")
    (tmp_path / "2.tl").write_text(WORKER.replace("10.040 end\n", "10.030 gc 1 8\n10.040 end\n"))
    tl = hops.read(str(tmp_path))
    row = hops.hops(tl, "a")
    assert row is not None and row["gc"] == pytest.approx(37.0)  # 2 + 30 + 5
    assert len(tl.steps) == 3  # (a gc line between a step and its end changes nothing)


def test_a_field_cannot_add_a_field_or_a_line(tmp_path: Any, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """A request id is a peer's: whitespace in it is taken out, so it stays one field."""
    from tandem.runtime import timeline

    monkeypatch.setenv(timeline.ENV, str(tmp_path))
    monkeypatch.setattr(timeline, "_file", None)
    try:
        timeline.mark("recv", "a b\nc 9.9 end")
        timeline.mark("placed", "x")
    finally:
        if timeline._file is not None:
            timeline._file.close()
    (recv, placed) = (tmp_path / f"{os.getpid()}.tl").read_text().splitlines()
    assert recv.split()[1:] == ["recv", "abc9.9end"] and placed.split()[1:] == ["placed", "x"]
