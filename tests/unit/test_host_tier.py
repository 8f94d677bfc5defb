"""The prefix cache's host tier (tandem.engines.host_tier) through the page pool: evicted pages
move to host slots with their bytes and come back on a hit, every move is a KV event in its
medium, a key lives in one tier, and the accounting holds after every operation."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tandem.config import MockTiming
from tandem.engines.host_tier import DEVICE, HOST, HostTier
from tandem.engines.mock import MockEngine
from tandem.engines.pages import PagePool
from tandem.engines.prefix import event_hash, page_keys
from tandem.runtime.errors import PagePoolError
from tandem.runtime.kv_events import BlockRemoved, BlockStored
from tests.conformance.harness import wait_idle
from tests.unit.test_prefix_cache import serve

SIZE = 4


class Bytes:
    """A copier over simulated memory: each device page and host slot holds a value (what a
    step wrote into the page), so a test can see that a loaded page holds what was saved."""

    def __init__(self, num_pages: int, num_slots: int) -> None:
        self.device: list[object] = [None] * num_pages
        self.host: list[object] = [None] * num_slots
        self.saves = self.loads = 0

    def save(self, pages: Sequence[int], slots: Sequence[int]) -> None:
        for p, s in zip(pages, slots):
            self.host[s] = self.device[p]
        self.saves += len(pages)

    def load(self, slots: Sequence[int], pages: Sequence[int]) -> float:
        for s, p in zip(slots, pages):
            self.device[p] = self.host[s]
        self.loads += len(pages)
        return 0.001 * len(pages)


def pool(num_pages: int = 4, num_slots: int = 4) -> tuple[PagePool, Bytes]:
    mem = Bytes(num_pages, num_slots)
    return PagePool(num_pages, SIZE, caching=True, host=HostTier(num_slots, mem)), mem


def compute(p: PagePool, mem: Bytes, owner: str, tokens: list[int]) -> list[int]:
    """Admit `tokens` (its cached pages from either tier), 'compute' the rest (write each page's
    key into it), publish its full pages and release them; returns the hits' pages as matched."""
    keys = page_keys(tokens, SIZE)
    hits = p.match(keys, len(keys))
    pages = p.take(owner, hits, p.pages_for(len(tokens)) - len(hits))
    for i, page in enumerate(pages[:len(keys)]):
        if i < len(hits):
            assert mem.device[page] == keys[i], "a cached page does not hold its own K/V"
        mem.device[page] = keys[i]
    p.admitted(len(tokens), hits)
    p.publish(pages, keys, 0, len(keys), lambda a, b: tokens[a:b])
    p.free(owner)
    p.check()
    return hits


def test_an_evicted_page_moves_to_the_host_and_comes_back_with_its_bytes() -> None:
    p, mem = pool()
    a = list(range(100, 112))  # three full pages
    compute(p, mem, "a", a)
    ka = page_keys(a, SIZE)
    p.take_events()
    compute(p, mem, "b", list(range(200, 216)))  # four pages: all of a's evicted to the host
    events = p.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    moved = [e for e in events if isinstance(e, BlockStored) and e.medium == HOST]
    assert removed[0].medium == DEVICE and set(removed[0].block_hashes) == \
        {event_hash(k) for k in ka}
    assert sorted(h for e in moved for h in e.block_hashes) == sorted(event_hash(k) for k in ka)
    for e in moved:  # each carries what a router keys it by: parent and tokens
        i = [event_hash(k) for k in ka].index(e.block_hashes[0])
        assert e.token_ids == a[i * SIZE:(i + 1) * SIZE]
        assert e.parent_block_hash == (event_hash(ka[i - 1]) if i else None)
    assert p.host is not None and p.host.num_cached == 3 and mem.saves == 3
    hits = compute(p, mem, "a2", a + [1])  # a again: its three pages load from the host
    assert all(h < 0 for h in hits) and len(hits) == 3 and mem.loads == 3
    assert p.hits == p.host_hits == 12 and p.host.load_s_per_page == pytest.approx(0.001)
    events = p.take_events()
    back = [e for e in events if isinstance(e, BlockStored) and e.medium == DEVICE]
    assert {e.block_hashes[0] for e in back} == {event_hash(k) for k in ka}
    assert any(isinstance(e, BlockRemoved) and e.medium == HOST and
               set(e.block_hashes) == {event_hash(k) for k in ka} for e in events)
    # b's pages were evicted to make room for a's: one found a free slot; the other three
    # slots held a's pages, being loaded, so three of b's were dropped. A key is in one tier.
    assert p.host.num_cached == 1 and p.host.saved == 4 and not any(k in p.host for k in ka)


def test_a_full_host_tier_drops_its_oldest_and_says_so() -> None:
    p, mem = pool(num_pages=2, num_slots=2)
    compute(p, mem, "a", list(range(10, 18)))  # 2 pages
    compute(p, mem, "b", list(range(20, 28)))  # a's 2 go to the host
    p.take_events()
    compute(p, mem, "c", list(range(30, 38)))  # b's 2 go to the host; a's are dropped
    events = p.take_events()
    ka = page_keys(list(range(10, 18)), SIZE)
    gone = [e for e in events if isinstance(e, BlockRemoved) and e.medium == HOST]
    assert gone and set(gone[0].block_hashes) == {event_hash(k) for k in ka}
    assert p.match(ka, 2) == []
    assert p.host is not None and p.host.evicted == 2


def test_recomputing_a_host_page_keeps_one_copy() -> None:
    p, mem = pool(num_pages=4, num_slots=4)
    a = list(range(10, 18))
    compute(p, mem, "a", a)
    compute(p, mem, "b", list(range(20, 36)))  # a's 2 to the host
    ka = page_keys(a, SIZE)
    pages = p.take("x", [], 2)  # a computed again without its hits (as a PD decode might)
    p.publish(pages, ka, 0, 2, lambda i, j: a[i:j])
    p.check()  # (the host copies were dropped: check raises on a key in both tiers)
    assert p.host is not None and not any(k in p.host for k in ka)
    p.free("x")
    p.check()


def test_reserve_loads_host_pages_and_reserves_the_rest() -> None:
    p, mem = pool(num_pages=6, num_slots=4)
    a = list(range(10, 22))  # 3 pages
    compute(p, mem, "a", a)
    compute(p, mem, "b", list(range(40, 64)))  # 6 pages: a's 3 to the host
    keys = page_keys(a + [1, 2, 3, 4, 5], SIZE)
    hits = p.match(keys, 3)
    assert len(hits) == 3 and all(h < 0 for h in hits)
    reserved = p.reserve("d", 2, hits, later=1)
    held = p.pages_of("d")
    assert len(held) == 5 and held[3:] == reserved
    assert [mem.device[q] for q in held[:3]] == keys[:3]
    p.check()
    p.commit("d")
    p.grow("d")
    p.check()
    p.free("d")
    p.check()


def test_a_host_page_needs_a_device_page_to_load_into() -> None:
    p, mem = pool(num_pages=3, num_slots=4)
    compute(p, mem, "a", list(range(10, 22)))  # 3 pages
    compute(p, mem, "b", list(range(30, 42)))  # a's to the host
    hits = p.match(page_keys(list(range(10, 22)), SIZE), 3)
    assert len(hits) == 3
    assert p.can_take(hits, 0) and not p.can_take(hits, 1)
    with pytest.raises(PagePoolError):
        p.take("x", hits, 1)
    p.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_both_tiers_exact(seed: int) -> None:
    """Prompts from a few shared prefixes, some held while others run, on a pool too small for
    them: every cached page a request gets holds its own K/V, and the accounting holds."""
    rnd = random.Random(seed)
    p, mem = pool(num_pages=10, num_slots=rnd.choice([1, 3, 8]))
    roots = [[rnd.randrange(3, 90) for _ in range(rnd.randrange(4, 20))] for _ in range(4)]
    held: list[str] = []
    for i in range(120):
        tokens = rnd.choice(roots) + [rnd.randrange(3, 90) for _ in range(rnd.randrange(0, 6))]
        keys = page_keys(tokens, SIZE)
        hits = p.match(keys, len(keys))
        new = p.pages_for(len(tokens)) - len(hits)
        if held and (not p.can_take(hits, new) or rnd.random() < 0.3):
            p.free(held.pop(rnd.randrange(len(held))))
            p.check()
            continue
        if not p.can_take(hits, new):
            continue
        owner = f"r{i}"
        pages = p.take(owner, hits, new)
        for j, page in enumerate(pages[:len(keys)]):
            if j < len(hits):
                assert mem.device[page] == keys[j]
            mem.device[page] = keys[j]
        p.publish(pages, keys, 0, len(keys), lambda a, b: tokens[a:b])
        p.check()
        held.append(owner)
    for owner in held:
        p.free(owner)
    p.check()
    assert p.idle()


# --- engines --------------------------------------------------------------------------------------


async def test_reference_is_token_exact_through_the_host_tier(tiny_model: str) -> None:
    """A prompt whose cached pages were evicted to the host tier by other prompts comes back:
    its pages load from the host (real copies of the K/V tensor's rows), and every token equals
    the cache-off engine's, greedy and seeded."""
    from tandem.engines.reference import ReferenceEngine

    kw: dict[str, Any] = {"page_size": 4, "num_pages": 12, "max_batch": 1}
    on = ReferenceEngine(Path(tiny_model), host_pages=16, **kw)
    off = ReferenceEngine(Path(tiny_model), prefix_cache=False, **kw)
    for e in (on, off):
        await e.start()
    try:
        system = [(7 * i + 3) % 250 + 5 for i in range(13)]
        other = [[(11 * i + j) % 250 + 5 for i in range(30)] for j in (1, 2)]
        prompts = [system + [40, 41], *other, system + [40, 41, 42]]
        for sp in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 5, "top_p": 0.9}):
            got = await serve(on, prompts, max_tokens=9, ignore_eos=True, **sp)
            want = await serve(off, prompts, max_tokens=9, ignore_eos=True, **sp)
            assert [r.ids for r in got] == [r.ids for r in want]
            assert got[-1].cached == 12  # (its three full pages, from the host tier)
        load = on.load()
        assert load.host_hits >= 24 and load.host_pages_total == 16
        assert load.host_load_s_per_page > 0 and load.prefill_s_per_token > 0
    finally:
        for e in (on, off):
            await wait_idle(e)
            await e.shutdown()


async def test_mock_charges_its_modelled_copies_and_reports_them(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 500, "max_position_embeddings": 64, "eos_token_id": 2}))
    timing = MockTiming(mock_prefill_us_per_token=50.0, mock_h2d_bytes_per_s=1e9,
                        mock_d2h_bytes_per_s=5e8)
    e = MockEngine(str(tmp_path), page_size=4, num_pages=8, max_batch=1, host_pages=8,
                   timing=timing)
    await e.start()
    try:
        a = list(range(10, 23))
        await serve(e, [a, list(range(100, 126)), a], max_tokens=4, ignore_eos=True)
        load = e.load()
        assert load.host_hits == 12 and load.host_pages_cached > 0
        assert load.host_load_s_per_page == pytest.approx(e.page_bytes / 1e9)
        assert load.prefill_s_per_token == pytest.approx(50e-6)
    finally:
        await wait_idle(e)
        await e.shutdown()
