"""Logprobs are exact under PD: an aggregated and a 1P1D reference cluster stream the same tokens
with the same logprobs (the first token's come from the prefill worker, the rest from the decode
worker), through the official SDK."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("nixl")
openai = pytest.importorskip("openai")


def _stream(url: str, **kw: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        return [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                for ch in client.chat.completions.create(model=model, stream=True, **kw)
                for c in ch.choices if c.logprobs for t in c.logprobs.content]


def test_agg_and_1p1d_stream_identical_logprobs(tiny_model, tmp_path):
    from tests.cluster import Cluster, reference_workers

    kw: dict[str, Any] = dict(messages=[{"role": "user", "content": "The sea is"}],
                              max_tokens=16, temperature=0, logprobs=True, top_logprobs=4)
    got = {}
    for shape in ("agg", "1p1d"):
        (tmp_path / shape).mkdir()
        c = reference_workers(Cluster(tiny_model, str(tmp_path / shape)), shape)
        try:
            c.start_frontend()
            got[shape] = _stream(c.url, **kw)
            c.assert_idle()
        finally:
            c.stop()
    assert len(got["agg"]) == 16
    assert got["1p1d"] == got["agg"]
