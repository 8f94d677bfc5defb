"""The host tier of the prefix cache (`--host-kv-pages`): cached pages evicted from the device
pool (tandem.engines.pages) are copied into a pool of host slots instead of being dropped, and a
later prompt that starts the same way copies them back instead of computing them again. Plain
Python, no tensors: the bytes move through a `Copier` the engine gives (the reference engine: real
copies between its KV tensor and a host tensor; the mock: a modelled bandwidth, as Dynamo's mocker
does).

A page's key is in at most one tier: on the device (the pool's maps) or here (`slots`), never
both. What the tier holds is evictable at any time and nobody holds it: a hit loads the page into
a fresh device page and frees its slot (the device copy is then the cached one). Eviction here is
least recently stored first (a slot is stored once and leaves on a hit, so that is LRU), and an
entry evicted here is gone.

Each entry keeps what its KV events need (its parent's key, its token ids, the sequence's salt),
so a move between tiers is a BlockRemoved in one medium and a BlockStored in the other, with the
tokens a router recomputes its keys from.

Costs, measured by the engine and reported in its Load (tandem.runtime.wire), so a router can
weigh a block here against computing it again: `load_s_per_page` (a copy back, per page, a moving
average of what the copier took) and `compute_s_per_token` (what the engine's prefill took per
token, set by the engine).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from tandem.engines.prefix import event_hash
from tandem.runtime.errors import PagePoolError
from tandem.runtime.kv_events import BlockRemoved, BlockStored, KvEvent

__all__ = ["DEVICE", "HOST", "Copier", "HostTier", "Meta", "NoCopier", "TierMoves"]

DEVICE = "GPU"  # the medium of the device pool's blocks in KV events (vLLM's name for it)
HOST = "CPU"  # the medium of the host tier's blocks (vLLM's name for its CPU offload tier)
EWMA = 0.2  # weight of the newest measurement in a moving average


class Meta(NamedTuple):
    """What a cached page's BlockStored says: its parent's key (None: a first page), its
    token ids, and its sequence's cache salt (first pages only)."""

    parent: int | None
    tokens: list[int]
    salt: str


class Copier(Protocol):
    """Moves pages' bytes between the engine's device KV and its host slots."""

    def save(self, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Device pages -> host slots (before the device pages are reused)."""

    def load(self, slots: Sequence[int], pages: Sequence[int]) -> float | None:
        """Host slots -> device pages (before anything reads the device pages); the seconds
        the copy takes if the copier models it (None: the tier measures the call)."""


class NoCopier:
    """No bytes (until the engine's KV memory exists, and in unit tests): moves nothing."""

    def save(self, pages: Sequence[int], slots: Sequence[int]) -> None:
        pass

    def load(self, slots: Sequence[int], pages: Sequence[int]) -> float | None:
        return None


class HostTier:
    def __init__(self, num_slots: int, copier: Copier | None = None) -> None:
        if num_slots <= 0:
            raise ValueError("the host tier needs at least one slot")
        self.num_slots = num_slots
        self.copier: Copier = copier or NoCopier()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.slots: dict[int, tuple[int, Meta]] = {}  # key -> (slot, meta), oldest first
        self._key_at: dict[int, int] = {}  # slot -> the key it holds (stale once it is free)
        self.saved = self.loaded = self.evicted = 0  # pages moved in, back out, dropped here
        self.load_s_per_page = 0.0  # measured (moving average), 0 until the first load
        self.compute_s_per_token = 0.0  # the engine's prefill per token (it sets this)

    def __contains__(self, key: int) -> bool:
        return key in self.slots

    @property
    def num_cached(self) -> int:
        return len(self.slots)

    def slot(self, key: int) -> int | None:
        entry = self.slots.get(key)
        return None if entry is None else entry[0]

    def store(self, moves: Sequence[tuple[int, int, Meta]]
              ) -> tuple[list[tuple[int, Meta]], list[int]]:
        """Copy device pages into slots: `moves` is (device page, key, meta) per page. Returns
        what was stored, in order ((key, meta) each), and the keys evicted to make room (the
        oldest entries: gone from every tier). `moves` come least valuable first (the device's
        eviction order): when more come than there are slots not being loaded, the first are
        dropped, in neither list."""
        slots, free, at = self.slots, self._free, self._key_at
        stored: list[tuple[int, Meta]] = []
        evicted: list[int] = []
        pages: list[int] = []
        into: list[int] = []
        room = len(free) + len(slots)
        if len(moves) > room:  # (the last ones are worth most: keep those, copy no others)
            moves = moves[len(moves) - room:]
        for page, key, meta in moves:
            if not free:
                old = next(iter(slots))
                free.append(slots.pop(old)[0])
                evicted.append(old)
            slot = free.pop()
            slots[key] = (slot, meta)
            at[slot] = key
            stored.append((key, meta))
            pages.append(page)
            into.append(slot)
        if pages:
            self.copier.save(pages, into)
            self.saved += len(pages)
        self.evicted += len(evicted)
        return stored, evicted

    def take(self, slots: Sequence[int]) -> list[tuple[int, Meta]]:
        """Remove the entries in these slots (to be loaded), (key, meta) each: the slots stay
        out of use until `load`."""
        out = []
        for slot in slots:
            key = self._key_at[slot]
            out.append((key, self.slots.pop(key)[1]))
        return out

    def load(self, slots: Sequence[int], pages: Sequence[int]) -> None:
        """Copy taken slots into device pages, measuring the copy, and free the slots."""
        t0 = time.perf_counter()
        took = self.copier.load(slots, pages)
        per = ((time.perf_counter() - t0) if took is None else took) / len(slots)
        self.load_s_per_page = per if not self.loaded else \
            (1 - EWMA) * self.load_s_per_page + EWMA * per
        self.loaded += len(slots)
        self._free.extend(slots)

    def drop(self, key: int) -> Meta | None:
        """Forget a key (the device computed its page again); its meta, or None if not here."""
        entry = self.slots.pop(key, None)
        if entry is None:
            return None
        self._free.append(entry[0])
        return entry[1]

    def check(self, device_keys: dict[int, int]) -> None:
        """Raise PagePoolError unless every slot is free or holds one key, and no key is also
        cached on the device (`device_keys`: the pool's key -> page)."""
        used = [slot for slot, _ in self.slots.values()]
        every = [*self._free, *used]
        if len(every) != self.num_slots or len(set(every)) != self.num_slots or \
                min(every, default=0) < 0 or max(every, default=0) >= self.num_slots:
            raise PagePoolError(f"host tier accounting broken: free {len(self._free)} + cached "
                                f"{len(used)} != {self.num_slots} slots (or a slot twice)")
        both = next((k for k in self.slots if k in device_keys), None)
        if both is not None:
            raise PagePoolError("a page key is cached on the device and in the host tier")


class TierMoves:
    """The page pool's moves between its tiers and their KV events (tandem.engines.pages.PagePool,
    which sets everything declared here)."""

    host: HostTier | None
    page_size: int
    recording: bool
    _events: list[KvEvent]
    _meta: dict[int, Meta]
    _page: dict[int, int]
    _key: dict[int, int]
    _reused: set[int]
    _refs: list[int]

    def _hosted(self, i: int, keys: Sequence[int], tokens: Callable[[int, int], list[int]],
                salt: str) -> None:
        """With a host tier: keep page `i`'s event data, and drop a host copy of its key."""
        assert self.host is not None
        key, size = keys[i], self.page_size
        self._meta[key] = Meta(keys[i - 1] if i else None,
                               tokens(i * size, (i + 1) * size), "" if i else salt)
        if key in self.host:
            self.host.drop(key)
            if self.recording:
                self._events.append(BlockRemoved(block_hashes=[event_hash(key)], medium=HOST))

    def _offload(self, moves: list[tuple[int, int, Meta]]) -> None:
        """Evicted device pages go to the host tier (copied before the device reuses them)."""
        assert self.host is not None
        stored, evicted = self.host.store(moves)
        if self.recording:
            self._events += [self._event(key, meta, HOST) for key, meta in stored]
            if evicted:
                self._events.append(BlockRemoved(block_hashes=[event_hash(k) for k in evicted],
                                                 medium=HOST))

    def _event(self, key: int, meta: Meta, medium: str) -> BlockStored:
        return BlockStored(block_hashes=[event_hash(key)],
                           parent_block_hash=None if meta.parent is None else
                           event_hash(meta.parent), token_ids=meta.tokens,
                           block_size=self.page_size, medium=medium,
                           cache_salt=meta.salt or None)

    def _pin(self, hits: Sequence[int]) -> list[tuple[int, int, tuple[int, Meta]]]:
        """Take the host pages among `hits` out of the host tier (nothing evicts them while the
        device makes room for them): (index in hits, slot, (key, meta)) each."""
        if self.host is None:
            return []
        at = [(i, -1 - p) for i, p in enumerate(hits) if p < 0]
        if not at:
            return []
        taken = self.host.take([slot for _, slot in at])
        return [(i, slot, entry) for (i, slot), entry in zip(at, taken)]

    def _onload(self, hits: Sequence[int], pinned: list[tuple[int, int, tuple[int, Meta]]],
                pages: list[int]) -> list[int]:
        """Load the pinned host pages into the first of the new `pages` and cache them on the
        device again; returns `hits` with each marker replaced by its device page."""
        assert self.host is not None
        loaded = pages[:len(pinned)]
        self.host.load([slot for _, slot, _ in pinned], loaded)
        out = list(hits)
        events: list[KvEvent] = [BlockRemoved(
            block_hashes=[event_hash(key) for _, _, (key, _) in pinned], medium=HOST)]
        for (i, _, (key, meta)), page in zip(pinned, loaded):
            out[i] = page
            self._page[key] = page
            self._key[page] = key
            self._meta[key] = meta
            self._reused.add(page)
            self._refs[page] = 1
            events.append(self._event(key, meta, DEVICE))
        if self.recording:
            self._events += events
        return out
