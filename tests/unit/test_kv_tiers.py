"""Tiers on the router's side: the index keeps each worker's blocks by medium (a move is a removal
in one and a store in the other), the kv policy credits a host-tier block by what the worker
measured (`host_credit`), and an engine's own events, host tier and all, build an index that
agrees with its pool, tier by tier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tandem.engines.host_tier import DEVICE, HOST
from tandem.engines.mock import MockEngine
from tandem.engines.prefix import page_keys
from tandem.router.blocks import block_keys, host_credit
from tandem.router.kv_index import WorkerIndex
from tandem.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tandem.runtime.wire import Load, SamplingParams
from tests.conformance.harness import Recorder, finished, wait_idle
from tests.unit.test_kv_router import KEYS, PROMPT, Worker, choose, index, policy

P = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int],
           medium: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=P, medium=medium)


def test_a_block_that_moves_to_the_host_changes_tier_and_counts_its_credit() -> None:
    idx = index()
    idx.apply([stored([1, 2, 3, 4], None, PROMPT[:16], DEVICE)], 0.0)
    assert idx.overlap(KEYS, 0.0, 0.5) == 4 and not idx.host
    # the two deepest move to the host, as tandem's pool and vLLM's offload publish it
    idx.apply([BlockRemoved(block_hashes=[3, 4], medium=DEVICE),
               stored([3], 2, PROMPT[8:12], HOST), stored([4], 3, PROMPT[12:16], HOST)], 1.0)
    assert idx.size == 2 and len(idx.host) == 2
    assert idx.overlap(KEYS, 1.0, 0.5) == 3.0 and idx.overlap(KEYS, 1.0, 0.0) == 2.0
    # a child of a host block (its parent's key is known in either tier)
    idx.apply([stored([5], 4, PROMPT[16:20], HOST)], 1.0)
    assert idx.unknown_parents == 0 and idx.overlap(KEYS, 1.0, 1.0) == 5
    # removing a hash in the host medium leaves the device's copy of another alone
    idx.apply([BlockRemoved(block_hashes=[4], medium=HOST)], 2.0)
    assert idx.overlap(KEYS, 2.0, 1.0) == 3
    idx.apply([AllBlocksCleared()], 3.0)
    assert idx.size == 0 and not idx.host


def test_a_block_held_in_both_tiers_stays_until_both_go() -> None:
    """(vLLM keeps the device copy of a block it offloads: two stores, two removals.)"""
    idx = index()
    idx.apply([stored([1], None, PROMPT[:4]), stored([1], None, PROMPT[:4], "CPU")], 0.0)
    idx.apply([BlockRemoved(block_hashes=[1])], 0.0)  # (medium None: the device)
    assert idx.overlap(KEYS, 0.0, 0.25) == 0.25
    idx.apply([BlockRemoved(block_hashes=[1], medium="CPU")], 0.0)
    assert idx.overlap(KEYS, 0.0, 0.25) == 0


def test_host_credit_is_what_a_load_saves_against_recomputing() -> None:
    assert host_credit(Load(prefill_s_per_token=1e-3, host_load_s_per_page=1e-3), 4) == 0.75
    assert host_credit(Load(prefill_s_per_token=1e-4, host_load_s_per_page=1e-3), 4) == 0.0
    assert host_credit(Load(), 4) == 1.0  # nothing measured costs anything
    assert host_credit(Load(host_load_s_per_page=1e-3), 4) == 0.0


def test_the_policy_weighs_a_host_prefix_by_the_workers_measured_costs() -> None:
    kv = policy([0.0])
    a, b = Worker("a"), Worker("b")
    for w in (a, b):
        kv.index(w.address, P).events = True
    kv.index("a", P).apply([stored([1, 2, 3, 4], None, PROMPT[:16], HOST)], 0.0)
    kv.index("b", P).apply([stored([9, 8], None, PROMPT[:8], DEVICE)], 0.0)
    # a's loads are cheap: 4 host blocks at 0.75 = 3 blocks' worth, beating b's 2 on the device
    a.load = Load(pages_free=100, pages_total=100, prefill_s_per_token=1e-3,
                  host_load_s_per_page=1e-3)
    assert choose(kv, [a, b], PROMPT) == (a, 12)
    # a's loads cost as much as computing: its host blocks are worth nothing
    a.load = Load(pages_free=100, pages_total=100, prefill_s_per_token=1e-3,
                  host_load_s_per_page=4e-3)
    assert choose(kv, [a, b], PROMPT) == (b, 8)


@pytest.mark.parametrize("host_pages", [0, 3, 12])
async def test_an_engines_events_build_its_pool_tier_by_tier(tmp_path: Path,
                                                             host_pages: int) -> None:
    """Prompts from a few prefixes through a mock engine with a small pool: after every request
    the router's index, fed only the engine's events, holds exactly the router keys of the
    pages the pool has cached on the device, and exactly those of its host tier."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 300, "max_position_embeddings": 64, "eos_token_id": 2}))
    e = MockEngine(str(tmp_path), page_size=P, num_pages=10, max_batch=1,
                   host_pages=host_pages)
    events: list[Any] = []
    e.on_kv_events = events.extend
    await e.start()
    idx = WorkerIndex(P, predict_ttl_s=2.0, approx_ttl_s=120.0)
    rec = Recorder(e)
    roots = [[(13 * i + 7 * j) % 280 + 5 for i in range(14)] for j in range(4)]
    seen: dict[int, int] = {}  # engine key -> router key (from every prompt's pages)
    try:
        for i in range(24):
            prompt = roots[i % 4 if i < 12 else (i * 3) % 4] + [i + 3]
            sp = SamplingParams(max_tokens=3, ignore_eos=True)
            run = await finished(rec.submit(e, f"r{i}", prompt, sp))
            full = prompt + run.ids
            for ek, rk in zip(page_keys(full, P), block_keys(full, P)):
                seen[ek] = rk
            await wait_idle(e)
            idx.apply(events, float(i))
            last = list(events)
            events.clear()
            pool = e.pool
            assert set(idx.keys) == {seen[k] for k in pool._page}
            host = set() if pool.host is None else {seen[k] for k in pool.host.slots}
            assert idx.unknown_parents == 0, last
            assert set(idx.host) == host
            assert idx.unknown_parents == 0 and idx.unusable == 0
        if host_pages:
            assert e.pool.host_hits > 0
    finally:
        await e.shutdown()
