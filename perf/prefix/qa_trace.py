"""LMCache's multi-round QA shape as a trace in Mooncake's format, for perf.prefix.bench_trace.

LMCache's multi-round QA benchmark keeps `--users` users active at once; each user's conversation
starts with a system prompt every user shares and a long history of its own, then asks
`--rounds` questions, each prompt carrying the whole conversation so far (the questions and the
answers before it), each answer `--answer-tokens` long; the users together send `--qps`
requests per second, so each user asks again every users / qps seconds, and a user that asked
its last question is replaced by a new one. Its own defaults: 1,000 shared tokens, 2,000 of
history, answers of 100, 5 rounds.

The defaults keep its proportions at bench_trace's scale (`--block-tokens 64`: a block is 64
tokens there): a shared prompt of 512 tokens, a history of 1,024 (LMCache's 1:2), questions and
answers of one block and 64 output tokens, 5 rounds, and 80 users at once, so the users' contexts
(about 150,000 tokens) exceed 4 workers' device pools of 1,024 pages of 16 (65,536 tokens) and fit
a host tier 10x larger.

Here the same shape is written as Mooncake trace lines (one per request: `timestamp` in ms,
`input_length`, `output_length`, `hash_ids`, one id per block of 512 tokens, equal ids meaning
equal blocks), so AIPerf's `mooncake_trace` loader replays it like the conversation trace, and
bench_trace's `--block-tokens` scales the blocks. Block counts: the shared prompt, the history,
each question and each answer are whole blocks (`--system-blocks`, `--history-blocks`,
`--question-blocks`, `--answer-blocks`). A replayed answer is the trace's block, not what the
server generated, exactly as in Mooncake's own trace: the next round's prompt repeats the blocks
the client sent, so what a cache can reuse is the system prompt, the history and the earlier
questions and answers as sent.

    python -m perf.prefix.qa_trace --out qa_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

BLOCK = 512  # tokens per block in Mooncake's format


def lines(users: int, rounds: int, qps: float, total_users: int, system_blocks: int,
          history_blocks: int, question_blocks: int, answer_blocks: int,
          answer_tokens: int) -> Iterator[dict]:
    """The trace's lines in time order: user u (0, 1, ...) joins in slot u % users, after the
    user before it in that slot asked its last round; slot s's first user starts at
    s * gap / users, each user asks every `gap` = users / qps seconds."""
    gap_ms = users / qps * 1000.0
    ids = iter(range(system_blocks, 1 << 62))
    system = list(range(system_blocks))
    out: list[dict] = []
    for u in range(total_users):
        slot, generation = u % users, u // users
        t = slot * gap_ms / users + generation * rounds * gap_ms
        context = system + [next(ids) for _ in range(history_blocks)]
        for _ in range(rounds):
            context += [next(ids) for _ in range(question_blocks)]
            out.append({"timestamp": round(t), "input_length": len(context) * BLOCK,
                        "output_length": answer_tokens, "hash_ids": list(context)})
            context += [next(ids) for _ in range(answer_blocks)]
            t += gap_ms
    out.sort(key=lambda ln: ln["timestamp"])
    yield from out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m perf.prefix.qa_trace",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--users", type=int, default=80, help="users active at once")
    a("--rounds", type=int, default=5, help="questions per user")
    a("--qps", type=float, default=2.0, help="requests per second, all users together")
    a("--total-users", type=int, default=240, help="users in the whole trace")
    a("--system-blocks", type=int, default=8, help="shared system prompt, in blocks")
    a("--history-blocks", type=int, default=16, help="each user's own history, in blocks")
    a("--question-blocks", type=int, default=1, help="each question, in blocks")
    a("--answer-blocks", type=int, default=1, help="each answer as the next prompt carries it")
    a("--answer-tokens", type=int, default=64, help="each answer's length (output_length)")
    a("--out", default="-", help="where to write the trace (- for stdout)")
    args = p.parse_args(argv)
    for name in ("users", "rounds", "total_users", "answer_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.qps <= 0:
        p.error("--qps must be positive")
    f = sys.stdout if args.out == "-" else open(args.out, "w")
    try:
        for ln in lines(args.users, args.rounds, args.qps, args.total_users, args.system_blocks,
                        args.history_blocks, args.question_blocks, args.answer_blocks,
                        args.answer_tokens):
            f.write(json.dumps(ln) + "\n")
    finally:
        if f is not sys.stdout:
            f.close()


if __name__ == "__main__":
    main()
