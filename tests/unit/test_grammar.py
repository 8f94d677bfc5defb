"""Constrained output on the reference engine (tandem.engines.reference.grammar): what a
json_schema or regex request produces follows its grammar, greedy or sampled, batched with
unconstrained requests, resumed after a migration, and with its first token sampled by another
engine (PD); what cannot be honoured is refused naming the field; the mock engine refuses by name.
Every page comes back (the engine fixture waits for idle and checks the pool)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tandem.engines.base import EngineError, EngineRequest, EngineRequestError
from tandem.engines.mock import MockEngine
from tandem.engines.reference import ReferenceEngine
from tandem.runtime.wire import SamplingParams
from tests.conformance.harness import Recorder, generate, wait_idle

PROMPT = [0, 5, 100, 200, 7, 900]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tiny_model: str) -> Path:
    return Path(tiny_model)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[ReferenceEngine]:
    e = ReferenceEngine(model_dir, page_size=4, max_batch=16, check_pages=True)
    await e.start()
    yield e
    await wait_idle(e)
    await e.shutdown()


async def text(engine: ReferenceEngine, tok: Tokenizer, rid: str = "r",
               prompt: list[int] = PROMPT, **sampling: Any) -> str:
    r = await generate(engine, rid, list(prompt), **{"max_tokens": 200, **sampling})
    assert r.error is None and r.finish == "stop", (r.finish, r.error, tok.decode(r.ids))
    assert r.ids[-1] in engine.spec.eos_token_ids  # the grammar ended it
    return str(tok.decode(r.ids[:-1], skip_special_tokens=False))


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3},
                                      {"temperature": 1.3, "top_p": 0.9, "seed": 4,
                                       "logprobs": 2, "repetition_penalty": 1.2}])
async def test_json_schema_output_parses_and_validates(engine: ReferenceEngine, tok: Tokenizer,
                                                       sampling: dict[str, Any]) -> None:
    out = await text(engine, tok, json_schema=json.dumps(PERSON), **sampling)
    jsonschema.validate(json.loads(out), PERSON)


async def test_any_json_object_and_regex(engine: ReferenceEngine, tok: Tokenizer) -> None:
    # An untrained model rarely closes a free string: a bias on the closing characters makes it
    # end within max_tokens; the grammar keeps every token it picks valid JSON.
    bias = {tok.token_to_id(c): 6.0 for c in '"}]1'}
    for seed in range(4):
        value = json.loads(await text(engine, tok, f"j{seed}", json_schema='{"type": "object"}',
                                      temperature=1.0, seed=seed, logit_bias=bias))
        assert isinstance(value, dict)
        out = await text(engine, tok, f"x{seed}", regex=r"(yes|no), [0-9]{2,4}!",
                         temperature=1.0, seed=seed)
        assert re.fullmatch(r"(yes|no), [0-9]{2,4}!", out), out


async def test_constrained_and_free_requests_share_a_batch(engine: ReferenceEngine,
                                                           tok: Tokenizer) -> None:
    free = (await generate(engine, "alone", PROMPT, max_tokens=30, temperature=0.0)).ids
    runs = await asyncio.gather(
        text(engine, tok, "c1", json_schema=json.dumps(PERSON), temperature=0.0),
        generate(engine, "f1", PROMPT, max_tokens=30, temperature=0.0),
        text(engine, tok, "c2", regex="[a-f]{8}", temperature=1.0, seed=1))
    jsonschema.validate(json.loads(runs[0]), PERSON)
    assert runs[1].ids == free  # the mask touched only its own rows
    assert re.fullmatch("[a-f]{8}", runs[2])


async def test_a_resumed_request_goes_on_within_its_grammar(engine: ReferenceEngine,
                                                            tok: Tokenizer) -> None:
    """A migrated request's earlier completion rides in its prompt (resume_offset): its grammar
    takes those tokens first, so the rest completes the same document."""
    params = {"json_schema": json.dumps(PERSON), "temperature": 0.0, "max_tokens": 200}
    whole = (await generate(engine, "w", PROMPT, **params)).ids
    k = len(whole) // 2
    rec = Recorder(engine)
    run = rec.expect("rest")
    engine.submit(EngineRequest("rest", PROMPT + whole[:k], SamplingParams(**params),
                                resume_offset=k), rec)
    await run.done.wait()
    assert run.finish == "stop" and whole[:k] + run.ids == whole
    jsonschema.validate(json.loads(tok.decode(whole[:-1])), PERSON)


async def refusal(engine: ReferenceEngine, req: EngineRequest) -> EngineError:
    """How the engine refuses a request: at submit (what it checks there), or as its one output
    (what shows when its grammar compiles, off the loop)."""
    rec = Recorder(engine)
    run = rec.expect(req.rid)
    try:
        engine.submit(req, rec)
    except EngineRequestError as e:
        return e
    await asyncio.wait_for(run.done.wait(), 30)
    assert run.finish == "error" and run.ids == [] and run.error is not None, run
    return run.error


async def test_a_first_token_from_elsewhere_must_follow_the_grammar(engine: ReferenceEngine,
                                                                    tok: Tokenizer) -> None:
    """A resumed completion (or a PD prefill's first token) that breaks the grammar is refused,
    never continued as if it were valid; from the compile cache too."""
    bad = tok.encode("zz", add_special_tokens=False).ids
    for _ in range(2):
        e = await refusal(engine, EngineRequest("bad", PROMPT + bad, SamplingParams(
            json_schema=json.dumps(PERSON)), resume_offset=len(bad)))
        assert isinstance(e, EngineRequestError) and e.param == "resume_offset"


SLOW = json.dumps({"type": "string", "pattern": "(a|aa)*b{1,5000}"})  # about 1.3 s to compile


async def test_a_compile_past_its_deadline_fails_its_request_alone(engine: ReferenceEngine,
                                                                   tok: Tokenizer) -> None:
    """A grammar compiles off the event loop, within a deadline; a request cancelled while its
    grammar compiles gets nothing and holds nothing; the others run meanwhile."""
    engine._compiles.deadline_s = 0.05
    rec = Recorder(engine)
    gone = rec.submit(engine, "gone", PROMPT, SamplingParams(json_schema=SLOW))
    assert gone.handle is not None
    gone.handle.cancel()
    e = await refusal(engine, EngineRequest("late", PROMPT, SamplingParams(json_schema=SLOW + " ")))
    assert e.param == "json_schema" and "did not compile within 0.05s" in str(e)
    free = await generate(engine, "free", PROMPT, max_tokens=8, temperature=0.0)
    assert free.finish == "length"  # (the loop and the steps went on meanwhile)
    engine._compiles.deadline_s = 30.0
    out = await text(engine, tok, "next", regex="[ab]{4}", temperature=0.0)  # queued behind them
    assert re.fullmatch("[ab]{4}", out) and gone.outputs == []


@pytest.mark.parametrize("sampling, param", [
    ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": '{"$ref": "#/$defs/nope"}'}, "json_schema"),
    ({"json_schema": '{"type": "integer", "minimum": 5, "maximum": 1}'}, "json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"json_schema": "{}", "regex": "a"}, "regex"),
    ({"json_schema": "x" * 70000}, "json_schema"),
    ({"json_schema": "{}", "ignore_eos": True}, "ignore_eos"),
    ({"regex": "a+", "min_tokens": 2}, "min_tokens"),
])
async def test_what_cannot_be_honoured_is_refused_naming_it(engine: ReferenceEngine,
                                                           sampling: dict[str, Any],
                                                           param: str) -> None:
    e = await refusal(engine, EngineRequest("bad", PROMPT, SamplingParams(**sampling)))
    assert isinstance(e, EngineRequestError) and e.param == param, e
    assert engine.load().running == engine.load().waiting == 0


async def test_the_mock_engine_refuses_by_name(model_dir: Path) -> None:
    mock = MockEngine(str(model_dir))
    await mock.start()
    try:
        for field in ("json_schema", "regex"):
            with pytest.raises(EngineRequestError, match="mock engine: it produces no real text"
                               ) as e:
                mock.submit(EngineRequest("m", [1, 2], SamplingParams(**{field: "{}"})),
                            Recorder(mock))
            assert e.value.param == field
    finally:
        await mock.shutdown()


# --- 200 random schemas -------------------------------------------------------------------------
# Strings, arrays and numbers are bounded in the schemas (maxLength, maxItems, a range): a random
# model's output must end within max_tokens, which the grammar cannot promise for an unbounded one.

NAMES = st.text("abcdefghij_", min_size=1, max_size=6)
LEAVES = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.integers(-1000, 1000).map(lambda lo: {"type": "integer", "minimum": lo,
                                             "maximum": lo + 500}),
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.one_of(st.text("xyz", max_size=3), st.integers(-5, 5), st.booleans()),
             min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.text("abc", min_size=1, max_size=4).map(lambda v: {"const": v}),
)


def _object(props: dict[str, Any], required: list[bool]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": [k for k, r in zip(props, required) if r]}


SCHEMAS = st.recursive(LEAVES, lambda inner: st.one_of(
    st.tuples(inner, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0],
                                                       "maxItems": t[1]}),
    st.dictionaries(NAMES, inner, min_size=1, max_size=4).flatmap(
        lambda d: st.lists(st.booleans(), min_size=len(d), max_size=len(d)).map(
            lambda r: _object(d, r))),
    st.lists(inner, min_size=2, max_size=3).map(lambda v: {"anyOf": v}),
), max_leaves=8)


@pytest.fixture(scope="module")
def shared_engine(model_dir: Path) -> Any:
    loop = asyncio.new_event_loop()
    e = ReferenceEngine(model_dir, page_size=16, max_batch=8, check_pages=True)
    loop.run_until_complete(e.start())
    yield loop, e
    loop.run_until_complete(wait_idle(e))
    loop.run_until_complete(e.shutdown())
    loop.close()


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32))
def test_200_random_schemas_always_give_valid_json(shared_engine: Any, tok: Tokenizer,
                                                   schema: dict[str, Any], seed: int) -> None:
    loop, engine = shared_engine
    out = loop.run_until_complete(text(engine, tok, json_schema=json.dumps(schema),
                                       temperature=1.0, seed=seed, max_tokens=600))
    jsonschema.validate(json.loads(out), schema)
