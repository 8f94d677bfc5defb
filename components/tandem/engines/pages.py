"""PagePool: which KV pages are free, held by running requests, reserved for an incoming transfer,
or cached (full pages kept for their prefix, tandem.engines.prefix). Plain Python, no tensors, so
it is unit-testable and shared by every engine.

Invariant, checkable at any moment (`check()`): free + held + reserved + cached-unreferenced ==
total, where a page held by several running requests (a shared prefix) counts once, and its
reference count is the number of requests holding it. When the system is idle every page is free
or cached.

Promises: a request is admitted with pages for its prompt and a *promise* of the pages its
completion may reach (`take`/`reserve` with `later`); each becomes a page when a decode step first
writes into it (`grow`). Promised pages are counted as taken (`num_available`, `can_take`), so a
grow always succeeds, but no cached page is evicted for a page nobody has written yet: the prefix
cache keeps them until then (SGLang and vLLM allocate decode pages as they are written too).
Invariant: promised <= free + cached-unreferenced.

The prefix cache (`caching`): a full page whose K/V is computed can be `publish`ed under its key;
a new request `match`es the keys of its prompt's leading full pages and `take`s the cached ones
(shared, read only: nothing writes into a full page again) before new ones. A cached page no
request holds is evictable: `allocate` and `reserve` take free pages first, then evict cached ones:
pages no request has taken from the cache yet before pages one has (`_reused`), and within each,
least recently released first. So one client's unique prompts, which nothing reuses, are evicted
before a prefix others keep coming back to (a shared system prompt), however many there are. A
request's pages are released last page first, so a prefix's deeper pages are evicted before the
pages they extend. Each store and eviction is recorded as a KV event (tandem.runtime.kv_events)
while `recording`, and the engine takes them after each step (`take_events`); `admitted` counts
what admission looked up and found cached (`queries`, `hits`).

The host tier (`host`, tandem.engines.host_tier): with one, an evicted cached page is copied
into a host slot instead of being dropped (BlockRemoved on the device, BlockStored in the host
medium), and `match` finds the host's pages too, as markers (`-1 - slot`) after or between the
device's: `take` and `reserve` load each into a fresh device page (counted with the new pages, so
a hit costs the same pages as a miss) and cache it on the device again (the reverse events). A key
is cached in one tier at most; `check` covers both.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import islice

from tandem.engines.host_tier import DEVICE, HostTier, Meta, TierMoves
from tandem.engines.prefix import event_hash
from tandem.runtime.errors import PagePoolError
from tandem.runtime.kv_events import BlockRemoved, BlockStored, KvEvent

__all__ = ["PagePool", "PagePoolError", "check_accounting", "page_bytes"]


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
               elem_bytes: int) -> int:
    """Bytes of one page in the page-major KV layout (all layers, K and V): the one formula every
    engine and mover uses."""
    return num_layers * 2 * page_size * num_kv_heads * head_dim * elem_bytes


class PagePool(TierMoves):
    def __init__(self, num_pages: int, page_size: int, caching: bool = False,
                 host: HostTier | None = None) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.caching = caching
        # Pop from the end; lowest ids first so contiguous runs are likely (one NIXL descriptor).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._held: dict[str, list[int]] = {}  # owner -> its pages in order (shared ones first)
        self._reserved: dict[str, list[int]] = {}
        self._refs = [0] * num_pages  # owners holding each page
        self._key: dict[int, int] = {}  # cached page -> its key
        self._page: dict[int, int] = {}  # key -> cached page
        self._lru: dict[int, None] = {}  # cached pages nobody holds, least recently released first
        self._reused: set[int] = set()  # cached pages a request has taken as a hit (evicted last)
        self._promised: dict[str, int] = {}  # owner -> pages it may still grow by
        self.num_promised = 0  # their sum
        self._events: list[KvEvent] = []  # stores and evictions since the engine last took them
        self.recording = True  # whether to record them (the engine: when someone takes them)
        self.queries = self.hits = 0  # prompt tokens looked up / found cached, at admission
        self.host_hits = 0  # of `hits`, loaded from the host tier
        self.host = host if caching else None  # the host tier (None: evicted pages are dropped)
        self.medium = DEVICE if self.host is not None else None  # (the events' medium)
        self._meta: dict[int, Meta] = {}  # with a host tier: each device-cached key's event data

    # --- counts ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Cached pages nobody holds (evictable)."""
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Pages a new request can get: free, or cached and evictable, less those promised."""
        return len(self._free) + len(self._lru) - self.num_promised

    @property
    def num_reserved(self) -> int:
        return sum(len(p) for p in self._reserved.values())

    @property
    def num_held(self) -> int:
        """Pages running requests hold, a shared page once."""
        return self.num_pages - len(self._free) - len(self._lru) - self.num_reserved

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def idle(self) -> bool:
        """Nobody holds or reserved a page: each is free or cached."""
        return not self._held and not self._reserved

    # --- the prefix cache -----------------------------------------------------------------------
    def take_events(self) -> list[KvEvent]:
        """The KV events recorded since the last call, oldest first; the pool keeps none."""
        events, self._events = self._events, []
        return events

    def admitted(self, num_prompt: int, hits: Sequence[int]) -> None:
        """A request of `num_prompt` prompt tokens was admitted with the cached pages `hits`
        (as `match` gave them: a host tier's are counted in `host_hits` too)."""
        self.queries += num_prompt
        self.hits += len(hits) * self.page_size
        if self.host is not None:
            self.host_hits += sum(1 for p in hits if p < 0) * self.page_size

    def match(self, keys: Sequence[int], limit: int) -> list[int]:
        """The cached pages of the leading `keys` (at most `limit`), in order; a page in the host
        tier as `-1 - its slot`; changes nothing."""
        pages: list[int] = []
        get, host = self._page.get, self.host
        for key in keys[:limit]:
            page = get(key)
            if page is None:
                slot = None if host is None else host.slot(key)
                if slot is None:
                    break
                page = -1 - slot
            pages.append(page)
        return pages

    def can_take(self, hits: Sequence[int], num_new: int) -> bool:
        """Whether `take(owner, hits, num_new)` would succeed."""
        return self.spare(hits, num_new) >= 0

    def spare(self, hits: Sequence[int], num_new: int) -> int:
        """The pages a new request could still get after `take(owner, hits, num_new)`; negative:
        that many too few for it (taking an unheld cached page makes it unavailable for the new
        ones)."""
        lru = self._lru
        pinned = sum(1 for p in hits if p in lru) if lru else 0
        if self.host is not None:  # (a host page needs a device page to load into)
            num_new += sum(1 for p in hits if p < 0)
        return len(self._free) + len(lru) - pinned - self.num_promised - num_new

    def publish(self, pages: Sequence[int], keys: Sequence[int], start: int, end: int,
                tokens: Callable[[int, int], list[int]], salt: str = "") -> None:
        """Pages `pages[start:end]` are full and computed: cache them under `keys[start:end]`. A
        key already cached (another request computed the same prefix) keeps its page; ours stays
        private. `tokens(a, b)` gives the sequence's ids [a, b) (for the event); `salt`, its
        cache salt (its first page's event carries it)."""
        page_of, key_of, host = self._page, self._key, self.host
        run: list[int] = []
        first = start
        for i in range(start, end):
            page, key = pages[i], keys[i]
            if key in page_of or page in key_of:
                self._stored(run, keys, first, tokens, salt)
                run, first = [], i + 1
                continue
            page_of[key] = page
            key_of[page] = key
            run.append(key)
            if host is not None:
                self._hosted(i, keys, tokens, salt)
        self._stored(run, keys, first, tokens, salt)

    def _stored(self, run: list[int], keys: Sequence[int], first: int,
                tokens: Callable[[int, int], list[int]], salt: str) -> None:
        if not run or not self.recording:
            return
        size = self.page_size
        self._events.append(BlockStored(
            block_hashes=[event_hash(k) for k in run],
            parent_block_hash=event_hash(keys[first - 1]) if first else None,
            token_ids=tokens(first * size, (first + len(run)) * size), block_size=size,
            medium=self.medium, cache_salt=salt or None if not first else None))

    def _evict(self, n: int) -> None:
        """Make `n` more pages free by evicting cached ones: never reused first, then reused;
        least recently released first within each."""
        lru, gone, reused = self._lru, [], self._reused
        victims = list(islice((p for p in lru if p not in reused) if reused else lru, n))
        if len(victims) < n:  # (the reused ones too)
            chosen = set(victims)
            victims += islice((p for p in lru if p not in chosen), n - len(victims))
        moves: list[tuple[int, int, Meta]] = []
        for page in victims:
            del lru[page]
            reused.discard(page)
            key = self._key.pop(page)
            del self._page[key]
            gone.append(event_hash(key))
            self._free.append(page)
            if self.host is not None:
                moves.append((page, key, self._meta.pop(key)))
        if len(gone) < n:
            raise PagePoolError(f"need {n} pages more, {len(gone)} evictable")
        if moves:  # (their host stores first: a parent stays known while its child moves)
            self._offload(moves)
        if self.recording:
            self._events.append(BlockRemoved(block_hashes=gone, medium=self.medium))

    def _new(self, n: int) -> list[int]:
        short = n - len(self._free)
        if short > 0:
            self._evict(short)
        free = self._free
        return [free.pop() for _ in range(n)]

    # --- verbs, in pairs ------------------------------------------------------------------------
    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_available

    def take(self, owner: str, hits: Sequence[int], num_new: int, later: int = 0) -> list[int]:
        """Give `owner` the cached pages `hits` (shared) and `num_new` new ones, and promise it
        `later` more (`grow`); returns the pages it has now."""
        if owner in self._held or owner in self._reserved:
            raise PagePoolError(f"{owner} already has pages")
        if not self.can_take(hits, num_new + later):
            raise PagePoolError(f"need {num_new + later} pages, {self.num_available} available")
        hits, new = self._with_hits(hits, num_new)
        for p in new:
            self._refs[p] = 1
        pages = self._held[owner] = [*hits, *new]
        self._promise(owner, later)
        return list(pages)  # (the caller's own list: `grow` appends to the pool's)

    def _promise(self, owner: str, n: int) -> None:
        if n > 0:
            self._promised[owner] = n
            self.num_promised += n

    def grow(self, owner: str) -> int:
        """One page of `owner`'s promise becomes its own (appended to what it holds): the page
        its next token is written into. Evicts a cached page if none is free; returns the page."""
        left = self._promised.get(owner, 0)
        if left <= 0 or owner not in self._held or owner in self._reserved:
            raise PagePoolError(f"{owner} has no page promised (or its transfer is not in)")
        if left == 1:
            del self._promised[owner]
        else:
            self._promised[owner] = left - 1
        self.num_promised -= 1
        page = self._new(1)[0]
        self._refs[page] = 1
        self._held[owner].append(page)
        return page

    def allocate(self, owner: str, num_pages: int) -> list[int]:
        """Give `owner` `num_pages` more pages (appended to what it holds); returns the new ones."""
        if num_pages > self.num_available:
            raise PagePoolError(f"need {num_pages} pages, {self.num_available} available")
        if owner in self._reserved:
            raise PagePoolError(f"{owner} has reserved pages; commit them first")
        new = self._new(num_pages)
        for p in new:
            self._refs[p] = 1
        self._held.setdefault(owner, []).extend(new)
        return new

    def reserve(self, owner: str, num_pages: int, hits: Sequence[int] = (),
                later: int = 0) -> list[int]:
        """Set pages aside for a transfer into them (decode side of PD), after the cached pages
        `hits` it shares (which nothing writes into; a host tier's are loaded first), and
        promise `later` more for its completion (`grow`, once committed); returns the reserved
        ones (`pages_of`: all its pages)."""
        if owner in self._reserved or owner in self._held:
            raise PagePoolError(f"{owner} already has pages")
        if not self.can_take(hits, num_pages + later):
            raise PagePoolError(f"need {num_pages + later} pages, {self.num_available} available")
        hits, pages = self._with_hits(hits, num_pages)
        if hits:
            self._held[owner] = list(hits)
        self._reserved[owner] = pages
        self._promise(owner, later)
        return pages

    def _with_hits(self, hits: Sequence[int], n: int) -> tuple[Sequence[int], list[int]]:
        """Share the cached pages `hits` (a host tier's loaded into fresh pages first) and take
        `n` new ones: (the hits as device pages, the new pages)."""
        pinned = self._pin(hits)
        if not pinned:
            self._share(hits)
            return hits, self._new(n)
        self._share([p for p in hits if p >= 0])
        new = self._new(n + len(pinned))
        return self._onload(hits, pinned, new), new[len(pinned):]

    def _share(self, hits: Sequence[int]) -> None:
        refs, lru = self._refs, self._lru
        self._reused.update(hits)
        for p in hits:
            if not refs[p]:
                del lru[p]
            refs[p] += 1

    def commit(self, owner: str) -> list[int]:
        """A transfer landed: the reserved pages become held by the running request (after the
        cached ones it shares); returns all its pages."""
        pages = self._reserved.pop(owner)
        for p in pages:
            self._refs[p] = 1
        held = self._held.setdefault(owner, [])
        held.extend(pages)
        return held

    def promised_to(self, owner: str) -> int:
        """Pages `owner` may still grow by."""
        return self._promised.get(owner, 0)

    def pages_of(self, owner: str) -> list[int]:
        return self._held.get(owner, []) + self._reserved.get(owner, [])

    def free(self, owner: str) -> int:
        """Release every page `owner` holds or reserved, last first: a page nobody else holds is
        free again, or evictable if cached; its promise ends. Safe to call twice; returns pages
        released."""
        self.num_promised -= self._promised.pop(owner, 0)
        held = self._held.pop(owner, [])
        reserved = self._reserved.pop(owner, [])
        refs, key_of, lru, free = self._refs, self._key, self._lru, self._free
        for p in reversed(held):
            refs[p] -= 1
            if refs[p] == 0:
                if p in key_of:
                    lru[p] = None
                else:
                    free.append(p)
        free.extend(reversed(reserved))
        return len(held) + len(reserved)

    def owners(self) -> list[str]:
        return list(self._held) + [o for o in self._reserved if o not in self._held]

    def check(self) -> None:
        """Raise PagePoolError unless the invariant holds (`check_accounting`), the cache's maps
        agree with the pages, and every promise can be kept."""
        check_accounting(self.num_pages, self._free, self._held.values(),
                         self._reserved.values(), self._lru, self._refs)
        promised = self._promised.values()
        if sum(promised) != self.num_promised or any(n <= 0 for n in promised) or \
                self.num_promised > len(self._free) + len(self._lru) or \
                any(o not in self._held and o not in self._reserved for o in self._promised):
            raise PagePoolError(f"{self.num_promised} pages promised, "
                                f"{len(self._free) + len(self._lru)} free or evictable")
        if any(p not in self._key for p in self._lru) or \
                any(self._page.get(k) != p for p, k in self._key.items()) or \
                len(self._page) != len(self._key) or any(p in self._key for p in self._free):
            raise PagePoolError("prefix cache maps disagree with the pages")
        if self.host is not None:
            self.host.check(self._page)
            if self._meta.keys() != self._page.keys():
                raise PagePoolError("a device-cached page has no event data (or a gone one has)")


def check_accounting(num_pages: int, free: Collection[int], held: Iterable[list[int]],
                     reserved: Iterable[list[int]], cached: Collection[int],
                     refs: Sequence[int] | None = None) -> None:
    """The invariant: free + held + reserved + cached-unreferenced == `num_pages`, each page in
    exactly one of them, a page held by several owners counted once (and, given `refs`, each
    page's reference count equal to its holders). Raises PagePoolError otherwise."""
    counts: dict[int, int] = {}
    for pages in held:
        for p in pages:
            counts[p] = counts.get(p, 0) + 1
    flat = [p for pages in reserved for p in pages]
    parts = (free, counts, flat, cached)
    seen: set[int] = set()
    for part in parts:
        seen.update(part)
    total = sum(len(part) for part in parts)
    if total != num_pages or len(seen) != num_pages or min(seen, default=0) < 0 or \
            max(seen, default=0) >= num_pages:
        raise PagePoolError(
            f"page accounting broken: free {len(free)} + held {len(counts)} + reserved "
            f"{len(flat)} + cached {len(cached)} = {total} ({len(seen)} distinct), total "
            f"{num_pages}")
    if refs is not None:
        bad = [p for p in range(num_pages) if refs[p] != counts.get(p, 0)]
        if bad:
            raise PagePoolError(f"page {bad[0]}: {refs[bad[0]]} references counted, "
                                f"{counts.get(bad[0], 0)} holders")
