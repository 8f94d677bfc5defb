"""What each worker holds in its prefix cache, as the router knows it: the `kv` policy's index
(tandem.router.kv_policy). Pure: no I/O, the clock passed in; fed by tandem.router.kv_feed.

Block keys are the router's own, recomputed from token ids (tandem.router.blocks): key i of a
prompt chains its first i + 1 full pages (`block_keys`), so a BlockStored event's blocks get their
keys from their parent's key and their token ids (`chain`, the same step), and an engine's own
hashes are only
identities, for parent links and removals (an engine may hash however it likes: tandem's, vLLM's
and SGLang's all differ).

Per worker (`WorkerIndex`):
- `keys`: blocks the worker's events say it holds (`events`: it publishes them);
- `predicted`: the worker's recent placements by this router, each block until an expiry: a short
  one (`predict_ttl_s`) for a worker that publishes, so that sibling requests arriving before the
  first BlockStored (n > 1, an agent's fan-out) still land together; a long one
  (`approx_ttl_s`) for a worker that does not (an older worker, SGLang without
  `--kv-events-config`), whose index is then only this approximation (`/workers` says so).

Tiers: an event's `medium` says where its blocks are. None or "GPU" (vLLM's name, whatever the
device) is the device; any other ("CPU", a disk) is a lower tier, kept apart (`host`), so a block
that moves (BlockRemoved in one medium, BlockStored in the other, as tandem's host tier and vLLM's
offloading publish it) changes tier, and one held in both (vLLM keeps its device copy while
offloading) is in both. `overlap` credits a lower tier's block by the worker's own `credit` (what a
load saves against computing it, tandem.router.blocks.host_credit).

The event stream's sequence numbers (`EventLog`): a batch that skips ahead means batches were
lost; the index asks for a replay from the first missing one and holds what arrives meanwhile; if
the replay cannot fill the gap (the worker no longer buffers it, or it failed), the worker's index
is dropped and rebuilt from the batches that follow (`resets`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router.blocks import block_keys, salt_root
from tandem.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["DEVICE_MEDIA", "EventLog", "WorkerIndex"]

PRUNE_EVERY = 1024  # placements between sweeps of expired predictions
DEVICE_MEDIA = frozenset({None, "GPU", "gpu", "cuda", "CUDA"})  # the device tier's names


class WorkerIndex:
    def __init__(self, page_size: int, predict_ttl_s: float, approx_ttl_s: float) -> None:
        self.page_size = page_size
        self.predict_ttl_s = predict_ttl_s
        self.approx_ttl_s = approx_ttl_s
        self.events = False  # the worker publishes KV events (its index is exact, not predicted)
        self.keys: dict[int, int] = {}  # router key -> how many engine blocks hold it
        self._key_of: dict[int, int] = {}  # engine hash -> router key
        self.host: dict[int, int] = {}  # router key -> blocks holding it in a lower tier
        self._host_key_of: dict[int, int] = {}  # engine hash -> router key, lower tiers
        self.predicted: dict[int, float] = {}  # router key -> expiry (monotonic seconds)
        self._placed = 0
        self.events_applied = 0
        self.unknown_parents = 0  # stored blocks whose parent the index never saw (skipped)
        self.unusable = 0  # stored blocks of another block size, or whose tokens do not fill them
        self.last_event_at: float | None = None

    @property
    def size(self) -> int:
        return len(self.keys)

    # --- events -----------------------------------------------------------------------------------
    def apply(self, events: Sequence[KvEvent], now: float) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                device = ev.medium in DEVICE_MEDIA
                key_of, counts = (self._key_of, self.keys) if device else \
                    (self._host_key_of, self.host)
                for h in ev.block_hashes:
                    key = key_of.pop(h, None)
                    if key is not None:
                        _drop(counts, key)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()
            self.events_applied += 1
        self.last_event_at = now

    def _stored(self, ev: BlockStored) -> None:
        size = ev.block_size
        if size != self.page_size or len(ev.token_ids) != size * len(ev.block_hashes):
            self.unusable += 1
            return
        parent = salt_root(ev.cache_salt)  # (a first page: its sequence's root)
        if ev.parent_block_hash is not None:  # (a parent may be in either tier)
            known = self._key_of.get(ev.parent_block_hash)
            if known is None:
                known = self._host_key_of.get(ev.parent_block_hash)
            if known is None:
                self.unknown_parents += 1
                return
            parent = known
        key_of, keys = (self._key_of, self.keys) if ev.medium in DEVICE_MEDIA else \
            (self._host_key_of, self.host)
        for h, key in zip(ev.block_hashes, block_keys(ev.token_ids, size, parent)):
            old = key_of.get(h)
            if old == key:
                continue
            if old is not None:
                _drop(keys, old)
            key_of[h] = key
            keys[key] = keys.get(key, 0) + 1

    def clear(self) -> None:
        """Forget what the events said (AllBlocksCleared, or a reset after lost batches)."""
        self.keys.clear()
        self._key_of.clear()
        self.host.clear()
        self._host_key_of.clear()

    # --- placement --------------------------------------------------------------------------------
    def overlap(self, keys: Sequence[int], now: float, credit: float = 1.0) -> float:
        """How many of the leading `keys` the worker holds, or was recently given; a block it
        holds only in a lower tier counts `credit`."""
        held, predicted, host = self.keys, self.predicted, self.host
        n = 0.0
        for key in keys:
            if key in held:
                n += 1
                continue
            if host and key in host:
                n += credit
                continue
            until = predicted.get(key)
            if until is None or until < now:
                break
            n += 1
        return n

    def placed(self, keys: Sequence[int], now: float) -> None:
        """A request with these block keys was placed here: expect them (see the docstring)."""
        until = now + (self.predict_ttl_s if self.events else self.approx_ttl_s)
        predicted = self.predicted
        for key in keys:
            predicted[key] = until
        self._placed += 1
        if self._placed % PRUNE_EVERY == 0:
            for key in [k for k, t in predicted.items() if t < now]:
                del predicted[key]


def _drop(counts: dict[int, int], key: int) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


class EventLog:
    """One worker's event stream in sequence order, over its WorkerIndex (see the module
    docstring). `live` takes a batch as it arrives and returns a sequence number to replay from
    when batches were lost; `replayed` takes the replay's batches (none if it failed)."""

    def __init__(self, index: WorkerIndex) -> None:
        self.index = index
        self.next = 0  # the sequence number expected next
        self.replaying = False
        self._held: list[tuple[int, Sequence[KvEvent]]] = []
        self.gaps = 0  # times batches were found missing
        self.resets = 0  # times the index was dropped (a gap the replay could not fill)
        self.replayed_batches = 0

    def live(self, seq: int, events: Sequence[KvEvent], now: float) -> int | None:
        if self.replaying:
            self._held.append((seq, events))
            return None
        if seq < self.next:
            return None  # (already applied)
        if seq > self.next:
            self.gaps += 1
            self.replaying = True
            self._held = [(seq, events)]
            return self.next
        self.index.apply(events, now)
        self.next = seq + 1
        return None

    def replayed(self, batches: Sequence[tuple[int, Sequence[KvEvent]]], now: float,
                 catching_up: bool = False) -> None:
        """`catching_up`: the replay a new stream starts with (a buffer that no longer starts at
        0 is not a loss then, and is not counted as a reset)."""
        self.replayed_batches += len(batches)
        todo = sorted([*batches, *self._held], key=lambda b: b[0])
        self._held, self.replaying = [], False
        for seq, events in todo:
            if seq < self.next:
                continue
            if seq > self.next:  # gone for good: start over from here
                self.resets += not (catching_up and self.next == 0)
                self.index.clear()
            self.index.apply(events, now)
            self.next = seq + 1
