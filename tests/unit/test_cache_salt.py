"""Cache isolation (issue 38 item 1, N3): a request's cache salt roots its page keys in the engines,
its block keys in the router and its first page's KV event, so requests with different salts
never share a cached page and the router never predicts one; the frontend derives the salt from
the client's `cache_salt` and the server's `--cache-salt-by` tenant, hashed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tandem.config import RouterConfig
from tandem.engines.base import Engine, EngineRequest
from tandem.engines.mock import MockEngine
from tandem.frontend.salt import Salter, check_client_salt, salt_source
from tandem.router.blocks import block_keys, salt_root
from tandem.router.kv_index import WorkerIndex
from tandem.router.kv_policy import KvAware
from tandem.runtime.errors import BadRequest
from tandem.runtime.kv_events import BlockStored, EventBatch, KvEvent, decode_batch, encode_batch
from tandem.runtime.wire import Load, SamplingParams
from tests.conformance.harness import Recorder, Run, finished, wait_idle

P = 4
SYSTEM = list(range(10, 50))  # 10 full pages


@pytest.fixture
def mock_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 500, "max_position_embeddings": 256, "eos_token_id": 2}))
    return str(tmp_path)


@pytest.fixture(params=["mock", "reference"])
async def engine(request: pytest.FixtureRequest, mock_dir: str,
                 tiny_model: str) -> AsyncIterator[tuple[Engine, list[KvEvent]]]:
    if request.param == "mock":
        eng: Engine = MockEngine(mock_dir, page_size=P, num_pages=96)
    else:
        from tandem.engines.reference import ReferenceEngine
        eng = ReferenceEngine(Path(tiny_model), page_size=P, num_pages=96, max_batch=8)
    events: list[KvEvent] = []
    eng.on_kv_events = events.extend  # type: ignore[attr-defined]
    await eng.start()
    try:
        yield eng, events
    finally:
        await wait_idle(eng)
        await eng.shutdown()


async def ask(eng: Engine, rec: Recorder, rid: str, prompt: list[int], salt: str) -> Run:
    run = rec.expect(rid)
    run.handle = eng.submit(EngineRequest(rid, list(prompt), SamplingParams(max_tokens=2),
                                          cache_salt=salt), rec)
    return await finished(run)


async def test_a_request_hits_only_pages_cached_under_its_own_salt(
        engine: tuple[Engine, list[KvEvent]]) -> None:
    eng, _ = engine
    rec = Recorder(eng)
    assert (await ask(eng, rec, "victim", SYSTEM + [1, 2], "tenant-a")).cached == 0
    # A probe of the same prompt under another salt, or none, finds nothing cached...
    assert (await ask(eng, rec, "probe-b", SYSTEM + [1, 2], "tenant-b")).cached == 0
    assert (await ask(eng, rec, "probe-none", SYSTEM + [1, 2], "")).cached == 0
    # ...and the same salt finds the whole shared prefix.
    assert (await ask(eng, rec, "again-a", SYSTEM + [3], "tenant-a")).cached == len(SYSTEM)


async def test_engine_events_and_router_agree_on_salted_keys(
        engine: tuple[Engine, list[KvEvent]]) -> None:
    """The events an engine publishes for a salted prompt, through the format's bytes, build
    in the router's index exactly the keys the policy computes from the prompt and its salt;
    under another salt (or none) the index holds none of them."""
    eng, events = engine
    rec = Recorder(eng)
    await ask(eng, rec, "a", SYSTEM + [1, 2], "tenant-a")
    await wait_idle(eng)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash is None and stored[0].cache_salt == "tenant-a"
    assert all(e.cache_salt is None for e in stored if e.parent_block_hash is not None)
    wire = decode_batch(encode_batch(EventBatch(0.0, list(events)))).events
    idx = WorkerIndex(P, predict_ttl_s=2.0, approx_ttl_s=120.0)
    idx.apply(wire, 0.0)
    prompt = SYSTEM + [1, 2]
    salted = block_keys(prompt, P, salt_root("tenant-a"))
    assert idx.overlap(salted, 0.0) == len(SYSTEM) // P
    assert idx.overlap(block_keys(prompt, P, salt_root("tenant-b")), 0.0) == 0
    assert idx.overlap(block_keys(prompt, P), 0.0) == 0


class _Worker:
    def __init__(self, address: str) -> None:
        self.address = address
        self.load = Load()
        self.pending_prefill_tokens = self.active_decode_tokens = self.num_in_flight = 0


def test_the_kv_policy_never_predicts_a_hit_across_salts() -> None:
    """N3 on 2 workers: the victim's prefix is on w1 under salt A. A probe under salt B is not
    sent to w1 by prediction (no cached tokens predicted anywhere); one under A is."""
    kv = KvAware(RouterConfig(policy="kv"), auto=False)
    w0, w1 = _Worker("w0"), _Worker("w1")
    for w in (w0, w1):
        kv.index(w.address, P).events = True
    prompt = SYSTEM + [1, 2]
    kv.index("w1", P).apply([BlockStored(block_hashes=list(range(1, 11)),
                                         parent_block_hash=None, token_ids=SYSTEM,
                                         block_size=P, cache_salt="A")], 0.0)
    probe = kv.choose("agg", [w0, w1], prompt, P, salt="B")
    assert probe.cached_tokens == 0 and probe.worker is w0  # (by load: w0 first)
    same = kv.choose("agg", [w0, w1], prompt, P, salt="A")
    assert same.worker is w1 and same.cached_tokens == len(SYSTEM)
    assert kv.choose("agg", [w0, w1], prompt, P).cached_tokens == 0  # unsalted: none either


def test_a_salted_event_decodes_with_its_salt_and_an_unsalted_one_without() -> None:
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                     block_size=P, cache_salt="x" * 32)
    raw = msgspec.msgpack.decode(encode_batch(EventBatch(0.0, [ev])))
    assert raw[1][0]["cache_salt"] == "x" * 32  # (the map vLLM and SGLang read)
    assert decode_batch(encode_batch(EventBatch(0.0, [ev]))).events == [ev]


def _headers(**h: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in h.items()]


def test_the_frontend_salt_partitions_by_tenant_and_client_salt_hashed() -> None:
    none, by_user = Salter("none"), Salter("user")
    assert none(_headers(), "alice", None) == ""  # no partition, no salt: the shared cache
    s = none(_headers(), "", "my-salt")
    assert s and "my-salt" not in s and s == none(_headers(), "bob", "my-salt")
    a, b = by_user(_headers(), "alice", None), by_user(_headers(), "bob", None)
    assert a and b and a != b and "alice" not in a and a == by_user(_headers(), "alice", None)
    assert by_user(_headers(), "alice", "x") not in (a, by_user(_headers(), "bob", "x"))
    key = Salter("api-key")
    k1 = key(_headers(authorization="Bearer sk-1"), "", None)
    assert k1 != key(_headers(authorization="Bearer sk-2"), "", None) and "sk-1" not in k1
    assert k1 == key(_headers(authorization="bearer sk-1"), "anyone", None)
    hdr = Salter(salt_source("header:X-Tenant"))
    assert hdr.by == "header:x-tenant"
    t1 = hdr(_headers(x_tenant="t1"), "", None)
    assert t1 != hdr(_headers(x_tenant="t2"), "", None)
    assert hdr(_headers(), "", None) == hdr(_headers(x_tenant=""), "", None)  # (anonymous)


@pytest.mark.parametrize("bad", ["", "x" * 1025, 7, ["a"]])
def test_a_bad_client_salt_is_a_400_naming_it(bad: Any) -> None:
    with pytest.raises(BadRequest) as e:
        check_client_salt(bad)
    assert e.value.param == "cache_salt"


@pytest.mark.parametrize("bad", ["tenant", "header:", "header:a b", "api_key"])
def test_a_bad_cache_salt_by_is_refused_saying_what_is_allowed(bad: str) -> None:
    with pytest.raises(ValueError, match="none, user, api-key or header:NAME"):
        salt_source(bad)


# --- through the frontend's HTTP app ---------------------------------------------------------------


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tandem.frontend.preprocess import Preprocessor
    from tests.fakes import write_model_dir
    return Preprocessor(write_model_dir(tmp_path_factory.mktemp("salt") / "tiny"), "tiny")


async def _post(pre: Any, body: dict[str, Any], headers: dict[str, str] | None = None,
                **config: Any) -> tuple[Any, list[str]]:
    import httpx

    from tandem.config import FrontendConfig
    from tandem.frontend.app import FrontendApp
    from tests.fakes import FakePool
    pool = FakePool(reply_ids=[5])
    app = FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny", **config),
                      pool, pre)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as c:
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                  "max_tokens": 1, **body},
                         headers=headers or {})
    return r, pool.salts


async def test_the_frontend_carries_a_hashed_salt_to_the_pool(pre: Any) -> None:
    r, salts = await _post(pre, {})
    assert r.status_code == 200 and salts == [""]
    r, salts = await _post(pre, {"cache_salt": "abc"})
    assert r.status_code == 200 and salts[0] and "abc" not in salts[0]
    r2, again = await _post(pre, {"cache_salt": "abc", "n": 2})
    assert r2.status_code == 200 and again == salts * 2  # every choice, the same salt
    r, by_key = await _post(pre, {}, {"Authorization": "Bearer sk-x"}, cache_salt_by="api-key")
    assert r.status_code == 200 and by_key[0] and "sk-x" not in by_key[0]


@pytest.mark.parametrize("bad", ["", 7, ["a"], "x" * 1025])
async def test_a_bad_cache_salt_is_a_400_naming_it_over_http(pre: Any, bad: Any) -> None:
    r, salts = await _post(pre, {"cache_salt": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt" and salts == []


def test_sglang_gets_the_salt_as_its_own_cache_salt_field() -> None:
    """(SGLang 0.5.23's Engine.async_generate and GenerateReqInput take `cache_salt`.)"""
    from tandem.engines.sglang_stream import generate_kwargs
    sp = SamplingParams(max_tokens=2)
    kw = generate_kwargs(EngineRequest("a", [1, 2, 3], sp, cache_salt="s" * 32), "0" * 32,
                         deterministic=False)
    assert kw["cache_salt"] == "s" * 32
    assert "cache_salt" not in generate_kwargs(EngineRequest("a", [1, 2, 3], sp), "0" * 32,
                                               deterministic=False)
