"""Sampling parameters and logprobs, the same way for every engine in engines.ENGINES: logprobs
come one per token, in both output modes, and agree with the tokens; a large logit_bias makes its
token the output; under PD, penalties, bias and logprobs give exactly what an aggregated run gives.
An engine that cannot do one of these refuses it at submit, naming the field (checked here too)."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.engines.base import Engine, EngineRequestError
from tandem.runtime.wire import SamplingParams
from tests.conformance.engines import Make, PdLink
from tests.conformance.harness import Recorder, Run, finished, generate, wait_idle

GREEDY: dict[str, Any] = {"temperature": 0.0}
PROMPTS = [[0, 5, 100, 200, 7, 900], [0, 17], [3, 2, 1, 4, 1023, 8, 9]]


def refused(engine: Engine, sp: SamplingParams, field: str, **kw: Any) -> None:
    with pytest.raises(EngineRequestError) as e:
        Recorder(engine).submit(engine, "refused", [1, 2, 3], sp, **kw)
    assert e.value.param == field


def well_formed(run: Run, k: int) -> None:
    assert [lp.token_id for lp in run.logprobs] == run.ids
    for lp in run.logprobs:
        assert lp.logprob <= 0.0 and len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and len({t for t, _ in lp.top}) == k
        assert all(v <= 0.0 for v in values)
        for tok, v in lp.top:
            if tok == lp.token_id:
                assert v == pytest.approx(lp.logprob)


@pytest.mark.parametrize("k", [0, 1, 5])
async def test_logprobs_come_one_per_token_in_both_modes(make: Make, k: int) -> None:
    cum, inc = await make(output_mode="cumulative"), await make(output_mode="incremental")
    sp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=k, **GREEDY)
    a = await finished(Recorder(cum).submit(cum, "c", PROMPTS[0], sp))
    b = await finished(Recorder(inc).submit(inc, "i", PROMPTS[0], sp))
    assert a.ids == b.ids and a.logprobs == b.logprobs and len(a.logprobs) == 10
    well_formed(a, k)
    if k:  # greedy, no penalty: the chosen token is the likeliest
        assert all(lp.top[0][0] == lp.token_id for lp in a.logprobs)
    plain = await generate(cum, "p", PROMPTS[0], max_tokens=10, ignore_eos=True, **GREEDY)
    assert plain.ids == a.ids and plain.logprobs == []  # nothing unless asked
    for e in (cum, inc):
        await wait_idle(e)


async def test_a_large_logit_bias_makes_its_token_the_output(make: Make) -> None:
    engine = await make()
    sp = {"max_tokens": 6, "ignore_eos": True, **GREEDY}
    if engine.name == "sglang":  # the fake's model ignores sampling; tests/sglang checks the keys
        pytest.skip("the fake SGLang model does not sample")
    run = await generate(engine, "b", PROMPTS[0], logit_bias={42: 100.0}, **sp)
    assert run.ids == [42] * 6
    refused(engine, SamplingParams(logit_bias={engine.spec.vocab_size: 1.0}), "logit_bias")
    await wait_idle(engine)


async def pd_pair(make: Make) -> tuple[PdLink, Engine, Engine, Engine]:
    link = PdLink()
    agg = await make(num_pages=128)
    prefill = await make("prefill", link=link, num_pages=128)
    decode = await make("decode", link=link, num_pages=128)
    return link, agg, prefill, decode


async def pd_run(link: PdLink, prefill: Engine, decode: Engine, rid: str, prompt: list[int],
                 sp: SamplingParams) -> tuple[Run, Run]:
    b = link.bootstrap()
    p_run = Recorder(prefill).submit(prefill, rid, prompt, sp, b)
    d_run = Recorder(decode).submit(decode, rid, prompt, sp, b)
    return await finished(p_run), await finished(d_run)


async def test_pd_with_penalties_and_bias_equals_aggregated(make: Make) -> None:
    link, agg, prefill, decode = await pd_pair(make)
    cases: list[dict[str, Any]] = [
        {"presence_penalty": 2.0}, {"frequency_penalty": 1.5, "logit_bias": {42: 3.0}},
        {"repetition_penalty": 1.4, "temperature": 0.9, "seed": 4, "min_p": 0.05}]
    for i, kw in enumerate(cases):
        sp = SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **GREEDY, **kw})
        want = await finished(Recorder(agg).submit(agg, f"a{i}", PROMPTS[1], sp))
        p_run, d_run = await pd_run(link, prefill, decode, f"pd{i}", PROMPTS[1], sp)
        assert p_run.ids == want.ids[:1] and d_run.ids == want.ids, (p_run.error, d_run.error)
    for e in (agg, prefill, decode):
        await wait_idle(e)


async def test_pd_logprobs_equal_aggregated_or_are_refused(make: Make) -> None:
    link, agg, prefill, decode = await pd_pair(make)
    sp = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=4, temperature=0.8, seed=9,
                        presence_penalty=0.5)
    handoff = getattr(decode, "handoff", None)
    if agg.name == "sglang":  # (its seed is refused without deterministic inference, too)
        pytest.skip("SGLang's PD handoff is SGLang's own: its 1P1D logprobs are checked live "
                    "against transformers' (tests/sglang/test_sglang_live_cluster.py)")
    if handoff is None or not handoff.carries_logprobs:
        for engine in (prefill, decode):
            refused(engine, sp, "logprobs", bootstrap=link.bootstrap())
        pytest.skip(f"{agg.name}: this PD handoff does not carry logprobs (refusal checked)")
    want = await finished(Recorder(agg).submit(agg, "a", PROMPTS[0], sp))
    p_run, d_run = await pd_run(link, prefill, decode, "pd", PROMPTS[0], sp)
    assert d_run.ids == want.ids and d_run.logprobs == want.logprobs
    assert p_run.logprobs == want.logprobs[:1]
    for e in (agg, prefill, decode):
        await wait_idle(e)
