"""PagePool accounting and the wire protocol's schema checks."""

from __future__ import annotations

import msgspec
import pytest

from tandem.kv.pages import PagePool, PagePoolError
from tandem.runtime import protocol
from tandem.runtime.protocol import Delta, Deltas, Generate, SamplingParams, Usage


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


def test_pool_check_catches_a_double_count():
    pool = PagePool(4, 16)
    pool.allocate("a", 2)
    pool._held["b"] = [pool._held["a"][0]]  # the bug SGLang's streaming sessions had
    with pytest.raises(PagePoolError):
        pool.check()


def test_roundtrip_and_type_byte_routing():
    msg = Generate("r1", [1, 2, 3], SamplingParams(max_tokens=5, seed=7, stop_token_ids=(9,)))
    t, payload = protocol.encode(msg)
    assert t == bytes([protocol.MsgType.GENERATE])
    assert protocol.decode(t, payload) == msg
    d = Deltas([Delta("r1", 0, [4, 5]), Delta("r1", 2, [6], "length", Usage(3, 3))])
    assert protocol.decode(*protocol.encode(d)) == d


@pytest.mark.parametrize("type_byte,payload", [
    (b"\x63", b"\x90"),  # unknown type
    (b"", b"\x90"),  # no type
    (bytes([protocol.MsgType.GENERATE]), b"\xff\x00garbage"),
    (bytes([protocol.MsgType.GENERATE]), msgspec.msgpack.encode(["r", "not a list", []])),
])
def test_untrusted_bytes_are_refused_cleanly(type_byte, payload):
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(type_byte, payload)
