"""The worker's per-frontend Outbox: the credit window, merging while the window is full, first
tokens first, and nothing lost, duplicated or reordered within a request."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.runtime import wire
from tandem.runtime.wire import Delta, Usage
from tandem.worker.outbox import Outbox


def test_window_counts_messages_and_credit_reopens_it() -> None:
    box = Outbox(2)
    assert not box.can_send  # nothing waiting
    box.add(Delta("a", 0, [1]))
    assert box.can_send
    assert [d.token_ids for d in box.take()] == [[1]]
    box.add(Delta("a", 1, [2]))
    box.take()
    box.add(Delta("a", 2, [3]))
    assert box.in_flight == 2 and not box.can_send and len(box) == 1
    box.credit(1)
    assert box.can_send
    box.credit(5)  # more than owed (a credit from before a reset): clamped
    assert box.in_flight == 0


def test_a_full_window_merges_a_request_into_one_delta() -> None:
    box = Outbox(1)
    box.add(Delta("a", 0, [1]))
    box.take()
    for i in range(1, 6):
        box.add(Delta("a", i, [10 + i]))
    box.add(Delta("a", 6, [99], "length", Usage(3, 7)))
    box.add(Delta("b", 0, [5]))
    assert len(box) == 2
    box.credit(1)
    a, b = sorted(box.take(), key=lambda d: d.rid)
    assert (a.offset, a.token_ids, a.finish_reason, a.usage) == \
        (1, [11, 12, 13, 14, 15, 99], "length", Usage(3, 7))
    assert (b.offset, b.token_ids) == (0, [5])


def test_first_tokens_go_first_and_an_error_is_never_merged() -> None:
    box = Outbox(1)
    box.add(Delta("old", 4, [1]))
    box.add(Delta("new", 0, [2]))
    box.add(Delta("old", 5, [3]))
    box.add(Delta("old", 6, [], "error", error="engine failed", error_kind=wire.ErrorKind.ENGINE))
    items = box.take()
    assert [(d.rid, d.offset, d.token_ids, d.finish_reason) for d in items] == [
        ("new", 0, [2], None), ("old", 4, [1, 3], None), ("old", 6, [], "error")]


def test_a_batch_bounds_a_message_oldest_first_and_late_tokens_start_a_new_delta() -> None:
    box = Outbox(4, batch=2, idle_s=math.inf)  # (never idle: the batch always applies)
    for r in "abc":
        box.add(Delta(r, 3, [1]))
    box.add(Delta("new", 0, [7]))
    box.add(Delta("a", 4, [2]))  # merges into a's waiting delta
    first = box.take()
    assert [(d.rid, d.token_ids) for d in first] == [("new", [7]), ("a", [1, 2]), ("b", [1])]
    box.add(Delta("a", 5, [3]))  # a's delta left: this one waits behind c
    box.add(Delta("c", 4, [2]))  # c is still waiting: merged
    second = box.take()
    assert [(d.rid, d.offset, d.token_ids) for d in second] == [("c", 3, [1, 2]), ("a", 5, [3])]
    assert first[1].token_ids == [1, 2]  # a sent delta is never changed afterwards
    assert len(box) == 0 and box.in_flight == 2


def test_a_frontend_that_keeps_up_takes_a_whole_step_and_one_that_lags_a_batch() -> None:
    now = [100.0]
    box = Outbox(2, batch=2, idle_s=0.002, clock=lambda: now[0])  # (idle: credited over 2 ms ago)
    for r in "abcd":
        box.add(Delta(r, 3, [1]))
    assert len(box.take()) == 4  # nothing in flight, never credited: idle, the whole step
    for r in "abcd":
        box.add(Delta(r, 4, [2]))
    assert [d.rid for d in box.take()] == ["a", "b"]  # one message in flight: a batch
    box.credit(2)  # everything credited now: a send at once is the overloaded case
    assert [d.rid for d in box.take()] == ["c", "d"]
    box.add(Delta("a", 5, [3]))
    box.credit(1)
    now[0] += 0.001
    for r in "bcd":
        box.add(Delta(r, 5, [3]))
    assert [d.rid for d in box.take()] == ["a", "b"]  # credited 1 ms ago: still a batch
    for r in "abcd":
        box.add(Delta(r, 6, [4]))  # c and d merge into their waiting ones
    box.credit(1)
    now[0] += 0.005
    took = box.take()  # credited 5 ms ago, nothing in flight: the frontend keeps up
    assert [(d.rid, d.offset, d.token_ids) for d in took] == [
        ("c", 5, [3, 4]), ("d", 5, [3, 4]), ("a", 6, [4]), ("b", 6, [4])]
    assert len(box) == 0


def test_first_tokens_leave_past_a_full_window() -> None:
    box = Outbox(1)
    box.add(Delta("old", 0, [1]))
    box.take()
    box.add(Delta("old", 1, [2]))
    box.add(Delta("new", 0, [3]))
    assert not box.can_send and box.has_first
    assert [(d.rid, d.token_ids) for d in box.take_first()] == [("new", [3])]
    box.add(Delta("new", 1, [4]))  # new's first delta left: this is a new one, behind old's
    assert box.in_flight == 2 and not box.has_first
    box.credit(2)
    assert [(d.rid, d.offset, d.token_ids) for d in box.take()] == [("old", 1, [2]),
                                                                      ("new", 1, [4])]


def test_a_window_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        Outbox(0)
    with pytest.raises(ValueError):
        Outbox(1, batch=-1)


@st.composite
def workloads(draw: st.DrawFn
              ) -> tuple[int, int, bool, dict[str, list[Delta]], list[tuple[str, int]]]:
    window = draw(st.integers(1, 3))
    batch = draw(st.integers(0, 3))
    idle = draw(st.booleans())  # the frontend keeps up: a message with nothing in flight is whole
    reqs: dict[str, list[Delta]] = {}
    for r in range(draw(st.integers(1, 5))):
        rid = f"r{r}"
        sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=8))
        ends_in_error = draw(st.booleans())
        out, off, tok = [], 0, 100 * r
        for i, n in enumerate(sizes):
            last = i == len(sizes) - 1 and not ends_in_error
            ids = list(range(tok, tok + n))
            tok += n
            out.append(Delta(rid, off, ids, "length" if last else None,
                             Usage(1, off + n) if last else None))
            off += n
        if ends_in_error:
            out.append(Delta(rid, off, [], "error", error="boom", error_kind=wire.ErrorKind.ENGINE))
        reqs[rid] = out
    # Operations: ("add", request index) / ("take", 0) / ("credit", n).
    ops = draw(st.lists(st.one_of(
        st.tuples(st.just("add"), st.integers(0, len(reqs) - 1)),
        st.tuples(st.just("take"), st.just(0)),
        st.tuples(st.just("credit"), st.integers(1, 2))), max_size=80))
    return window, batch, idle, reqs, ops


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_nothing_is_lost_duplicated_or_reordered(
        w: tuple[int, int, bool, dict[str, list[Delta]], list[tuple[str, int]]]) -> None:
    window, batch, idle, reqs, ops = w
    pending = {rid: [Delta(d.rid, d.offset, list(d.token_ids), d.finish_reason, d.usage, d.error,
                           d.error_kind) for d in ds] for rid, ds in reqs.items()}
    rids = list(pending)
    box = Outbox(window, batch, idle_s=-1.0 if idle else math.inf)
    got: dict[str, list[Delta]] = {rid: [] for rid in rids}

    def take() -> None:
        assert box.in_flight < window  # a regular message only within the window
        whole = idle and not box.in_flight
        msg = box.take()
        if batch and not whole:
            assert sum(1 for d in msg if d.offset) <= batch
        seen_rest = False
        for d in msg:  # first tokens ahead of every other delta in the message
            if d.offset == 0:
                assert not seen_rest
            else:
                seen_rest = True
            got[d.rid].append(d)

    for op, arg in ops:
        if op == "add" and pending[rids[arg]]:
            box.add(pending[rids[arg]].pop(0))
        elif op == "take" and box.can_send:
            take()
        elif op == "take" and box.has_first:  # window full: the first tokens leave on their own
            msg = box.take_first()
            assert msg and all(d.offset == 0 for d in msg)
            for d in msg:
                got[d.rid].append(d)
        elif op == "credit":
            box.credit(arg)
    for rid in rids:
        while pending[rid]:
            box.add(pending[rid].pop(0))
    while len(box):
        box.credit(box.in_flight)
        take()

    for rid, sent in reqs.items():
        received = got[rid]
        ids = [t for d in received for t in d.token_ids]
        assert ids == [t for d in sent for t in d.token_ids]
        off = 0
        for d in received:  # contiguous offsets, one end, at the end
            assert d.offset == off
            off += len(d.token_ids)
            assert (d.finish_reason is None) == (d is not received[-1])
        assert received[-1].finish_reason == sent[-1].finish_reason
        assert received[-1].usage == sent[-1].usage
        assert len(received) <= len(sent)
