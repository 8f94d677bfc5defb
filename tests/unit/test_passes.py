"""PassBatcher (tandem.runtime.passes): what is added in one loop pass is handed over once, in
order, at the pass's end; items can be taken back before then; a driven `defer` replaces the loop."""

from __future__ import annotations

import asyncio

from tandem.runtime.passes import PassBatcher


async def test_one_flush_per_pass_in_order() -> None:
    got: list[list[int]] = []
    b: PassBatcher[int] = PassBatcher(got.append)
    for i in range(3):
        b.add(i)
    assert got == [] and len(b) == 3
    await asyncio.sleep(0)
    b.add(3)
    await asyncio.sleep(0)
    assert got == [[0, 1, 2], [3]]


async def test_items_taken_back_are_not_handed_over_and_an_empty_pass_flushes_nothing() -> None:
    got: list[list[str]] = []
    b: PassBatcher[str] = PassBatcher(got.append)
    b.add("a")
    b.add("b")
    assert b.remove_if(lambda x: x == "a") == 1
    assert b.remove_if(lambda x: x == "zz") == 0
    await asyncio.sleep(0)
    b.add("c")
    b.clear()
    await asyncio.sleep(0)
    assert got == [["b"]]
    b.add("d")  # after a cleared pass: a pass of its own again
    b.remove_if(lambda x: True)
    b.add("e")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert got == [["b"], ["e"]]


def test_a_given_defer_ends_the_pass_and_flush_now_hands_over_at_once() -> None:
    got: list[list[int]] = []
    due: list = []
    b: PassBatcher[int] = PassBatcher(got.append, defer=due.append)
    b.add(1)
    b.add(2)
    assert len(due) == 1  # one callback for the pass
    due.pop()()
    assert got == [[1, 2]]
    b.add(3)
    b.flush_now()  # (a closing owner)
    assert got == [[1, 2], [3]]
    due.pop()()  # the pass's callback finds nothing left
    assert got == [[1, 2], [3]]
