"""The routing contract: what a policy reads of a worker (`Candidate`), what it answers
(`Placement`), the one `Policy` Protocol every policy implements, least-loaded's order, and the
router's block keys.

Block keys (`chain`, `block_keys`): key i of a token sequence names its first i + 1 full pages.
It is the router's own, computed from token ids alone, on both sides of the router: a request's
prompt (the policies) and a BlockStored event's tokens from its parent's key
(tandem.router.kv_index), both through `block_keys`, one `chain` step per page, so they agree bit
for bit; if they did not, every overlap would be 0 and the `kv` policy would route by load alone
(tests/unit/test_kv_router.py checks it). The hash is BLAKE2b-64 over the parent key (8 bytes,
little endian) and the page's token ids as little-endian signed 64-bit integers: deterministic
across processes, platforms and Python versions (unlike `hash()`), and 64 bits are plenty for a
key whose collision costs a misplaced request, never wrong output (the engines key their own
caches with 128 bits, tandem.engines.prefix). A sequence's first page chains from `ROOT`, or,
for a request with a cache salt, from the salt's own root (`salt_root`), passed as `parent` on
both sides: the prompt's (the policies, from the request's salt) and the events' (a BlockStored
with no parent carries its sequence's `cache_salt`), so requests with different salts never
share a key and the router never predicts a hit across salts.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol

from tandem.runtime.wire import Load

__all__ = ["ROOT", "Candidate", "Placement", "Policy", "block_keys", "chain", "host_credit",
           "least_loaded", "load_key", "salt_root"]

ROOT = 0  # the parent key of a sequence's first page
_KEY_BYTES = 8


def chain(parent: int, tokens: Sequence[int]) -> int:
    """The key of a page whose tokens are `tokens` and whose parent page's key is `parent`."""
    digest = blake2b(parent.to_bytes(_KEY_BYTES, "little") + array("q", tokens).tobytes(),
                     digest_size=_KEY_BYTES).digest()
    return int.from_bytes(digest, "little")


def salt_root(salt: str | None) -> int:
    """The parent key of the first page of a sequence salted with `salt` (ROOT: none)."""
    if not salt:
        return ROOT
    digest = blake2b(b"tandem cache salt\0" + salt.encode("utf-8", "surrogatepass"),
                     digest_size=_KEY_BYTES).digest()
    return int.from_bytes(digest, "little")


def block_keys(tokens: Sequence[int], page_size: int, parent: int = ROOT) -> list[int]:
    """The keys of the full pages of `tokens` (a partial last page has none), the first chained
    from `parent`: `chain` page after page (the ids packed once, each digest fed on as bytes)."""
    n_full = len(tokens) // page_size
    if n_full == 0:
        return []
    ids = array("q", tokens[:n_full * page_size]).tobytes()
    step = 8 * page_size
    digest = parent.to_bytes(_KEY_BYTES, "little")
    from_bytes = int.from_bytes
    out: list[int] = []
    for at in range(0, len(ids), step):
        digest = blake2b(digest + ids[at:at + step], digest_size=_KEY_BYTES).digest()
        out.append(from_bytes(digest, "little"))
    return out


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


def host_credit(load: Load, page_size: int) -> float:
    """What a block a worker holds only in a lower tier (its host memory) is worth against one on
    its device, from the worker's own measurements (its Load): the share of the block's compute
    that loading it saves, 1 - load time / recompute time, in [0, 1]. A worker that measured no
    compute yet (or publishes lower-tier events without measuring: another engine's offload) gets
    1 when it measured no load time either (a load that costs nothing measurable), else 0."""
    recompute = load.prefill_s_per_token * page_size
    if recompute <= 0.0:
        return 1.0 if load.host_load_s_per_page <= 0.0 else 0.0
    return max(0.0, 1.0 - load.host_load_s_per_page / recompute)


@dataclass(frozen=True, slots=True)
class Placement:
    """A policy's answer: the worker, and the prompt tokens it predicts that worker has cached
    (the pool charges the worker's pending prefill only the rest, and decides PD local prefill by
    it; 0 from a policy that does not predict)."""

    worker: Candidate
    cached_tokens: int = 0


class Policy(Protocol):
    """Which of the candidates of one role (all under their limits, in the pool's stable order)
    serves it. `session`: the request's conversation key ("" for none); `salt`: its cache salt
    ("" for none: a policy that keys prefixes roots them at `salt_root(salt)`). `served` is told the
    placement the pool made; `forget` that a worker left.

    `predicts`: whether `choose`'s `Placement.cached_tokens` predicts what the chosen worker holds.
    A policy that predicts is offered, besides the workers with free pages for the whole prompt,
    those short of them, and keeps its choice of one when the rest of the prompt fits there; one
    that does not is offered only the first (tandem.router.pool, `_choose`)."""

    predicts: bool

    def choose(self, role: str, candidates: Sequence[Candidate], prompt_ids: list[int],
               page_size: int, session: str = "", salt: str = "") -> Placement: ...

    def served(self, role: str, placed: Placement, prompt_ids: list[int], page_size: int,
               session: str = "", salt: str = "") -> None: ...

    def forget(self, address: str) -> None: ...


def load_key(c: Candidate) -> tuple[int, int, int]:
    """Least-loaded's order: fewest requests in flight, then fewest tokens to prefill and held by
    running requests (their KV footprint), then most free pages."""
    return (c.num_in_flight, c.pending_prefill_tokens + c.active_decode_tokens,
            -c.load.pages_free)


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=load_key)
