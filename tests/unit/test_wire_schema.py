"""The wire protocol's schema: messages round-trip, each socket decodes only its receiver's
messages, and untrusted bytes are refused with one ProtocolError."""

from __future__ import annotations

import msgspec
import pytest

from tandem.runtime import wire
from tandem.runtime.wire import Delta, Deltas, Generate, Generates, SamplingParams, Usage


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
