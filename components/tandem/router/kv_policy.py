"""The `kv` routing policy: place a request where it will get its first token soonest, counting
what each worker already holds (tandem.router.kv_index, fed by the workers' KV events).

Per candidate worker, in prompt tokens to compute:

    cost = prefill_weight * (queue_weight * its pending prefill + the prompt tokens it lacks)
         + decode_weight * the requests running on it

and the lowest cost wins (ties: least-loaded's order, `blocks.load_key`). The pending
prefill counts a fraction (`queue_weight`, 0.25): an engine that batches prefills computes the
queued ones in the same steps as the new one, so they delay it by less than their length, and
counting them whole sends a request away from the worker that holds its prefix whenever that
worker is computing another miss, which makes a second copy of the prefix elsewhere and evicts
more. A running request costs a new one its share of every step (`decode_weight`, 32 tokens). "Does not
hold": the prompt minus the leading full pages the worker's index has (a page in its host tier
counted at the worker's measured `host_credit`: the share of its compute a load saves), or that
this router placed there moments ago (siblings arriving before the first event), at most all pages but the last (a
worker always computes the last prompt token). The pending prefill counts only what the router
predicted uncached for the requests it placed (tandem.router.accounting), so a worker that holds a
hot prefix is not charged its full length per request; and because the load term grows with every
request it takes, a hot prefix spreads to a second worker as soon as queueing behind the first
would cost more than computing the prefix again: the policy never piles a prefix onto one worker
regardless of load.

Sessions (`session`: from `X-Session-ID`, `X-Correlation-ID` and similar headers, or the request's
`user`): the worker that served a session's last turn is assumed to hold that turn's prompt when
the new prompt continues it, for `session_ttl_s` after the last turn. A preference through the cost,
never a pin: a cheaper worker still wins.

Full workers: the pool offers this policy the workers short of free pages for the whole prompt too,
and keeps its choice of one when the prompt's rest (less the overlap it predicted) fits there; so
a conversation's next turn waits at the worker that holds its last turn, in its engine's queue,
rather than be computed again on another (perf/results/trace_mooncake.md). A host-tier block's
overlap counts at its credit, though loading it takes a device page: the engine, not the router,
holds the request until the page is free.

`auto` (the default policy): this rule among candidates of which one publishes KV events, and
least-loaded among candidates none of which does (SGLang without `--kv-events-config`, an older
worker), with no approximate index.

In PD the same cost chooses the prefill worker; the decode worker is chosen by the same rule
without a pending prefill (its cached pages save a transfer, not a computation). A choice's
`Placement.cached_tokens` is the overlap it predicted (the pool hands it to the accounting).
Every value (weights, expiries) comes from RouterConfig, through tandem.router.policy.make_policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tandem.config import RouterConfig
from tandem.router.blocks import (Candidate, Placement, block_keys, host_credit, least_loaded,
                                   load_key, salt_root)
from tandem.router.kv_index import EventLog, WorkerIndex

__all__ = ["KvAware"]


class KvAware:
    predicts = True

    def __init__(self, config: RouterConfig, *, auto: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.auto = auto  # route by load (least-loaded) unless a candidate publishes KV events
        self.clock = clock
        self.indexes: dict[str, WorkerIndex] = {}  # worker address -> what it holds
        self.logs: dict[str, EventLog] = {}  # worker address -> its event stream
        # (role, session) -> (worker address, the last prompt's last block key, its block count,
        # expiry)
        self._sessions: dict[tuple[str, str], tuple[str, int, int, float]] = {}
        self._keys: tuple[list[int], int, str, list[int]] = ([], 0, "", [])  # (prompt, size,
        # salt, its keys)
        self.predicted: dict[str, int] = {}  # worker -> predicted cached tokens placed there
        self.seconds = 0.0  # wall time spent choosing and recording (placement)

    def index(self, address: str, page_size: int) -> WorkerIndex:
        idx = self.indexes.get(address)
        if idx is None:
            cfg = self.config
            idx = self.indexes[address] = WorkerIndex(page_size, cfg.kv_predict_ttl_s,
                                                      cfg.kv_approx_ttl_s)
            self.logs[address] = EventLog(idx)
        return idx

    def forget(self, address: str) -> None:
        """The worker left: drop its index."""
        self.indexes.pop(address, None)
        self.logs.pop(address, None)

    def _block_keys(self, prompt_ids: list[int], page_size: int, salt: str) -> list[int]:
        """The prompt's block keys, rooted at its salt's (computed once for both legs of a PD
        request)."""
        prompt, size, was, keys = self._keys
        if prompt is not prompt_ids or size != page_size or was != salt:
            keys = block_keys(prompt_ids, page_size, salt_root(salt))
            self._keys = (prompt_ids, page_size, salt, keys)
        return keys

    def choose(self, role: str, candidates: Sequence[Candidate], prompt_ids: list[int],
               page_size: int, session: str = "", salt: str = "") -> Placement:
        if self.auto and not any(self.index(c.address, page_size).events for c in candidates):
            return Placement(least_loaded(candidates))
        t0 = time.perf_counter()
        now = self.clock()
        keys = self._block_keys(prompt_ids, page_size, salt)
        n = len(prompt_ids)
        most = (n - 1) // page_size  # pages a worker may have cached: all but the last token's
        hint = self._sessions.get((role, session)) if session else None
        if hint is not None and hint[3] < now:
            hint = None
        best: Candidate | None = None
        best_cost, best_overlap = 0.0, 0.0
        cfg = self.config
        pw, qw, dw = cfg.kv_prefill_weight, cfg.kv_queue_weight, cfg.kv_decode_weight
        for c in candidates:
            index = self.index(c.address, page_size)
            blocks = index.overlap(keys, now, host_credit(c.load, page_size) if index.host
                                   else 1.0)
            if hint is not None and hint[0] == c.address and hint[2] <= len(keys) and \
                    keys[hint[2] - 1] == hint[1]:
                blocks = max(blocks, hint[2])  # the session's last turn, continued
            overlap = min(blocks, most) * page_size
            pending = c.pending_prefill_tokens if role != "decode" else 0
            cost = pw * (qw * pending + n - overlap) + dw * c.num_in_flight
            if best is None or cost < best_cost or (cost == best_cost and
                                                    load_key(c) < load_key(best)):
                best, best_cost, best_overlap = c, cost, overlap
        assert best is not None
        self.seconds += time.perf_counter() - t0
        return Placement(best, round(best_overlap))

    def served(self, role: str, placed: Placement, prompt_ids: list[int], page_size: int,
               session: str = "", salt: str = "") -> None:
        chosen = placed.worker
        if self.auto and not self.index(chosen.address, page_size).events:
            return  # (auto, by load: nothing to predict)
        t0 = time.perf_counter()
        now = self.clock()
        keys = self._block_keys(prompt_ids, page_size, salt)
        self.index(chosen.address, page_size).placed(keys, now)
        self.predicted[chosen.address] = self.predicted.get(chosen.address, 0) + \
            placed.cached_tokens
        if session and keys:
            self._sessions[(role, session)] = (chosen.address, keys[-1], len(keys),
                                               now + self.config.session_ttl_s)
            if len(self._sessions) % 4096 == 0:
                for k in [k for k, v in self._sessions.items() if v[3] < now]:
                    del self._sessions[k]
        self.seconds += time.perf_counter() - t0
