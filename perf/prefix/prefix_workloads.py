"""The workloads of perf/prefix/bench_prefix.py, as data: each level of a load ladder is a list of
sessions, each session a start time (open-loop Poisson arrivals at the level's offered rate) and
its turns. A turn is the token ids the client appends to the conversation before sending it; a
one-turn session is a lone request. Everything is seeded and deterministic, so every arm (tandem's
policies, Dynamo) is sent the very same requests at the very same times.

- `shared`: G groups, each a long system prompt (`prefix_min`..`prefix_max` tokens, drawn per
  group), and short questions (`question_min`..`question_max`); requests of all groups
  interleaved at random.
- `multiturn`: sessions whose history grows each turn: the next prompt is the previous prompt, the
  turn's answer and a new user turn; a think time (exponential) between a turn's answer and the
  next turn. The answer in the history is the session's own (`answer_tokens` seeded ids), not the
  text the server sent: mock engines emit arbitrary ids whose text re-tokenizes to other ids and
  other lengths (tandem's mock: 32 ids become about 41; Dynamo's mocker: most decode to empty
  text), so re-tokenized answers would send each system different, differently growing prompts.
  Scripted, every system is sent the same prompts token for token; what an engine cached of its
  own completion is then never matched, on any system alike.
- `multiturn-own`: `multiturn` with each answer the mock engine's own ids for its prompt
  (tandem.engines.mock.mock_token, for the model's vocabulary and EOS ids: `mock_vocab`,
  `mock_eos`): the next turn's prompt then holds the very completion the engine computed, so
  what the decode worker cached of it can be reused (decode-held reuse; tandem's mock only).
- `uniform`: a control with no shared prefix: random prompts of the shared workload's lengths.

Each level draws its own groups and sessions (the level's seed), so a level starts cold for its own
prefixes whatever the earlier levels left in the caches. `oracle_cached` is what a placement that
knew every worker's cache would have had cached: every request of a group after the group's first,
the group's prefix in whole pages (a worker always computes a prompt's last token).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORKLOADS = ("shared", "multiturn", "uniform", "multiturn-own")  # (a level seed is its index)
FIRST_ID = 3  # ids below are the tiny model's special tokens


@dataclass
class Params:
    vocab: int = 1024
    page_size: int = 16
    groups: int = 12
    prefix_min: int = 1000
    prefix_max: int = 1200
    question_min: int = 20
    question_max: int = 60
    level_seconds: float = 6.0  # a level offers rate x this many requests ...
    min_requests: int = 48  # ... and at least this many
    # multiturn
    turns_min: int = 3
    turns_max: int = 8
    context_min: int = 200  # a session's first prompt: its own context ...
    context_max: int = 400
    user_min: int = 40  # ... and a user turn, as every later turn
    user_max: int = 120
    think_s: float = 1.0  # mean think time between turns (exponential)
    answer_tokens: int = 32  # what each turn appends as its answer (bench_prefix: max_tokens)
    mock_vocab: int = 0  # multiturn-own: the served model's vocabulary ...
    mock_eos: list[int] = field(default_factory=list)  # ... and EOS ids (the mock avoids them)


@dataclass
class Session:
    sid: str
    start_s: float
    turns: list[list[int]]  # ids each turn appends (turn 0: the whole first prompt)
    think_s: list[float] = field(default_factory=list)  # before turn i+1
    answers: list[list[int]] = field(default_factory=list)  # turn i's answer, in turn i+1's prompt
    group: int = -1  # shared: its group
    oracle_cached: list[int] = field(default_factory=list)  # per turn (shared only)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def level_requests(p: Params, rate: float) -> int:
    """Requests a level offers: its rate for `level_seconds`, at least `min_requests`."""
    return max(p.min_requests, round(rate * p.level_seconds))


def _arrivals(rng: random.Random, rate: float, n: int) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def shared(p: Params, rate: float, seed: int) -> list[Session]:
    rng = random.Random(seed)
    systems = [_ids(rng, rng.randint(p.prefix_min, p.prefix_max), p.vocab)
               for _ in range(p.groups)]
    n = level_requests(p, rate)
    seen: set[int] = set()
    out = []
    for i, t in enumerate(_arrivals(rng, rate, n)):
        g = rng.randrange(p.groups)
        prompt = systems[g] + _ids(rng, rng.randint(p.question_min, p.question_max), p.vocab)
        most = (len(prompt) - 1) // p.page_size * p.page_size
        cached = min(len(systems[g]) // p.page_size * p.page_size, most) if g in seen else 0
        seen.add(g)
        out.append(Session(f"s{seed}-{i}", t, [prompt], group=g, oracle_cached=[cached]))
    return out


def uniform(p: Params, rate: float, seed: int) -> list[Session]:
    rng = random.Random(seed)
    n = level_requests(p, rate)
    return [Session(f"u{seed}-{i}", t, [_ids(rng, rng.randint(p.prefix_min, p.prefix_max)
                                             + rng.randint(p.question_min, p.question_max),
                                             p.vocab)], oracle_cached=[0])
            for i, t in enumerate(_arrivals(rng, rate, n))]


def multiturn(p: Params, rate: float, seed: int) -> list[Session]:
    """Sessions start at rate / (mean turns) per second, so turns are offered at about `rate`."""
    rng = random.Random(seed)
    answer_rng = random.Random(seed + 1_000_003)  # (the other draws as without answers)
    mean_turns = (p.turns_min + p.turns_max) / 2
    n_sessions = max(1, round(level_requests(p, rate) / mean_turns))
    out = []
    for i, t in enumerate(_arrivals(rng, rate / mean_turns, n_sessions)):
        k = rng.randint(p.turns_min, p.turns_max)
        first = _ids(rng, rng.randint(p.context_min, p.context_max)
                     + rng.randint(p.user_min, p.user_max), p.vocab)
        later = [_ids(rng, rng.randint(p.user_min, p.user_max), p.vocab) for _ in range(k - 1)]
        think = [rng.expovariate(1 / p.think_s) if p.think_s > 0 else 0.0 for _ in range(k - 1)]
        answers = [_ids(answer_rng, p.answer_tokens, p.vocab) for _ in range(k - 1)]
        out.append(Session(f"m{seed}-{i}", t, [first, *later], think, answers=answers))
    return out


def multiturn_own(p: Params, rate: float, seed: int) -> list[Session]:
    """`multiturn`, each answer what tandem's mock engine generates for the turn's prompt."""
    from tandem.engines.mock import mock_token

    if not p.mock_vocab:
        raise ValueError("multiturn-own needs mock_vocab (the served model's vocabulary)")
    avoid = frozenset(p.mock_eos)
    sessions = multiturn(p, rate, seed)
    for s in sessions:
        prompt, answers = list(s.turns[0]), []
        for turn in s.turns[1:]:
            answer = [mock_token(prompt, j, p.mock_vocab, avoid) for j in range(p.answer_tokens)]
            answers.append(answer)
            prompt += answer + turn
        s.answers = answers
    return sessions


def make(workload: str, p: Params, rate: float, seed: int) -> list[Session]:
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r} is not one of {WORKLOADS}")
    return {"shared": shared, "multiturn": multiturn, "multiturn-own": multiturn_own,
            "uniform": uniform}[workload](p, rate, seed)


def level_seed(base: int, workload: str, level: int) -> int:
    """The seed of one level of one workload: the same for every arm and run."""
    return base * 1000 + WORKLOADS.index(workload) * 100 + level


def oracle_hit_rate(sessions: list[Session]) -> float:
    """Cached prompt tokens over prompt tokens, had every request of a group gone where the
    group's prefix already was (shared workload; 0 for the others)."""
    prompt = sum(len(s.turns[0]) for s in sessions)
    cached = sum(sum(s.oracle_cached) for s in sessions)
    return cached / prompt if prompt else 0.0
