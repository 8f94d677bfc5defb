"""The sampling parameters and logprobs on the wire, and what engines refuse: new fields round-trip
(and an old peer's messages, without them, still decode), a merged delta keeps its logprobs aligned
with its tokens, and every out-of-range parameter is refused naming its field."""

from __future__ import annotations

import msgspec
import pytest

from tandem.engines.base import ModelSpec
from tandem.engines.sampling import check_request, check_sampling
from tandem.runtime import wire as W
from tandem.runtime.errors import EngineRequestError
from tandem.runtime.sampling import MAX_GRAMMAR_CHARS

FULL = W.SamplingParams(max_tokens=7, temperature=0.5, presence_penalty=1.5,
                        frequency_penalty=-0.5, repetition_penalty=1.3,
                        logit_bias={5: 100.0, 0: -100.0}, min_p=0.1, logprobs=3,
                        json_schema='{"type": "object"}')


def lp(tok: int, top: int = 2) -> W.TokenLogprobs:
    return W.TokenLogprobs(tok, -0.25 * tok, [(tok + j, -0.5 * j) for j in range(top)])


def test_new_sampling_fields_round_trip_inside_a_generate() -> None:
    msg = W.Generates([W.Generate("r", [1, 2], FULL)])
    payload = W.encode(msg)
    got = W.TO_WORKER.decode(payload)
    assert isinstance(got, W.Generates) and got.items[0].sampling == FULL
    assert got.items[0].sampling.logit_bias == {5: 100.0, 0: -100.0}


def test_old_and_new_peers_read_each_others_sampling_params() -> None:
    """An old peer's SamplingParams (the first 8 fields) decodes with neutral values: the new
    fields are at the end, so the old field order holds."""

    class Old(msgspec.Struct, array_like=True, omit_defaults=True):
        max_tokens: int = 16
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0
        seed: int | None = None
        stop_token_ids: tuple[int, ...] = ()
        ignore_eos: bool = False
        min_tokens: int = 0

    old = msgspec.msgpack.encode(Old(max_tokens=5, temperature=0.0, min_tokens=2))
    new = msgspec.msgpack.decode(old, type=W.SamplingParams)
    assert new == W.SamplingParams(max_tokens=5, temperature=0.0, min_tokens=2)
    assert (new.presence_penalty, new.frequency_penalty, new.repetition_penalty, new.logit_bias,
            new.min_p, new.logprobs, new.json_schema, new.regex) == (0.0, 0.0, 1.0, None, 0.0,
                                                                     None, None, None)
    # ...and an old peer reads a new peer's request, the fields it does not know ignored.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(FULL), type=Old) == Old(
        max_tokens=7, temperature=0.5)


def test_delta_logprobs_and_kvdone_first_logprobs_round_trip() -> None:
    d = W.Delta("r", 3, [7, 8], "stop", W.Usage(2, 5, 0), logprobs=[lp(7), lp(8, 0)])
    payload = W.encode(W.Deltas([d, W.Delta("q", 0, [1])]))
    got = W.TO_FRONTEND.decode(payload)
    assert isinstance(got, W.Deltas) and got.items[0] == d and got.items[1].logprobs is None
    assert got.items[0].logprobs is not None and got.items[0].logprobs[0].top == [(7, 0.0),
                                                                                (8, -0.5)]
    done = W.KvDones([W.KvDone(9, True, 42, first_logprobs=lp(42))])
    payload = W.encode(done)
    assert W.TO_DECODE.decode(payload) == done
    plain = W.KvDones([W.KvDone(9, True, 42)])
    assert W.TO_DECODE.decode(W.encode(plain)) == plain


def test_merging_deltas_keeps_logprobs_aligned() -> None:
    a = W.Delta("r", 0, [1], logprobs=[lp(1)])
    b = W.Delta("r", 1, [2, 3], logprobs=[lp(2), lp(3)])
    end = W.Delta("r", 3, [], "length", W.Usage(1, 3, 0))
    merged = a.joined(b)
    assert (a.token_ids, a.logprobs) == ([1], [lp(1)])  # joined changes neither
    assert merged.token_ids == [1, 2, 3] and merged.logprobs == [lp(1), lp(2), lp(3)]
    merged.extend(end)
    assert merged.finish_reason == "length" and merged.usage == W.Usage(1, 3, 0)
    assert merged.logprobs is not None and len(merged.logprobs) == len(merged.token_ids)
    plain = W.Delta("r", 0, [1])
    plain.extend(W.Delta("r", 1, [2]))
    assert plain.token_ids == [1, 2] and plain.logprobs is None
    first_empty = W.Delta("r", 0, [])  # a delta with no token yet takes the later logprobs
    first_empty.extend(b)
    assert first_empty.logprobs == [lp(2), lp(3)]


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("min_p", 1.5), ("min_p", -0.1),
    ("logit_bias", {5: 101.0}), ("logit_bias", {5: -100.5}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {1024: 1.0}), ("logprobs", 21), ("logprobs", -1),
    ("presence_penalty", float("nan")), ("logit_bias", {5: float("nan")}),
])
def test_out_of_range_parameters_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(EngineRequestError) as e:
        check_sampling(W.SamplingParams(**{field: value}), vocab_size=1024)  # type: ignore[arg-type]
    assert e.value.param == field


def test_edges_are_accepted() -> None:
    check_sampling(W.SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0,
                                    repetition_penalty=5.0, min_p=1.0, logprobs=20,
                                    logit_bias={0: -100.0, 1023: 100.0}), vocab_size=1024)
    check_sampling(W.SamplingParams(logprobs=0))


def test_grammars_are_bounded_and_one_at_a_time() -> None:
    """Every place that checks (the frontend, the worker, every engine) bounds a grammar; which
    engine constrains its output is the engine's own (tests/unit/test_grammar.py)."""
    spec = ModelSpec("m", 64, vocab_size=100)
    check_request([1], W.SamplingParams(json_schema="{}"), spec)
    for sp, field in ((W.SamplingParams(json_schema="{}", regex="a"), "regex"),
                      (W.SamplingParams(json_schema="x" * (MAX_GRAMMAR_CHARS + 1)), "json_schema"),
                      (W.SamplingParams(regex="a" * (MAX_GRAMMAR_CHARS + 1)), "regex")):
        with pytest.raises(EngineRequestError) as e:
            check_request([1], sp, spec)
        assert e.value.param == field


def test_own_engines_refuse_uncarried_pd_logprobs() -> None:
    spec = ModelSpec("m", 64, vocab_size=100)
    with pytest.raises(EngineRequestError) as e:
        check_request([1], W.SamplingParams(logprobs=0), spec, carries_logprobs=False)
    assert e.value.param == "logprobs"
    check_request([1], W.SamplingParams(logprobs=0), spec, carries_logprobs=True)
    check_request([1], W.SamplingParams(), spec, carries_logprobs=False)


def test_check_request_remembers_only_what_it_found_valid() -> None:
    """Parameters are checked once per distinct valid set and vocabulary; anything different is
    checked again (a bad value after a good one, the same one with a smaller vocabulary, a
    logit_bias, which is never remembered)."""
    good = W.SamplingParams(max_tokens=9, top_p=0.5, presence_penalty=1.0)
    spec = ModelSpec("m", 64, vocab_size=100)
    for _ in range(2):
        check_request([1], good, spec)
    for bad in (msgspec.structs.replace(good, top_p=0.0),
                msgspec.structs.replace(good, presence_penalty=2.5)):
        with pytest.raises(EngineRequestError):
            check_request([1], bad, spec)
    biased = msgspec.structs.replace(good, logit_bias={99: 1.0})
    check_request([1], biased, spec)
    with pytest.raises(EngineRequestError) as e:
        check_request([1], biased, ModelSpec("m", 64, vocab_size=50))
    assert e.value.param == "logit_bias"
    with pytest.raises(EngineRequestError):  # (max_tokens 0: invalid, whatever was seen)
        check_request([1], msgspec.structs.replace(good, max_tokens=0), spec)
