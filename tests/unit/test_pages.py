"""PagePool accounting: the invariant through the verbs, and `check_accounting` catching what
breaks it."""

from __future__ import annotations

import pytest

from tandem.engines.pages import PagePool, PagePoolError, check_accounting


def test_pool_allocate_reserve_commit_free_keep_the_invariant():
    pool = PagePool(10, 16)
    assert pool.pages_for(1) == 1 and pool.pages_for(16) == 1 and pool.pages_for(17) == 2
    a = pool.allocate("a", 3)
    assert a == [0, 1, 2]  # lowest ids first: contiguous runs
    r = pool.reserve("b", 4)
    assert len(set(a) | set(r)) == 7
    assert (pool.num_free, pool.num_held, pool.num_reserved) == (3, 3, 4)
    pool.check()
    assert not pool.can_allocate(4)
    with pytest.raises(PagePoolError):
        pool.allocate("c", 4)
    assert pool.commit("b") == r
    assert (pool.num_held, pool.num_reserved) == (7, 0)
    assert pool.free("a") == 3 and pool.free("a") == 0  # safe twice
    assert pool.free("b") == 4
    pool.check()
    assert pool.num_free == 10


def test_pool_check_catches_a_double_count_and_a_lost_page():
    pool = PagePool(4, 16)
    a = pool.allocate("a", 2)
    free = [p for p in range(4) if p not in a]
    check_accounting(4, free, [a], [], [])  # what check() checks: this holds
    pool.check()
    check_accounting(4, free, [a, [a[0]]], [], [], [2, 1, 0, 0])  # a shared page counts once
    with pytest.raises(PagePoolError):  # ... and its reference count is its holders'
        check_accounting(4, free, [a, [a[0]]], [], [], [1, 1, 0, 0])
    with pytest.raises(PagePoolError):  # the bug SGLang's streaming sessions had: a page both
        check_accounting(4, free[1:], [a], [], [a[0], free[0]])  # held and cached, unreferenced
    with pytest.raises(PagePoolError):  # a page nobody has
        check_accounting(4, free[1:], [a], [], [])
    with pytest.raises(PagePoolError):  # a page both free and reserved
        check_accounting(4, free, [a], [[free[0]]], [])
