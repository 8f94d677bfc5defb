"""The soak's comparison (perf/soak/soak_client.py, perf/soak/soak_mix.py) is not vacuous: chunking does not
change an answer's canonical form, and a duplicated token, a lost one, other usage, other
logprobs or a partial stream that is not a prefix each count as a mismatch."""

from __future__ import annotations

import json

from perf.common.client import dechunk
from perf.soak.soak_client import canonical_body, canonical_events, parse_sse
from perf.soak.soak_mix import Body, finish, judge, make_pool, pilot_bodies


def lp(tokens: list[str], at: int) -> dict:
    return {"tokens": tokens, "token_logprobs": [-0.5] * len(tokens),
            "top_logprobs": [{t: -0.5} for t in tokens],
            "text_offset": list(range(at, at + len(tokens)))}


def events(pieces: list[list[str]], usage: int = 3) -> list[dict]:
    out = []
    at = 0
    for i, chunk in enumerate(pieces):
        at += len(chunk)
        out.append({"choices": [{"index": 0, "text": "".join(chunk),
                                 "logprobs": lp(chunk, at - len(chunk)),
                                 "finish_reason": "length" if i == len(pieces) - 1 else None}]})
    out.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": usage,
                                         "total_tokens": 5 + usage}})
    return out


BODY = Body(0, "completions", True, {})


def test_chunking_does_not_change_the_canonical_answer() -> None:
    want = canonical_events("completions", events([["a"], ["b"], ["c"]]))
    assert judge(BODY, canonical_events("completions", events([["a", "b"], ["c"]])), want) == ""


def test_a_duplicated_or_lost_token_other_usage_or_logprobs_is_a_mismatch() -> None:
    want = canonical_events("completions", events([["a"], ["b"], ["c"]]))
    dup = canonical_events("completions", events([["a"], ["b"], ["b"], ["c"]]))
    lost = canonical_events("completions", events([["a"], ["c"]]))
    usage = canonical_events("completions", events([["a"], ["b"], ["c"]], usage=4))
    assert "text" in judge(BODY, dup, want) or "usage" in judge(BODY, dup, want)
    assert judge(BODY, lost, want)
    assert "usage" in judge(BODY, usage, want)
    other = events([["a"], ["b"], ["c"]])
    other[1]["choices"][0]["logprobs"]["token_logprobs"] = [-0.25]
    assert "logprobs" in judge(BODY, canonical_events("completions", other), want)


def test_a_partial_stream_left_on_purpose_must_be_a_prefix() -> None:
    left = Body(1, "completions", True, {}, disconnect_after=2)
    want = canonical_events("completions", events([["a"], ["b"], ["c"]]))
    assert judge(left, canonical_events("completions", events([["a"], ["b"]])), want) == ""
    assert judge(left, canonical_events("completions", events([["a"], ["x"]])), want)


def test_a_chat_body_and_a_cut_chunked_stream() -> None:
    body = {"choices": [{"index": 1, "message": {"content": "y"}, "finish_reason": "stop"},
                        {"index": 0, "message": {"content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    assert canonical_body("chat", body)["choices"] == [["x", "length", []], ["y", "stop", []]]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events([["a"]]))
    for cut in (b"9\r\ndata:", b"5\r\ndata:"):  # a chunk cut short; an event cut short
        raw = b"%x\r\n%s\r\n" % (len(sse), sse) + cut
        got, why = parse_sse(dechunk(raw, partial=True), complete=False)
        assert why == "" and len(got) == 2
        assert parse_sse(dechunk(raw, partial=True), complete=True)[1]  # not whole: an error


def test_the_mix_is_seeded_and_covers_every_kind() -> None:
    a, b = make_pool(96, 27, "tiny"), make_pool(96, 27, "tiny")
    for pool in (a, b):
        finish(pool, {p.id: "the sea and the ship" for p in pilot_bodies(pool)}, 27)
    assert [x.encoded for x in a] == [x.encoded for x in b]
    kinds = {k for x in a for k in x.kinds}
    assert kinds >= {"chat", "completions", "stream", "non-stream", "n>1", "logprobs", "stop",
                     "greedy", "seeded", "disconnect"}


def test_a_tolerance_covers_logprob_values_only() -> None:
    want = canonical_events("completions", events([["a"], ["b"]]))
    near = events([["a"], ["b"]])
    near[1]["choices"][0]["logprobs"]["token_logprobs"] = [-0.5 + 1e-6]
    assert judge(BODY, canonical_events("completions", near), want)  # exact by default
    assert judge(BODY, canonical_events("completions", near), want, 1e-4) == ""
    other = canonical_events("completions", events([["a"], ["c"]]))
    assert "text" in judge(BODY, other, want, 1e-4)
