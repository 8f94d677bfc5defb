"""No client starves the others' grammars (N4): compiles go to tenants in turn, one tenant never
holds every slot, a tenant's compiles are capped, a compile that waits too long for a slot is a
503 (busy), and on the reference engine a compile past its deadline is killed and its slot freed
while another client's grammar compiles beside it.

The scheduling tests drive `Compiles` with compiles that block on events the test sets: every
assertion is made at a point the test chose, never after a sleep."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tandem.engines.base import EngineRequest
from tandem.engines.grammars import Compiles, Deferred
from tandem.engines.reference import ReferenceEngine
from tandem.runtime.errors import EngineBusy, EngineError
from tandem.runtime.wire import SamplingParams
from tests.conformance.harness import Recorder, wait_idle
from tests.unit.test_grammar import PERSON, PROMPT


class Gates:
    """Compiles that start when a slot takes them and end when the test says."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.began: dict[str, threading.Event] = {}
        self.ended: dict[str, asyncio.Future[Any]] = {}

    def job(self, name: str) -> Deferred:
        self.gates[name], self.began[name] = threading.Event(), threading.Event()

        def compile(deadline_s: float) -> str:
            self.started.append(name)
            self.began[name].set()
            assert self.gates[name].wait(30)
            return f"grammar-{name}"
        return Deferred(compile, "json_schema")

    def start(self, c: Compiles, name: str, tenant: str) -> None:
        fut = self.ended[name] = asyncio.get_running_loop().create_future()
        c.start(self.job(name), fut.set_result, fut.set_result, name, tenant)

    async def finish(self, name: str) -> Any:
        await asyncio.to_thread(self.began[name].wait, 30)
        self.gates[name].set()
        return await asyncio.wait_for(self.ended[name], 30)


async def test_tenants_take_turns_on_one_slot() -> None:
    """A tenant that sent first does not go before every other tenant: one each, in turn."""
    c, g = Compiles(slots=1, per_tenant=8), Gates()
    for name, tenant in [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b")]:
        g.start(c, name, tenant)
    for name in ["a1", "b1", "a2", "b2", "a3"]:
        assert await g.finish(name) == f"grammar-{name}"
    assert g.started == ["a1", "b1", "a2", "b2", "a3"]
    c.close()


async def test_one_tenant_leaves_a_slot_for_another() -> None:
    """With 2 slots a tenant runs one compile at a time: the other slot stays for whoever comes
    next, who starts at once."""
    c, g = Compiles(slots=2, per_tenant=8), Gates()
    g.start(c, "a1", "a")
    g.start(c, "a2", "a")
    await asyncio.to_thread(g.began["a1"].wait, 30)
    assert g.started == ["a1"]  # (a2 waits, though a slot is free)
    g.start(c, "b1", "b")
    assert await g.finish("b1") == "grammar-b1"  # beside a1, which still runs
    assert g.started == ["a1", "b1"]
    assert await g.finish("a1") == "grammar-a1"
    assert await g.finish("a2") == "grammar-a2"
    c.close()


async def test_a_tenants_compiles_are_capped_and_a_long_wait_is_busy() -> None:
    c, g = Compiles(slots=1, per_tenant=2, wait_s=0.2), Gates()
    g.start(c, "a1", "a")
    g.start(c, "a2", "a")
    with pytest.raises(EngineBusy, match="this client has 2 grammars compiling"):
        g.start(c, "a3", "a")
    g.start(c, "b1", "b")  # another tenant is not refused
    await asyncio.to_thread(g.began["a1"].wait, 30)
    # a1 holds the one slot until the test lets it go: a2 and b1 wait past wait_s.
    for name in ("a2", "b1"):
        err = await asyncio.wait_for(g.ended[name], 30)
        assert isinstance(err, EngineBusy) and "waited 0.2s for the grammar compiler" in str(err)
    assert await g.finish("a1") == "grammar-a1"
    assert g.started == ["a1"]
    g.start(c, "a4", "a")  # the failed ones left the queue: room again
    assert await g.finish("a4") == "grammar-a4"
    c.close()


async def test_a_dropped_compile_leaves_the_queue() -> None:
    c, g = Compiles(slots=1, per_tenant=8), Gates()
    g.start(c, "a1", "a")
    g.start(c, "b1", "b")
    assert c.drop("b1") and not c.drop("b1")
    g.start(c, "c1", "c")
    assert await g.finish("a1") == "grammar-a1"
    assert await g.finish("c1") == "grammar-c1"
    assert g.started == ["a1", "c1"] and not g.ended["b1"].done()
    c.close()


# --- the reference engine: a compile past its deadline is killed ----------------------------------

def slow_schema(depth: int = 60) -> str:
    """Objects nested `depth` deep, each with strings of distinct maxLengths (the benchmark's
    costly shape): xgrammar 0.2.8 spends long on each distinct rule (0.85 s at depth 20 on the
    tiny model, seconds past it)."""
    from perf.micro.bench_grammar_compile import distinct

    return json.dumps(distinct(depth))


@pytest.fixture
async def engine(tiny_model: str) -> AsyncIterator[ReferenceEngine]:
    e = ReferenceEngine(Path(tiny_model), page_size=4, max_batch=16, check_pages=True)
    await e.start()
    yield e
    await wait_idle(e)
    await e.shutdown()


async def test_a_slow_grammar_is_killed_and_others_compile_beside_it(
        engine: ReferenceEngine) -> None:
    """N4: one client's schema that compiles for seconds made every other client's grammar fail
    ("did not compile within 5s"). Now it holds one slot until its deadline, when its process is
    killed; the other clients' grammars compile on the other slot meanwhile, and the killed
    slot's process is replaced for the next grammar."""
    engine._compiles.deadline_s = 1.0
    engine._compiles.wait_s = 60.0  # (waiting for a slot is not what this test times)
    rec = Recorder(engine)
    runs = {}
    for rid, tenant, schema in [("slow", "a", slow_schema()),
                                ("b", "b", json.dumps(PERSON)),
                                ("c", "c", json.dumps({**PERSON, "title": "c"}))]:
        runs[rid] = rec.expect(rid)
        engine.submit(EngineRequest(rid, list(PROMPT), SamplingParams(
            max_tokens=200, temperature=0.0, json_schema=schema), tenant=tenant), rec)
    for rid in ("b", "c"):
        await asyncio.wait_for(runs[rid].done.wait(), 60)
        assert runs[rid].finish == "stop", runs[rid]
    await asyncio.wait_for(runs["slow"].done.wait(), 60)
    err = runs["slow"].error
    assert isinstance(err, EngineError) and err.param == "json_schema"
    assert "did not compile within 1s" in str(err)
    probes = engine.grammars.probes
    assert probes is not None and probes.killed == 1
    again = rec.expect("again")  # the same client, a grammar that compiles: served
    engine.submit(EngineRequest("again", list(PROMPT), SamplingParams(
        max_tokens=200, temperature=0.0, regex="[ab]{4}"), tenant="a"), rec)
    await asyncio.wait_for(again.done.wait(), 60)
    assert again.finish == "stop"


def test_a_busy_compiler_is_a_503_with_retry_after() -> None:
    """What EngineBusy (a tenant's compiles capped, or a long wait for a slot) becomes: the
    client's 503 with Retry-After, naming the field, never a 400 or a 500."""
    from tandem.frontend.http import error_of
    from tandem.runtime.wire import Delta, ErrorKind

    err = error_of(Delta("r", 0, [], "error", error="json_schema: busy",
                         error_kind=ErrorKind.BUSY, error_param="json_schema"))
    assert err.status == 503 and err.retry_after and err.param == "json_schema"
    assert EngineBusy("x").kind is ErrorKind.BUSY
