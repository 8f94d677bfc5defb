"""The soak's request mix: a fixed pool of request bodies drawn from a seed (chat and completions,
streamed and not, n > 1, logprobs / top_logprobs, stop strings, greedy or seeded sampling, a
tandem `stream_interval`, and streams the client leaves on purpose), and how an answer is judged
against the fault-free answer to the same body.

A stop string that should end a choice is taken from that body's own fault-free text (a pilot run
without it), so it is hit; some bodies carry a stop string that never matches. Each client slot
draws its next body from its own seeded generator, so the sequence of requests is the same in
every run of the same seed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgspec

WORDS = ("sea ship wind salt harbour tide anchor gull island storm lighthouse rope sail wave "
         "north river stone bread lantern map coast fog bell dawn").split()
NEVER = "\u00a7never\u00a7"  # a stop string no answer of the mock contains


@dataclass
class Body:
    """One request of the pool; `req` is the JSON body (the stop strings filled in by `finish`)."""

    id: int
    api: str  # "chat" | "completions"
    stream: bool
    req: dict
    stop: str = ""  # "", "hit" (taken from the pilot text) or "never"
    disconnect_after: int = 0  # > 0: the client closes after this many SSE events
    kinds: list[str] = field(default_factory=list)
    encoded: bytes = b""

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def encode(self) -> bytes:
        self.encoded = msgspec.json.encode(self.req)
        return self.encoded


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))


def make_pool(size: int, seed: int, model: str) -> list[Body]:
    """`size` bodies drawn from `seed`. Call `pilot_bodies`/`finish` before use (stop strings)."""
    rng = random.Random(seed)
    pool = []
    for i in range(size):
        api = "chat" if rng.random() < 0.5 else "completions"
        disconnect = rng.random() < 0.12
        stream = disconnect or rng.random() < 0.6
        req: dict[str, Any] = {"model": model}
        if api == "chat":
            msgs = [{"role": "user", "content": _prompt(rng)}]
            if rng.random() < 0.3:
                msgs.insert(0, {"role": "system", "content": _prompt(rng)})
            req["messages"] = msgs
        else:
            req["prompt"] = _prompt(rng)
        kinds = [api, "stream" if stream else "non-stream"]
        req["max_tokens"] = rng.randint(40, 64) if disconnect else rng.randint(6, 40)
        if rng.random() < 0.5:
            req["temperature"] = 0
            kinds.append("greedy")
        else:
            req.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 31))
            kinds.append("seeded")
        if not disconnect and rng.random() < 0.3:
            req["n"] = rng.randint(2, 3)
            kinds.append("n>1")
        if rng.random() < 0.35:
            top = rng.choice((0, 1, 3))
            if api == "chat":
                req.update(logprobs=True, top_logprobs=top)
            else:
                req["logprobs"] = top
            kinds.append("logprobs")
        stop = ""
        if not disconnect and rng.random() < 0.3:
            stop = "hit" if rng.random() < 0.7 else "never"
            kinds.append("stop")
        if stream:
            req["stream"] = True
            req["stream_options"] = {"include_usage": True}
            if rng.random() < 0.25:
                req["stream_interval"] = 3
        b = Body(i, api, stream, req, stop, rng.randint(2, 5) if disconnect else 0, kinds)
        if disconnect:
            b.kinds.append("disconnect")
        pool.append(b)
    return pool


def pilot_bodies(pool: list[Body]) -> list[Body]:
    """For each body whose stop string is to be hit: the same request unstreamed, n = 1, no stop
    and no logprobs, whose text the stop string is taken from (`finish`)."""
    out = []
    for b in pool:
        if b.stop == "hit":
            req = {k: v for k, v in b.req.items()
                   if k not in ("stream", "stream_options", "stream_interval", "n", "logprobs",
                                "top_logprobs")}
            out.append(Body(b.id, b.api, False, req))
    return out


def finish(pool: list[Body], pilot_texts: dict[int, str], seed: int) -> None:
    """Fill in the stop strings (a piece of the pilot's text after its start) and encode."""
    rng = random.Random(seed ^ 0x5700)
    for b in pool:
        if b.stop == "hit":
            b.req["stop"] = _stop_from(pilot_texts[b.id], rng)
        elif b.stop == "never":
            b.req["stop"] = [NEVER]
        b.encode()


def _stop_from(text: str, rng: random.Random) -> list[str]:
    """A 2-4 character piece of `text` from its second third on, with no replacement character
    (the detokenizer's stand-in for a broken UTF-8 sequence)."""
    n = len(text)
    for _ in range(50):
        at = rng.randrange(max(1, n // 3), max(2, n - 1)) if n > 3 else 0
        piece = text[at:at + rng.randint(2, 4)]
        if piece and "\ufffd" not in piece and piece.strip():
            return [piece, NEVER]
    return [NEVER]


def same(a: Any, b: Any, tol: float = 0.0) -> bool:
    """Equal; with `tol`, a float (a logprob value: nothing else in a canonical answer is one)
    may differ by at most `tol`."""
    if not tol:
        return bool(a == b)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, tol) for x, y in zip(a, b))
    return bool(a == b)


def judge(body: Body, got: Any, want: Any, tol: float = 0.0) -> str:
    """Why `got` (a canonical answer) differs from `want` (the fault-free one): "" when equal
    (logprob values within `tol`). A stream the client left on purpose must be a prefix of the
    fault-free answer."""
    if not body.disconnect_after or got is None:
        return "" if same(got, want, tol) else _diff(got, want, tol)
    for g, w in zip(got["choices"], want["choices"]):
        if not w[0].startswith(g[0]):
            return f"partial stream's text is not a prefix: {g[0][:80]!r} vs {w[0][:80]!r}"
        if not same(w[2][:len(g[2])], g[2], tol):
            return f"partial stream's logprobs are not a prefix: {g[2]!r:.100} vs {w[2]!r:.100}"
    return ""


def _diff(got: Any, want: Any, tol: float) -> str:
    if got is None or want is None:
        return f"answer {got!r:.80} vs {want!r:.80}"
    if got["usage"] != want["usage"]:
        return f"usage {got['usage']} vs {want['usage']}"
    if len(got["choices"]) != len(want["choices"]):
        return f"{len(got['choices'])} choices vs {len(want['choices'])}"
    for i, (g, w) in enumerate(zip(got["choices"], want["choices"])):
        for what, a, b in (("text", g[0], w[0]), ("finish_reason", g[1], w[1]),
                           ("logprobs", g[2], w[2])):
            if not same(a, b, tol):
                return f"choice {i} {what}: {_first_diff(a, b)}"
    return "differs"


def _first_diff(a: Any, b: Any) -> str:
    """Where two values part: the first entry of a list that differs, or both values."""
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"entry {i}: {x!r:.150} vs {y!r:.150}"
        return f"{len(a)} entries vs {len(b)}"
    return f"{str(a)[:100]!r} vs {str(b)[:100]!r}"
