"""perf/prefix/bench_prefix.py's parts without any cluster: the workload generators (seeded, lengths in
range, the oracle by hand), the client against a scripted SSE server (a session's next prompt is
its previous prompt, the completion re-tokenized and the new turn; the session headers and `user`;
a 503 counted and ending its session), and the report (the target load, the targets, the tables
and the plot) on scripted rows."""

from __future__ import annotations

import asyncio
import json

import pytest

from perf.prefix import prefix_report as R
from perf.prefix import prefix_workloads as W
from perf.prefix.prefix_drive import drive_level, summarize

P = W.Params(groups=3, prefix_min=40, prefix_max=50, question_min=5, question_max=9,
             level_seconds=2.0, min_requests=10, turns_min=2, turns_max=3, context_min=10,
             context_max=20, user_min=3, user_max=6, think_s=0.0)


def test_the_workloads_are_seeded_and_in_range() -> None:
    a, b = W.make("shared", P, 10.0, 7), W.make("shared", P, 10.0, 7)
    assert [s.turns for s in a] == [s.turns for s in b] and len(a) == 20
    assert all(x >= W.FIRST_ID for s in a for x in s.turns[0])
    assert all(45 <= len(s.turns[0]) <= 59 for s in a)
    assert [s.start_s for s in a] == sorted(s.start_s for s in a)
    u = W.make("uniform", P, 10.0, 7)
    assert len({tuple(s.turns[0][:16]) for s in u}) == len(u)  # no shared first page
    m = W.make("multiturn", P, 10.0, 7)
    assert all(2 <= len(s.turns) <= 3 and len(s.think_s) == len(s.turns) - 1 for s in m)
    # each turn but the last has its scripted answer: the same ids whatever server answers
    assert all(len(s.answers) == len(s.turns) - 1 and
               all(len(x) == P.answer_tokens for x in s.answers) for s in m)
    assert [s.answers for s in m] == [s.answers for s in W.make("multiturn", P, 10.0, 7)]
    with pytest.raises(ValueError):
        W.make("nope", P, 1.0, 1)


def test_the_oracle_caches_every_request_of_a_group_but_its_first() -> None:
    sessions = W.make("shared", P, 10.0, 3)
    seen: set[int] = set()
    for s in sessions:
        prefix_pages = [len(x.turns[0]) for x in sessions if x.group == s.group]
        want = 0 if s.group not in seen else s.oracle_cached[0]
        seen.add(s.group)
        assert s.oracle_cached[0] == want and want % P.page_size == 0
        assert want < min(prefix_pages)  # within the prefix, never the last token
    firsts = {s.group: s for s in reversed(sessions)}
    assert all(firsts[g].oracle_cached == [0] for g in firsts)
    total = sum(len(s.turns[0]) for s in sessions)
    assert W.oracle_hit_rate(sessions) == pytest.approx(
        sum(s.oracle_cached[0] for s in sessions) / total)


def _sse(text: str, prompt: int, cached: int) -> bytes:
    events = [{"choices": [{"text": text, "index": 0}]},
              {"choices": [{"text": "", "index": 0, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 2,
                                        "prompt_tokens_details": {"cached_tokens": cached}}}]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    body += b"data: [DONE]\n\n"
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def test_a_session_grows_by_its_scripted_answer_and_carries_its_key() -> None:
    seen: list[tuple[dict, bytes]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            body = json.loads(await reader.readexactly(n))
            seen.append((body, head))
            if body["prompt"][0] == 7 and len(body["prompt"]) == 25:  # m2's second turn: 503
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}")
                continue
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" +
                         _sse("ab", len(body["prompt"]), 16))
            await writer.drain()
        writer.close()

    two = W.Session("m1", 0.0, [[5] * 20, [6] * 4], [0.0], answers=[[197, 198]])
    three = W.Session("m2", 0.05, [[7] * 20, [8] * 3, [9] * 3], [0.0, 0.0],
                      answers=[[11, 12], [13, 14]])
    lone = W.Session("s", 0.0, [[4] * 30], oracle_cached=[16])

    async def main() -> tuple:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await drive_level("127.0.0.1", port, "tiny", [two, three, lone], 2)
        finally:
            server.close()

    recs, unsent, wall = asyncio.run(main())
    by = {(b["user"] if "user" in b else "", len(b["prompt"])): (b, h) for b, h in seen}
    b, h = by[("m1", 20 + 2 + 4)]
    assert b["prompt"] == [5] * 20 + [197, 198] + [6] * 4  # prompt + its answer + new turn
    assert b"X-Session-ID: m1\r\n" in h and b"X-Dynamo-Session-ID: m1\r\n" in h
    assert b["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    lone_body, lone_head = by[("", 30)]
    assert b"X-Session-ID" not in lone_head
    assert len(recs) == 5 and wall > 0
    row = summarize(recs, unsent, wall)
    assert row["rejected_503"] == 1 and row["ok"] == 4
    assert unsent == 1  # the refused request's session loses its third turn
    assert row["hit_rate"] == pytest.approx(64 / sum(r.prompt_tokens for r in recs if r.ok))
    assert row["oracle_hit_rate"] > 0


def _row(level: int, rate: float, ttft: float, hit: float = 0.5, oracle: float = 0.9,
         r503: int = 0) -> dict:
    return {"level": level, "rate": rate, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft,
            "hit_rate": hit, "oracle_hit_rate": oracle, "rejected_503": r503,
            "rate_503": r503 / 100, "requests": 100, "output_tok_s": 1000.0}


def _runs() -> list[dict]:
    runs = []
    for run, jitter in ((1, 1.0), (2, 1.1)):
        for arm, wl, rows in (
            ("tandem:4agg:round-robin", "shared", [(0, 8, 60), (1, 40, 100), (2, 72, 200)]),
            ("tandem:4agg:kv", "shared", [(0, 8, 20), (1, 40, 22), (2, 72, 25)]),
            ("tandem:4agg:least-loaded", "uniform", [(0, 8, 60), (1, 40, 70), (2, 72, 90)]),
            ("tandem:4agg:kv", "uniform", [(0, 8, 61), (1, 40, 72), (2, 72, 120)]),
            ("dynamo:4agg:round-robin", "shared", [(0, 8, 55), (1, 40, 60), (2, 72, 90)]),
            ("dynamo:4agg:kv", "shared", [(0, 8, 20), (1, 40, 40), (2, 72, 50)]),
        ):
            hit = 0.88 if arm == "tandem:4agg:kv" else 0.85 if "dynamo:4agg:kv" == arm else 0.5
            runs.append({"run": run, "arm": arm, "workload": wl, "rows": [
                _row(lv, rate, t * jitter, hit, r503=1 if (arm, lv) == ("tandem:4agg:kv", 2)
                     else 0) for lv, rate, t in rows]})
    return runs


def test_the_report_finds_the_target_load_and_checks_the_targets() -> None:
    med = R.medians(_runs())
    assert med[("tandem:4agg:kv", "shared", 2)]["ttft_p50_ms"] == pytest.approx(26.25)
    assert med[("tandem:4agg:kv", "shared", 2)]["rejected_503_sum"] == 2
    lv, why = R.target_level(med, "tandem:4agg:round-robin")
    assert lv == 2 and "3.3x" in why  # 210 ms >= 3 x 63 ms
    checks = {t["text"].split(":")[0]: t["pass"] for t in R.targets(med, "4agg")}
    assert checks["kv TTFT p50 26 ms vs round-robin 210 ms"] is True
    assert checks["kv hit rate 0.880 vs oracle 0.900"] is True
    assert checks["kv 503s <= round-robin's at every load (3 workload-levels)"] is False
    assert checks["uniform control at level 2"] is False  # 126 ms vs least-loaded's 94.5
    assert checks["shared"] is True  # hit rate 0.88 >= Dynamo's 0.85 (and the gain: 8x >= 1.8x)
    text = R.markdown(_runs(), ["# t"], ["dynamo kv: a reason"])
    assert "- FAIL: uniform control" in text and "- PASS: kv TTFT p50" in text
    assert "dynamo kv: a reason" in text and "| tandem:4agg:kv | 72 |" in text


def test_the_uniform_control_allows_the_spread_of_two_arms_that_place_alike() -> None:
    def med(kv: float, ll: float, prefix: float | None) -> dict:
        arms = {"kv": kv, "least-loaded": ll, **({"prefix": prefix} if prefix else {})}
        return R.medians([{"run": 1, "arm": f"tandem:2p2d:{a}", "workload": "uniform",
                           "rows": [_row(0, 8, 50.0), _row(1, 56, t)]} for a, t in arms.items()])

    assert R.uniform_check(med(1090, 1000, None), "2p2d", 1)["pass"] is True  # within 10%
    assert R.uniform_check(med(1110, 1000, None), "2p2d", 1)["pass"] is False
    # least-loaded and prefix, the same placement on this traffic, 30% apart: that is the noise
    wide = R.uniform_check(med(1250, 1000, 1300), "2p2d", 1)
    assert wide["pass"] is True and "30% apart" in wide["text"] and "1.30x" in wide["text"]
    assert R.uniform_check(med(1350, 1000, 1300), "2p2d", 1)["pass"] is False
    assert "0: 1.00, 1: 1.35" in R.uniform_check(med(1350, 1000, 1300), "2p2d", 1)["text"]
    assert R.uniform_check(med(1350, 1000, 1300), "2p2d", None)["pass"] is None  # no level


def test_the_plot_has_a_row_per_workload() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    fig = R.plot(_runs())
    titles = [a.get_title() for a in fig.axes]
    assert "shared: TTFT p50 (ms)" in titles and "uniform: 503 rate" in titles
    assert len(fig.axes) == 6


def test_multiturn_own_answers_are_what_the_mock_engine_generates() -> None:
    """Decode-held reuse needs the next turn to hold the engine's own completion: each scripted
    answer is the mock's ids for the turn's whole prompt (as the mock computes them)."""
    from dataclasses import replace

    from tandem.engines.mock import mock_token

    own = replace(P, mock_vocab=500, mock_eos=[2])
    with pytest.raises(ValueError):
        W.make("multiturn-own", P, 10.0, 7)  # (no vocabulary: no ids to predict)
    sessions = W.make("multiturn-own", own, 10.0, 7)
    plain = W.make("multiturn", own, 10.0, 7)
    assert [s.turns for s in sessions] == [s.turns for s in plain]
    for s in sessions:
        prompt = list(s.turns[0])
        for answer, turn in zip(s.answers, s.turns[1:]):
            assert answer == [mock_token(prompt, j, 500, frozenset([2]))
                              for j in range(own.answer_tokens)]
            prompt += answer + turn


def test_the_trace_is_scaled_the_same_way_for_every_arm() -> None:
    from perf.prefix.bench_trace import scaled

    lines = [{"timestamp": 1000, "input_length": 1100, "output_length": 500,
              "hash_ids": [0, 1, 2]},
             {"timestamp": 5000, "input_length": 6000, "output_length": 3,
              "hash_ids": list(range(12))}]
    out = scaled(lines, 64, 10, 64, 4.0)
    assert [x["timestamp"] for x in out] == [0, 1000]
    assert out[0]["hash_ids"] == [0, 1, 2] and out[1]["hash_ids"] == list(range(10))
    # AIPerf's rule: (blocks - 1) * block < input <= blocks * block
    assert out[0]["input_length"] == round(1100 * 64 / 512)
    assert 9 * 64 < out[1]["input_length"] <= 10 * 64
    assert [x["output_length"] for x in out] == [64, 3]


def test_the_trace_oracle_counts_only_leading_blocks_seen_before() -> None:
    from perf.prefix.bench_trace import oracle_reuse

    lines = [{"input_length": 128, "hash_ids": [0, 1]},
             {"input_length": 160, "hash_ids": [0, 1, 2]},  # 2 blocks seen: 128 of 160
             {"input_length": 100, "hash_ids": [0, 5]},  # 1 block: 64
             {"input_length": 64, "hash_ids": [9]}]  # none
    assert oracle_reuse(lines, 64) == pytest.approx((128 + 64) / (128 + 160 + 100 + 64))


def test_the_multi_round_qa_trace_has_lmcache_s_shape() -> None:
    """perf.prefix.qa_trace: each user's prompts share the system blocks with every user, carry
    its own history and every earlier question and answer, and come `users / qps` apart; a user
    that asked its last round gives its slot to a new one; the lines are in time order."""
    from perf.prefix.qa_trace import BLOCK, lines

    out = list(lines(users=3, rounds=2, qps=1.5, total_users=5, system_blocks=2,
                     history_blocks=3, question_blocks=1, answer_blocks=2, answer_tokens=7))
    assert len(out) == 5 * 2
    assert [ln["timestamp"] for ln in out] == sorted(ln["timestamp"] for ln in out)
    assert all(ln["hash_ids"][:2] == [0, 1] and ln["output_length"] == 7 for ln in out)
    assert all(ln["input_length"] == len(ln["hash_ids"]) * BLOCK for ln in out)
    by_user: dict[int, list[dict]] = {}
    for ln in out:  # a user's first own block (its history) names it
        by_user.setdefault(ln["hash_ids"][2], []).append(ln)
    assert len(by_user) == 5
    for turns in by_user.values():
        first, second = turns
        assert len(first["hash_ids"]) == 2 + 3 + 1
        # the second round: the first's prompt, its answer (2 blocks) and a new question
        assert second["hash_ids"][:6] == first["hash_ids"] and len(second["hash_ids"]) == 6 + 3
        assert second["timestamp"] - first["timestamp"] == 2000  # 3 users / 1.5 req/s
    starts = sorted(turns[0]["timestamp"] for turns in by_user.values())
    assert starts == [0, 667, 1333, 4000, 4667]  # slots staggered; users 3 and 4 follow 0 and 1
    assert len({h for ln in out for h in ln["hash_ids"][2:]}) == 5 * (3 + 1 + 2 + 1)
