"""Logprobs exact under PD, through the engine-side handoff (tandem.engines.handoff) with a channel that
carries the first token's logprobs (`carries_logprobs`), as KvDone.first_logprobs does on the wire:
an in-memory channel pair that copies the prompt's KV pages from the prefill engine's cache into the
decode engine's. The reference engine's PD logprobs equal its aggregated run's, token for token and
number for number, sampled or greedy, with penalties; and so do the mock's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tandem.engines.base import Engine
from tandem.engines.handoff import DecodeHandoff, First, Host, PrefillHandoff
from tandem.kv.bootstrap.decode import Destination
from tandem.runtime.errors import KvHandoffError
from tandem.runtime.wire import Bootstrap, SamplingParams, TokenLogprobs
from tests.conformance.harness import Recorder, Run, finished, wait_idle


@dataclass
class Fabric:
    """What the two in-memory channels share: the decode side's pages per room (and how many
    leading prompt pages it had cached), the KV caches, and each room's KvDone (the first token,
    its logprobs, the prefill side's cached tokens)."""

    rooms: dict[int, asyncio.Future[tuple[list[int], int]]] = field(default_factory=dict)
    done: dict[int, asyncio.Future[First]] = field(default_factory=dict)
    kv: dict[str, Any] = field(default_factory=dict)
    written: list[int] = field(default_factory=list)  # pages each write moved

    def room(self, room: int) -> asyncio.Future[tuple[list[int], int]]:
        return self.rooms.setdefault(room, asyncio.get_running_loop().create_future())

    def result(self, room: int) -> asyncio.Future[First]:
        return self.done.setdefault(room, asyncio.get_running_loop().create_future())


class MemoryPrefill:
    carries_logprobs = True
    address = "memory:0"

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric

    async def start(self) -> None:
        pass

    async def wait_room(self, room: int) -> Destination:
        pages, skip = await self.fabric.room(room)
        return Destination(b"decode", "decode", pages, skip)

    def send(self, room: int, dest: Destination, local_pages: Seq[int], first_token: int,
             first_logprobs: TokenLogprobs | None = None, cached_tokens: int = 0
             ) -> asyncio.Task[KvHandoffError | None]:
        async def write() -> KvHandoffError | None:
            src, dst = self.fabric.kv.get("prefill"), self.fabric.kv.get("decode")
            if src is not None and dst is not None:  # the reference engine's caches (page-major)
                n, skip = len(dest.pages), dest.skip
                dst[list(dest.pages)] = src[list(local_pages)[skip:skip + n]]
            self.fabric.written.append(len(dest.pages))
            self.fabric.result(room).set_result((first_token, first_logprobs, cached_tokens))
            return None

        return asyncio.get_running_loop().create_task(write())

    def fail(self, room: int, error: str) -> None:
        fut = self.fabric.result(room)
        if not fut.done():
            fut.set_exception(KvHandoffError(error))

    async def close(self) -> None:
        pass


class MemoryDecode:
    carries_logprobs = True

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric

    async def fetch(self, bootstrap: Bootstrap, pages: list[int],
                    release: Callable[[], None], skip: int = 0) -> First:
        self.fabric.room(bootstrap.room).set_result((pages, skip))
        try:
            return await self.fabric.result(bootstrap.room)
        except BaseException:
            release()
            raise

    async def close(self) -> None:
        pass


@dataclass
class Spec:
    fabric: Fabric
    role: str

    def build(self, host: Host, memory: Any) -> PrefillHandoff | DecodeHandoff:
        self.fabric.kv[self.role] = memory
        if self.role == "prefill":
            return PrefillHandoff(host, MemoryPrefill(self.fabric))
        return DecodeHandoff(host, MemoryDecode(self.fabric))



@pytest.fixture(params=["reference", "mock"])
async def trio(request: pytest.FixtureRequest, tiny_model: str
               ) -> AsyncIterator[tuple[Engine, Engine, Engine]]:
    fabric = Fabric()

    def build(handoff: Spec | None) -> Engine:
        if request.param == "reference":
            from tandem.engines.reference import ReferenceEngine

            return ReferenceEngine(Path(tiny_model), page_size=4, num_pages=128, handoff=handoff)
        from tandem.engines.mock import MockEngine

        return MockEngine(tiny_model, page_size=4, num_pages=128, handoff=handoff)

    engines = [build(None), build(Spec(fabric, "prefill")), build(Spec(fabric, "decode"))]
    for e in engines:
        await e.start()
    yield engines[0], engines[1], engines[2]
    for e in engines:
        await wait_idle(e)
        await e.shutdown()


CASES = [{"logprobs": 5, "temperature": 0.0},
         {"logprobs": 2, "temperature": 0.9, "seed": 11, "presence_penalty": 1.0},
         {"logprobs": 0, "temperature": 0.0, "repetition_penalty": 1.3, "logit_bias": {9: 2.0}}]


@pytest.mark.parametrize("case", range(len(CASES)))
async def test_pd_logprobs_equal_aggregated(trio: tuple[Engine, Engine, Engine],
                                            case: int) -> None:
    agg, prefill, decode = trio
    sp = SamplingParams(max_tokens=10, ignore_eos=True, **CASES[case])  # type: ignore[arg-type]
    prompt = [0, 5, 100, 200, 7, 900]
    want = await finished(Recorder(agg).submit(agg, "a", prompt, sp))
    b = Bootstrap("memory", 0, case + 1)
    p_run: Run = Recorder(prefill).submit(prefill, "pd", prompt, sp, b)
    d_run: Run = Recorder(decode).submit(decode, "pd", prompt, sp, b)
    await finished(p_run)
    await finished(d_run)
    assert len(want.logprobs) == 10 and want.ids == d_run.ids
    assert d_run.logprobs == want.logprobs  # exact: the first token's came from the prefill side
    assert p_run.ids == want.ids[:1] and p_run.logprobs == want.logprobs[:1]
