"""DeltaCollector.take_running: what the response loop's push takes without waking the task."""

from __future__ import annotations

from tandem.runtime import errors
from tandem.runtime.collector import DeltaCollector
from tandem.runtime.wire import Delta


def test_take_running_takes_only_a_delta_the_request_goes_on_after() -> None:
    told: list[int] = []
    c = DeltaCollector()
    c.listen(lambda: told.append(1))
    c.put(Delta("r", 0, [5]))
    assert told == [1]
    d = c.take_running()
    assert d is not None and d.token_ids == [5] and not c.ready
    c.put(Delta("r", 1, [6], "length"))  # a finish: left for take
    assert told == [1, 1]
    assert c.take_running() is None and c.ready
    last = c.take()
    assert last is not None and last.finish_reason == "length"


def test_take_running_leaves_a_delta_with_a_failure_behind_it() -> None:
    c = DeltaCollector()
    c.put(Delta("r", 0, [5]))
    c.fail(errors.TandemError("boom"))
    assert c.take_running() is None  # the task sees the tokens, then the failure
    d = c.take()
    assert d is not None and d.token_ids == [5]
    try:
        c.take()
    except errors.TandemError:
        pass
    else:
        raise AssertionError("the failure was not raised after the tokens")
