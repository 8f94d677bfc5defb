"""Routing policies: which of the workers of one role that can take a request gets it.

The pool filters first (usable, right role, under its limits) and asks the policy to choose among
what is left, in the pool's stable worker order; `served` tells the policy what was chosen.

- `round-robin`: the next worker after the last one chosen for that role (workers added later
  join the end of the order).
- `least-loaded` (default): fewest requests in flight, then fewest prompt/decode tokens, then the
  most free pages in the last report.
- `prefix`: the worker that most recently served the longest shared prefix of the prompt, found by
  chained hashes of its page-sized blocks in a bounded LRU map hash -> worker (one per role); least
  loaded when no block matches or the worker that has it is full. It knows nothing of what the
  workers evicted, nor of their load while it steers.
- `kv` (tandem.router.kv_policy): what each worker holds (its KV events) and its load, in one cost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from tandem.config import RouterConfig
from tandem.runtime.wire import Load


class Candidate(Protocol):
    """What a policy reads of a worker (tandem.router.link.WorkerLink)."""

    address: str
    load: Load

    @property
    def pending_prefill_tokens(self) -> int: ...

    @property
    def active_decode_tokens(self) -> int: ...

    @property
    def num_in_flight(self) -> int: ...


class Policy(Protocol):
    """`session`: the request's conversation key ("" for none): only `kv` reads it."""

    def choose(self, role: str, candidates: Sequence[Candidate], prompt_ids: list[int],
               page_size: int, session: str = "") -> Candidate: ...

    def served(self, role: str, chosen: Candidate, prompt_ids: list[int], page_size: int,
               session: str = "") -> None: ...


def load_key(c: Candidate) -> tuple[int, int, int]:
    """Least-loaded's order: fewest requests in flight, then fewest tokens to prefill and held by
    running requests (their KV footprint), then most free pages."""
    return (c.num_in_flight, c.pending_prefill_tokens + c.active_decode_tokens,
            -c.load.pages_free)


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=load_key)


class LeastLoaded:
    def choose(self, role: str, candidates: Sequence[Candidate], prompt_ids: list[int],
               page_size: int, session: str = "") -> Candidate:
        return least_loaded(candidates)

    def served(self, role: str, chosen: Candidate, prompt_ids: list[int], page_size: int,
               session: str = "") -> None:
        pass


class RoundRobin:
    def __init__(self, order: Sequence[str]) -> None:
        self._rank = {a: i for i, a in enumerate(order)}
        self._last: dict[str, int] = {}  # role -> rank of the worker chosen last

    def _ranked(self, address: str) -> int:
        """A worker's place in the order; one added later goes last."""
        return self._rank.setdefault(address, len(self._rank))

    def choose(self, role: str, candidates: Sequence[Candidate], prompt_ids: list[int],
               page_size: int, session: str = "") -> Candidate:
        for c in candidates:
            self._ranked(c.address)
        last = self._last.get(role, -1)
        n = len(self._rank)
        return min(candidates, key=lambda c: (self._rank[c.address] - last - 1) % n)

    def served(self, role: str, chosen: Candidate, prompt_ids: list[int], page_size: int,
               session: str = "") -> None:
        self._last[role] = self._ranked(chosen.address)


def block_hashes(prompt_ids: list[int], page_size: int) -> list[int]:
    """Chained hashes of the prompt's full page-sized blocks: hash i covers tokens [0, (i+1)*size),
    so equal hashes mean an equal prefix (int tuples hash the same in every process)."""
    out: list[int] = []
    h = 0
    for start in range(0, len(prompt_ids) - page_size + 1, page_size):
        h = hash((h, *prompt_ids[start:start + page_size]))
        out.append(h)
    return out


class PrefixAffinity:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._owner: dict[str, OrderedDict[int, str]] = {}  # role -> block hash -> worker address
        self.hits = 0  # requests sent to the worker holding their longest known prefix

    def choose(self, role: str, candidates: Sequence[Candidate], prompt_ids: list[int],
               page_size: int, session: str = "") -> Candidate:
        owners = self._owner.get(role)
        if owners:
            by_address = {c.address: c for c in candidates}
            for h in reversed(block_hashes(prompt_ids, page_size)):
                address = owners.get(h)
                if address is None:
                    continue
                c = by_address.get(address)
                if c is not None:
                    self.hits += 1
                    return c
                break  # the longest match is on a full worker: balance instead
        return least_loaded(candidates)

    def served(self, role: str, chosen: Candidate, prompt_ids: list[int], page_size: int,
               session: str = "") -> None:
        owners = self._owner.setdefault(role, OrderedDict())
        for h in block_hashes(prompt_ids, page_size):
            owners[h] = chosen.address
            owners.move_to_end(h)
        while len(owners) > self.max_blocks:
            owners.popitem(last=False)


def make_policy(name: str, order: Sequence[str], router: RouterConfig) -> Policy:
    if name in ("kv", "auto"):
        from tandem.router.kv_policy import KvAware

        return KvAware(auto=name == "auto", prefill_weight=router.kv_prefill_weight,
                       queue_weight=router.kv_queue_weight,
                       decode_weight=router.kv_decode_weight,
                       predict_ttl_s=router.kv_predict_ttl_s, approx_ttl_s=router.kv_approx_ttl_s,
                       session_ttl_s=router.session_ttl_s)
    if name == "round-robin":
        return RoundRobin(order)
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix":
        return PrefixAffinity(router.prefix_cache_blocks)
    raise ValueError(f"unknown router policy {name!r}")
