"""The engine-side PD handoff state machine (tandem.engines.handoff) without sockets: the mock engine
with in-memory fake channels, each scripted on purpose (a room that comes late or never, a fetch
that is cancelled, a write that is slow), as httpcore tests its protocols with mock streams. The
page rules checked: pages a transfer may still write into come back only when the channel
releases them; pages held for a write come back only when it ends; a request cancelled before its
handoff began frees at once; every scenario ends with every page free."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tandem.config import MockTiming
from tandem.engines.mock import MockEngine, mock_token
from tandem.engines.handoff import DecodeHandoff, Host, PrefillHandoff
from tandem.kv.bootstrap.decode import Destination
from tandem.runtime.errors import KvHandoffError
from tandem.runtime.wire import Bootstrap, SamplingParams
from tests.conformance.harness import Recorder, Run, finished, wait_idle
from tests.waits import until

VOCAB = 500
B = Bootstrap("fake", 1, 7)


@pytest.fixture
def mock_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": VOCAB, "max_position_embeddings": 128, "eos_token_id": 2}))
    return str(tmp_path)


@dataclass
class FakeDecodeChannel:
    """fetch(): records the call, then waits for the test to `deliver` or `fail` it. On failure or
    cancellation the pages are released only when the test says `writes_over()`."""

    calls: list[list[int]] = field(default_factory=list)
    skips: list[int] = field(default_factory=list)
    result: asyncio.Future[int] | None = None
    release: Callable[[], None] | None = None

    async def fetch(self, bootstrap: Bootstrap, pages: list[int],
                    release: Callable[[], None], skip: int = 0) -> int:
        self.calls.append(pages)
        self.skips.append(skip)
        self.release = release
        self.result = asyncio.get_running_loop().create_future()
        try:
            return await self.result
        except KvHandoffError:
            raise  # released later, by writes_over()
        except asyncio.CancelledError:
            raise

    def writes_over(self) -> None:
        assert self.release is not None
        self.release()

    async def close(self) -> None:
        pass


@dataclass
class FakePrefillChannel:
    address: str = "fake:1"
    room: asyncio.Future[Destination] | None = None
    writes: list[asyncio.Future[KvHandoffError | None]] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)

    async def start(self) -> None:
        self.room = asyncio.get_running_loop().create_future()

    async def wait_room(self, room: int) -> Destination:
        assert self.room is not None
        return await self.room

    def send(self, room: int, dest: Destination, local_pages: Any,
             first_token: int) -> asyncio.Task[KvHandoffError | None]:
        done: asyncio.Future[KvHandoffError | None] = asyncio.get_running_loop().create_future()
        self.writes.append(done)

        async def write() -> KvHandoffError | None:
            return await done

        return asyncio.ensure_future(write())

    def fail(self, room: int, error: str) -> None:
        self.failed.append((room, error))

    async def close(self) -> None:
        for w in self.writes:
            if not w.done():
                w.cancel()


class Spec:
    def __init__(self, kind: type, channel: Any, trusted: bool = True) -> None:
        self.kind, self.channel, self.trusted = kind, channel, trusted

    def build(self, host: Host, memory: Any) -> Any:
        if self.kind is DecodeHandoff:
            return DecodeHandoff(host, self.channel, self.trusted)
        return self.kind(host, self.channel)


@contextlib.asynccontextmanager
async def engine(mock_dir: str, kind: type, channel: Any, trusted: bool = True,
                 **kw: Any) -> AsyncIterator[MockEngine]:
    """A started mock engine with this handoff, shut down however the test ends."""
    e = MockEngine(mock_dir, page_size=4, num_pages=32, handoff=Spec(kind, channel, trusted),
                   **kw)
    await e.start()
    try:
        yield e
    finally:
        await e.shutdown()


def first_ids(prompt: list[int], n: int) -> list[int]:
    return [mock_token(prompt, i, VOCAB, frozenset({2})) for i in range(n)]


async def test_decode_reserve_fetch_commit(mock_dir: str) -> None:
    ch = FakeDecodeChannel()
    async with engine(mock_dir, DecodeHandoff, ch) as d:
        run = Recorder(d).submit(d, "r", [4, 5, 6], SamplingParams(max_tokens=5), B)
        await until(lambda: ch.result is not None)
        # the prompt's pages, and its completion's promised (taken as decode writes them)
        assert d.load().pages_reserved == d.pool.pages_for(3)
        owner = next(o for o in d.pool.owners() if o.startswith("r#"))
        assert d.pool.promised_to(owner) == d.pool.pages_for(3 + 5) - d.pool.pages_for(3) > 0
        assert ch.calls == [d.pool.pages_of(d.pool.owners()[0])[:1]]  # the prompt's pages
        want = first_ids([4, 5, 6], 5)
        ch.result.set_result(want[0])
        await finished(run)
        assert run.outputs[0][0] == want[:1] and run.ids == want and run.finish == "length"
        await wait_idle(d)


@pytest.mark.parametrize("trusted", [True, False])
async def test_kv_from_an_unauthenticated_peer_is_never_cached(mock_dir: str,
                                                               trusted: bool) -> None:
    """N2: a keyless decode worker kept pages a local process had overwritten in its prefix
    cache, and served them to later requests. K/V written by a peer that did not authenticate
    is its own request's only: none of its pages is cached (with keys: its full pages are)."""
    ch = FakeDecodeChannel()
    prompt = list(range(10, 22))  # 3 full pages
    async with engine(mock_dir, DecodeHandoff, ch, trusted=trusted) as d:
        run = Recorder(d).submit(d, "r", prompt, SamplingParams(max_tokens=5), B)
        await until(lambda: ch.result is not None)
        ch.result.set_result(first_ids(prompt, 1)[0])
        await finished(run)
        assert run.finish == "length"
        await wait_idle(d)
        assert (d.pool.num_cached > 0) is trusted


async def test_decode_fetch_and_first_token_do_not_wait_for_a_step_boundary(
        mock_dir: str) -> None:
    """A decode request arriving mid-step has its pages reserved and its K/V fetched at once, and
    its first token goes out when the K/V is in place, while the step still runs (the busy
    request's outputs are the clock: none arrives in between)."""
    ch = FakeDecodeChannel()
    async with engine(mock_dir, DecodeHandoff, ch) as d:
        busy = Recorder(d).submit(d, "busy", [7, 8], SamplingParams(max_tokens=50))  # (agg)

        def slow_down(_: Run) -> None:  # in the sink, so before the next step starts: from
            d.timing = MockTiming(mock_decode_step_us=60e6)  # now on a step lasts a minute, longer
            # than any loaded machine takes to run this test

        busy.on_output = slow_down
        await until(lambda: busy.outputs, every=0.001)
        seen = len(busy.outputs)  # now inside that step
        run = Recorder(d).submit(d, "r", [4, 5, 6], SamplingParams(max_tokens=5), B)
        await until(lambda: ch.result is not None, every=0.001)
        # the prompt's pages, and its completion's promised (taken as decode writes them)
        assert d.load().pages_reserved == d.pool.pages_for(3)
        owner = next(o for o in d.pool.owners() if o.startswith("r#"))
        assert d.pool.promised_to(owner) == d.pool.pages_for(3 + 5) - d.pool.pages_for(3) > 0
        want = first_ids([4, 5, 6], 5)
        ch.result.set_result(want[0])
        await until(lambda: run.outputs, every=0.001)
        assert run.outputs[0][0] == want[:1]
        assert len(busy.outputs) == seen  # the step that was running has not ended yet


async def test_decode_failure_ends_at_once_but_pages_wait_for_release(mock_dir: str) -> None:
    ch = FakeDecodeChannel()
    async with engine(mock_dir, DecodeHandoff, ch) as d:
        run = Recorder(d).submit(d, "r", [4, 5, 6], SamplingParams(max_tokens=5), B)
        await until(lambda: ch.result is not None)
        ch.result.set_exception(KvHandoffError("no KV"))
        await finished(run)
        assert isinstance(run.error, KvHandoffError) and run.finish == "error"
        await asyncio.sleep(0.01)
        assert d.load().pages_reserved > 0  # quarantined: a write might still land
        ch.writes_over()
        await wait_idle(d)


async def test_decode_cancelled_mid_fetch_is_silent_and_quarantined(mock_dir: str) -> None:
    ch = FakeDecodeChannel()
    async with engine(mock_dir, DecodeHandoff, ch) as d:
        run = Recorder(d).submit(d, "r", [4, 5, 6], SamplingParams(max_tokens=5), B)
        await until(lambda: ch.result is not None)
        assert run.handle is not None
        run.handle.cancel()
        await asyncio.sleep(0.01)
        assert d.load().pages_reserved > 0 and run.outputs == []
        ch.writes_over()
        await wait_idle(d)


async def test_decode_cancelled_before_its_fetch_began_frees_at_once(mock_dir: str) -> None:
    ch = FakeDecodeChannel()
    async with engine(mock_dir, DecodeHandoff, ch) as d:
        run = Recorder(d).submit(d, "r", [4, 5, 6], SamplingParams(max_tokens=5), B)
        while d.load().pages_reserved == 0:  # reserved; the fetch task has not run yet
            await asyncio.sleep(0)
        assert run.handle is not None and ch.calls == []
        run.handle.cancel()
        await wait_idle(d)
        assert ch.calls == [] and run.outputs == []


async def test_prefill_waits_for_room_writes_then_ends(mock_dir: str) -> None:
    ch = FakePrefillChannel()
    async with engine(mock_dir, PrefillHandoff, ch) as p:
        assert p.bootstrap_addr == "fake:1"
        run = Recorder(p).submit(p, "r", [4, 5, 6], SamplingParams(max_tokens=5), B)
        async with asyncio.timeout(10):  # computed, waiting for the room: its pages held
            await until(lambda: p.load().pages_free != 32)
        assert p.load().pages_free == 31 and not ch.writes
        assert ch.room is not None
        ch.room.set_result(Destination(b"d", "d", [9]))
        await until(lambda: ch.writes)
        await asyncio.sleep(0.01)
        assert p.load().pages_free == 31 and run.outputs == []  # held for the write
        ch.writes[0].set_result(None)
        await finished(run)
        assert run.outputs == [(first_ids([4, 5, 6], 1), "length", 1)]
        assert ch.failed == []
        await wait_idle(p)


async def test_prefill_cancelled_during_its_write_keeps_pages_until_it_ends(
        mock_dir: str) -> None:
    ch = FakePrefillChannel()
    async with engine(mock_dir, PrefillHandoff, ch) as p:
        run = Recorder(p).submit(p, "r", [4, 5, 6], SamplingParams(max_tokens=5), B)
        assert ch.room is not None
        ch.room.set_result(Destination(b"d", "d", [9]))
        await until(lambda: ch.writes, every=0.001)
        assert run.handle is not None
        run.handle.cancel()
        await asyncio.sleep(0.01)
        assert p.load().pages_free == 31  # the write goes on into the decode side's pages
        ch.writes[0].set_result(None)
        await wait_idle(p)
        assert run.outputs == [] and ch.failed == []


async def test_prefill_cancelled_before_its_write_fails_the_room(mock_dir: str) -> None:
    ch = FakePrefillChannel()
    async with engine(mock_dir, PrefillHandoff, ch) as p:
        run = Recorder(p).submit(p, "r", [4, 5, 6], SamplingParams(max_tokens=5), B)
        await asyncio.sleep(0.01)
        assert run.handle is not None
        run.handle.cancel()
        await wait_idle(p)
        assert ch.failed == [(7, "the prefill request was aborted")] and run.outputs == []


async def test_prefill_write_failure_ends_with_a_kv_error(mock_dir: str) -> None:
    ch = FakePrefillChannel()
    async with engine(mock_dir, PrefillHandoff, ch) as p:
        run = Recorder(p).submit(p, "r", [4, 5, 6], SamplingParams(max_tokens=5), B)
        assert ch.room is not None
        ch.room.set_result(Destination(b"d", "d", [9]))
        await until(lambda: ch.writes, every=0.001)
        ch.writes[0].set_result(KvHandoffError("write failed"))
        await finished(run)
        assert isinstance(run.error, KvHandoffError)
        await wait_idle(p)
