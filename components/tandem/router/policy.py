"""Routing policies: which of the workers of one role that can take a request gets it.

The pool filters first (usable, right role, under its limits) and asks the policy to choose among
what is left, in the pool's stable worker order; `served` tells the policy what was chosen. Every
policy implements one Protocol (tandem.router.blocks.Policy) and `make_policy` builds each from
RouterConfig, the one place its values live.

- `round-robin`: the next worker after the last one chosen for that role (workers added later
  join the end of the order).
- `least-loaded`: fewest requests in flight, then fewest prompt/decode tokens, then the most free
  pages in the last report (tandem.router.blocks.load_key).
- `prefix`: the worker that most recently served the longest shared prefix of the prompt, found by
  its block keys (tandem.router.blocks) in a bounded LRU map key -> worker (one per role); least
  loaded when no block matches or the worker that has it is full. It knows nothing of what the
  workers evicted, nor of their load while it steers.
- `kv` (tandem.router.kv_policy): what each worker holds (its KV events) and its load, in one cost.
- `auto` (the default): `kv` among workers that publish KV events, least-loaded among workers that
  do not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tandem.config import RouterConfig
from tandem.router.blocks import Candidate, Placement, Policy, block_keys, least_loaded
from tandem.router.kv_policy import KvAware

__all__ = ["LeastLoaded", "PrefixAffinity", "RoundRobin", "make_policy"]


class LeastLoaded:
    predicts = False

    def choose(self, role: str, candidates: Sequence[Candidate], prompt_ids: list[int],
               page_size: int, session: str = "", salt: str = "") -> Placement:
        return Placement(least_loaded(candidates))

    def served(self, role: str, placed: Placement, prompt_ids: list[int], page_size: int,
               session: str = "", salt: str = "") -> None:
        pass

    def forget(self, address: str) -> None:
        pass


class RoundRobin:
    predicts = False

    def __init__(self, order: Sequence[str]) -> None:
        self._rank = {a: i for i, a in enumerate(order)}
        self._last: dict[str, int] = {}  # role -> rank of the worker chosen last

    def _ranked(self, address: str) -> int:
        """A worker's place in the order; one added later goes last."""
        return self._rank.setdefault(address, len(self._rank))

    def choose(self, role: str, candidates: Sequence[Candidate], prompt_ids: list[int],
               page_size: int, session: str = "", salt: str = "") -> Placement:
        for c in candidates:
            self._ranked(c.address)
        last = self._last.get(role, -1)
        n = len(self._rank)
        return Placement(min(candidates, key=lambda c: (self._rank[c.address] - last - 1) % n))

    def served(self, role: str, placed: Placement, prompt_ids: list[int], page_size: int,
               session: str = "", salt: str = "") -> None:
        self._last[role] = self._ranked(placed.worker.address)

    def forget(self, address: str) -> None:
        pass  # (its rank stays: a worker that comes back keeps its place in the order)


class PrefixAffinity:
    predicts = False

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._owner: dict[str, OrderedDict[int, str]] = {}  # role -> block key -> worker address
        self.hits = 0  # requests sent to the worker holding their longest known prefix

    def choose(self, role: str, candidates: Sequence[Candidate], prompt_ids: list[int],
               page_size: int, session: str = "", salt: str = "") -> Placement:
        owners = self._owner.get(role)
        if owners:
            by_address = {c.address: c for c in candidates}
            for key in reversed(block_keys(prompt_ids, page_size)):
                address = owners.get(key)
                if address is None:
                    continue
                c = by_address.get(address)
                if c is not None:
                    self.hits += 1
                    return Placement(c)
                break  # the longest match is on a full worker: balance instead
        return Placement(least_loaded(candidates))

    def served(self, role: str, placed: Placement, prompt_ids: list[int], page_size: int,
               session: str = "", salt: str = "") -> None:
        owners = self._owner.setdefault(role, OrderedDict())
        address = placed.worker.address
        for key in block_keys(prompt_ids, page_size):
            owners[key] = address
            owners.move_to_end(key)
        while len(owners) > self.max_blocks:
            owners.popitem(last=False)

    def forget(self, address: str) -> None:
        pass  # (its blocks age out of the LRU map; a match on a worker that left is no candidate)


def make_policy(router: RouterConfig, order: Sequence[str] = ()) -> Policy:
    """The policy `router.policy` names, with its values from `router` (`order`: the workers
    known at the start, round-robin's order)."""
    name = router.policy
    if name in ("kv", "auto"):
        return KvAware(router, auto=name == "auto")
    if name == "round-robin":
        return RoundRobin(order)
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix":
        return PrefixAffinity(router.prefix_cache_blocks)
    raise ValueError(f"unknown router policy {name!r}")
