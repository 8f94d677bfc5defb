"""The router's block keys (both sides of the router agree on them), the kv policy's index against
scripted event streams (gaps, replays, removals, a worker that never publishes) and its placement
against hand-computed cases (tandem.router.blocks, tandem.router.kv_index,
tandem.router.kv_policy)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from hashlib import blake2b

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.config import RouterConfig
from tandem.router.blocks import ROOT, Placement, block_keys, chain
from tandem.router.kv_index import EventLog, WorkerIndex
from tandem.router.kv_policy import KvAware
from tandem.router.policy import make_policy
from tandem.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tandem.runtime.wire import Load

P = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=P)


PROMPT = list(range(10, 30))  # 20 tokens: 5 full pages
KEYS = block_keys(PROMPT, P)


def index() -> WorkerIndex:
    return WorkerIndex(P, predict_ttl_s=2.0, approx_ttl_s=120.0)


def test_block_keys_chain_over_full_pages() -> None:
    a = block_keys(list(range(12)), P)
    b = block_keys(list(range(8)) + [99, 98, 97, 96, 5], P)
    assert len(a) == 3 and len(b) == 3
    assert a[:2] == b[:2] and a[2] != b[2]
    assert block_keys([1, 2, 3], P) == []
    # the same block after a different prefix has another key
    assert block_keys([9, 9, 9, 9, 0, 1, 2, 3], P)[1] != block_keys([0, 1, 2, 3], P)[0]


def test_a_block_key_is_blake2b_64_of_the_parent_and_the_tokens() -> None:
    """Named and deterministic: the same in every process and on every machine (a frontend
    restarted, or a second one, computes the keys the first one did)."""
    want = int.from_bytes(blake2b(ROOT.to_bytes(8, "little") + b"".join(
        t.to_bytes(8, "little", signed=True) for t in PROMPT[:P]), digest_size=8).digest(),
        "little")
    assert KEYS[0] == chain(ROOT, PROMPT[:P]) == want
    assert KEYS[1] == chain(KEYS[0], PROMPT[P:2 * P])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), max_size=40), st.integers(1, 6), st.randoms())
def test_the_event_side_and_the_request_side_agree_on_every_block_key(
        prompt: list[int], page: int, rnd: random.Random) -> None:
    """An engine publishes a prompt's full pages in runs of any length, each run linked to the
    last block of the one before by the engine's own (arbitrary) hashes: the index the events
    build holds exactly the keys the policy computes from the prompt, so it sees them all."""
    n_full = len(prompt) // page
    idx = WorkerIndex(page, predict_ttl_s=2.0, approx_ttl_s=120.0)
    parent: int | None = None
    at = 0
    while at < n_full:
        run = rnd.randint(1, n_full - at)
        hashes = [1000 + i for i in range(at, at + run)]  # (the engine's: any distinct ones)
        idx.apply([BlockStored(block_hashes=hashes, parent_block_hash=parent,
                               token_ids=prompt[at * page:(at + run) * page],
                               block_size=page)], 0.0)
        parent, at = hashes[-1], at + run
    keys = block_keys(prompt, page)
    assert set(idx.keys) == set(keys) and len(keys) == n_full
    assert idx.overlap(keys, 0.0) == n_full


def test_events_build_the_routers_own_keys_from_token_ids() -> None:
    idx = index()
    # the engine's hashes are arbitrary identities; a run of two, then one child of the second
    idx.apply([stored([901, 902], None, PROMPT[:8]), stored([777], 902, PROMPT[8:12])], 0.0)
    assert idx.overlap(KEYS, 0.0) == 3 and idx.size == 3
    idx.apply([BlockRemoved(block_hashes=[902])], 1.0)
    assert idx.overlap(KEYS, 1.0) == 1  # the chain breaks where a block went
    idx.apply([stored([5], 12345, PROMPT[12:16])], 1.0)  # a parent it never saw: skipped
    assert idx.unknown_parents == 1 and idx.size == 2
    idx.apply([AllBlocksCleared()], 2.0)
    assert idx.size == 0 and idx.overlap(KEYS, 2.0) == 0
    assert idx.events_applied == 5 and idx.last_event_at == 2.0


def test_a_block_size_other_than_the_routers_is_not_used() -> None:
    idx = index()
    idx.apply([BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=PROMPT[:8],
                           block_size=8)], 0.0)
    assert idx.size == 0


def test_a_gap_asks_for_a_replay_and_holds_what_arrives_meanwhile() -> None:
    idx = index()
    log = EventLog(idx)
    assert log.live(0, [stored([1], None, PROMPT[0:4])], 0.0) is None
    assert log.live(2, [stored([3], 2, PROMPT[8:12])], 0.0) == 1  # batch 1 lost: replay from 1
    assert log.live(3, [stored([4], 3, PROMPT[12:16])], 0.0) is None  # held
    assert idx.size == 1
    log.replayed([(1, [stored([2], 1, PROMPT[4:8])]), (2, [stored([3], 2, PROMPT[8:12])])], 1.0)
    assert idx.overlap(KEYS, 1.0) == 4 and log.next == 4 and log.gaps == 1 and log.resets == 0
    assert log.live(3, [], 1.0) is None and log.next == 4  # a duplicate is ignored


def test_a_gap_the_replay_cannot_fill_drops_the_index_and_starts_over() -> None:
    idx = index()
    log = EventLog(idx)
    log.live(0, [stored([1], None, PROMPT[0:4])], 0.0)
    assert log.live(5, [stored([9], None, [50, 51, 52, 53])], 0.0) == 1
    log.replayed([(3, [stored([2], 1, PROMPT[4:8])]), (4, [])], 0.0)  # it kept only 3 on
    assert log.resets == 1 and log.next == 6 and log.replayed_batches == 2
    assert idx.overlap(KEYS, 0.0) == 0  # what batch 0 said is gone with the reset
    assert idx.overlap(block_keys([50, 51, 52, 53], P), 0.0) == 1


def test_a_stream_joined_late_replays_from_the_start() -> None:
    log = EventLog(index())
    assert log.live(7, [], 0.0) == 0


def test_a_worker_without_events_gets_an_approximate_index_that_expires() -> None:
    idx = index()
    idx.placed(KEYS[:3], 0.0)
    assert idx.overlap(KEYS, 100.0) == 3 and idx.overlap(KEYS, 121.0) == 0
    idx.events = True  # once it publishes, a placement is only a short prediction
    idx.placed(KEYS[:3], 200.0)
    assert idx.overlap(KEYS, 201.0) == 3 and idx.overlap(KEYS, 203.0) == 0


@dataclass
class Worker:
    address: str
    load: Load = field(default_factory=lambda: Load(pages_free=100, pages_total=100))
    pending_prefill_tokens: int = 0
    active_decode_tokens: int = 0
    num_in_flight: int = 0


def policy(now: list[float]) -> KvAware:
    return KvAware(RouterConfig(policy="kv"), auto=False, clock=lambda: now[0])


def choose(kv: KvAware, candidates: list[Worker], prompt: list[int], session: str = ""
           ) -> tuple[Worker, int]:
    """The worker chosen, and the cached tokens the policy predicts there."""
    placed = kv.choose("agg", candidates, prompt, P, session)
    assert isinstance(placed.worker, Worker)
    return placed.worker, placed.cached_tokens


def test_make_policy_takes_every_value_from_the_config() -> None:
    config = RouterConfig(policy="kv", kv_decode_weight=1.0, kv_predict_ttl_s=0.5,
                          kv_approx_ttl_s=7.0)
    kv = make_policy(config)
    assert isinstance(kv, KvAware) and kv.config is config and not kv.auto
    idx = kv.index("a", P)
    assert (idx.predict_ttl_s, idx.approx_ttl_s) == (0.5, 7.0)
    auto = make_policy(RouterConfig())  # the default
    assert isinstance(auto, KvAware) and auto.auto


def test_the_worker_that_holds_the_prefix_wins_until_its_load_outweighs_it() -> None:
    now = [0.0]
    kv = policy(now)  # weights: prefill 1, queue 0.25, decode 32 per running request
    a, b = Worker("a"), Worker("b")
    for w in (a, b):
        kv.index(w.address, P).events = True
    kv.index("b", P).apply([stored([1, 2, 3, 4], None, PROMPT[:16])], 0.0)
    # a: cost 20 (computes all); b: 20 - 16 = 4
    assert choose(kv, [a, b], PROMPT) == (b, 16)
    b.num_in_flight = 1  # 4 + 32 = 36 > 20
    assert choose(kv, [a, b], PROMPT) == (a, 0)
    a.num_in_flight = 1  # 20 + 32 = 52 > 36
    assert choose(kv, [a, b], PROMPT)[0] is b
    b.pending_prefill_tokens = 68  # 4 + 17 + 32 = 53 > 52: its queue outweighs its cache
    assert choose(kv, [a, b], PROMPT)[0] is a
    a.num_in_flight = 2  # a: 20 + 64 = 84 > 53
    assert choose(kv, [a, b], PROMPT)[0] is b


def test_equal_costs_go_to_the_less_loaded_worker_not_the_first_in_the_pool() -> None:
    """A new conversation costs the same everywhere while the loads the cost counts are equal:
    the tie goes by least-loaded's order (the KV running requests hold, then free pages), never
    by the pool's order, which favoured the first worker with new sessions."""
    kv = policy([0.0])
    a, b, c = Worker("a"), Worker("b"), Worker("c")
    for w in (a, b, c):
        kv.index(w.address, P).events = True
        w.num_in_flight = 2
    a.active_decode_tokens, b.active_decode_tokens, c.active_decode_tokens = 900, 300, 300
    b.load = Load(pages_free=40, pages_total=100)
    assert choose(kv, [a, b, c], PROMPT)[0] is c  # 300 held; more pages free than b
    c.num_in_flight = 3  # a cost of its own: 32 more
    assert choose(kv, [a, b, c], PROMPT)[0] is b


def test_the_last_prompt_page_is_always_computed() -> None:
    now = [0.0]
    kv = policy(now)
    a = Worker("a")
    kv.index("a", P).apply([stored([1, 2, 3, 4, 5], None, PROMPT)], 0.0)
    assert choose(kv, [a], PROMPT) == (a, 16)  # 5 pages held, 4 usable: the last token is computed


def test_siblings_land_together_before_the_first_event() -> None:
    now = [0.0]
    kv = policy(now)
    a, b = Worker("a"), Worker("b")
    for w in (a, b):
        kv.index(w.address, P).events = True
    placed = kv.choose("agg", [a, b], PROMPT, P)
    kv.served("agg", placed, PROMPT, P)
    first = placed.worker
    now[0] = 0.5
    assert choose(kv, [a, b], PROMPT) == (first, 16)  # predicted, not yet announced
    assert kv.predicted == {first.address: 0}
    now[0] = 3.0  # the prediction expired and no event came: no preference left
    assert choose(kv, [b, a], PROMPT)[1] == 0


def test_a_session_prefers_its_last_worker_only_while_the_prompt_continues() -> None:
    now = [0.0]
    kv = policy(now)
    a, b = Worker("a"), Worker("b")
    for w in (a, b):
        kv.index(w.address, P).events = True
    turn1 = PROMPT[:12]
    kv.served("agg", Placement(b), turn1, P, session="s1")
    now[0] = 10.0  # past the prediction; no events: only the session knows
    turn2 = turn1 + [40, 41, 42, 43, 44]
    assert choose(kv, [a, b], turn2, "s1") == (b, 12)
    other = [99] * 17
    assert choose(kv, [a, b], other, "s1")[0] is a  # not a continuation
    b.num_in_flight = 1  # a preference, not a pin: 5 + 32 > 17
    assert choose(kv, [a, b], turn2, "s1")[0] is a
    now[0] = 400.0  # idle past the session TTL
    b.num_in_flight = 0
    assert choose(kv, [a, b], turn2, "s1")[0] is a


def test_catching_up_on_a_buffer_that_starts_late_is_not_a_reset() -> None:
    idx = index()
    log = EventLog(idx)
    log.replayed([(40, [stored([1], None, PROMPT[0:4])]), (41, [])], 0.0, catching_up=True)
    assert log.resets == 0 and log.next == 42 and idx.size == 1
