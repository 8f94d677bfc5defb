"""PagePool accounting and the wire protocol's schema checks."""

from __future__ import annotations

import msgspec
import pytest

from tandem.engines.pages import PagePool, PagePoolError, check_accounting
from tandem.runtime import wire
from tandem.runtime.wire import Delta, Deltas, Generate, Generates, SamplingParams, Usage


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


def test_roundtrip():
    msg = Generates([Generate("r1", [1, 2, 3], SamplingParams(max_tokens=5, seed=7,
                                                               stop_token_ids=(9,)))])
    payload = wire.encode(msg)
    assert payload[1] == 9  # (an array; the message's tag first)
    assert wire.TO_WORKER.decode(payload) == msg
    d = Deltas([Delta("r1", 0, [4, 5]), Delta("r1", 2, [6], "length", Usage(3, 3)),
                Delta("r2", 0, [], "error", error="no", error_kind=wire.ErrorKind.BAD_REQUEST)])
    assert wire.TO_FRONTEND.decode(wire.encode(d)) == d


def test_each_socket_decodes_only_its_receivers_messages():
    msg = wire.KvDones([wire.KvDone(5, True, 7)])
    done = wire.encode(msg)
    assert wire.TO_DECODE.decode(done) == msg
    for dec in (wire.TO_WORKER, wire.TO_FRONTEND, wire.TO_PREFILL):
        with pytest.raises(wire.ProtocolError):
            dec.decode(done)


@pytest.mark.parametrize("payload", [
    b"\x90",  # an empty array: no tag
    b"",
    msgspec.msgpack.encode([99, []]),  # an unknown tag
    b"\xff\x00garbage",
    msgspec.msgpack.encode([9, [["r", "not a list", []]]]),
    b"\x93\x01\x03\xa2\xff\xfe",  # a Hello whose string is invalid UTF-8
    msgspec.msgpack.encode([9, [["r", [1.5], [16]]]]),  # a float for a token id
])
def test_untrusted_bytes_are_refused_cleanly(payload):
    with pytest.raises(wire.ProtocolError):
        wire.TO_WORKER.decode(payload)
