"""RequestStream refuses a gap or an overlap, maps worker errors, and aborts when left early."""

from __future__ import annotations

import pytest

from tandem.router.client import RequestStream
from tandem.runtime import errors
from tandem.runtime.wire import Abort, Delta, ErrorKind, Generate, SamplingParams, Usage


class FakeClient:
    address = "tcp://fake"
    state = "up"

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.in_flight: dict[str, RequestStream] = {}
        self.protocol_errors = 0

    def start_request(self, s: RequestStream) -> None:
        self.in_flight[s.rid] = s
        self.sent.append(s._msg)

    def end_request(self, s: RequestStream, abort: bool) -> None:
        self.in_flight.pop(s.rid, None)
        if abort:
            self.sent.append(Abort([s.rid]))


def stream(client: FakeClient) -> RequestStream:
    return RequestStream(client, Generate("r", [1], SamplingParams()))  # type: ignore[arg-type]


async def test_in_order_deltas_pass_and_finish_ends_iteration():
    c = FakeClient()
    async with stream(c) as s:
        s.push(Delta("r", 0, [1, 2]))
        s.push(Delta("r", 2, [3], "length", Usage(1, 3)))
        got = [d.token_ids async for d in s]
    assert got == [[1, 2], [3]]
    assert not any(isinstance(m, Abort) for m in c.sent)


@pytest.mark.parametrize("second_offset", [1, 3])  # overlap, gap
async def test_gap_or_overlap_fails_loudly_and_aborts(second_offset):
    c = FakeClient()
    with pytest.raises(errors.StreamProtocolError):
        async with stream(c) as s:
            s.push(Delta("r", 0, [1, 2]))
            s.push(Delta("r", second_offset, [3]))
            async for _ in s:
                pass
    assert c.protocol_errors == 1
    assert isinstance(c.sent[-1], Abort)


@pytest.mark.parametrize("kind,cls", [(ErrorKind.BAD_REQUEST, errors.BadRequest),
                                      (ErrorKind.DRAINING, errors.Unavailable),
                                      (ErrorKind.ENGINE, errors.EngineFailed)])
async def test_error_delta_maps_to_status(kind, cls):
    c = FakeClient()
    with pytest.raises(cls):
        async with stream(c) as s:
            s.push(Delta("r", 0, [], "error", error="nope", error_kind=kind))
            async for _ in s:
                pass


async def test_leaving_early_aborts_and_worker_loss_raises():
    c = FakeClient()
    async with stream(c) as s:
        s.push(Delta("r", 0, [1]))
        async for _ in s:
            break
    assert isinstance(c.sent[-1], Abort) and not c.in_flight
    with pytest.raises(errors.WorkerLost):
        async with stream(c) as s:
            s.push(errors.WorkerLost("gone"))
            async for _ in s:
                pass
