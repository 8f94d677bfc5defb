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

The event stream's sequence numbers (`EventLog`): a batch that skips ahead means batches were
lost; the index asks for a replay from the first missing one and holds what arrives meanwhile; if
the replay cannot fill the gap (the worker no longer buffers it, or it failed), the worker's index
is dropped and rebuilt from the batches that follow (`resets`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router.blocks import block_keys, salt_root
from tandem.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["EventLog", "WorkerIndex"]

PRUNE_EVERY = 1024  # placements between sweeps of expired predictions


class WorkerIndex:
    def __init__(self, page_size: int, predict_ttl_s: float, approx_ttl_s: float) -> None:
        self.page_size = page_size
        self.predict_ttl_s = predict_ttl_s
        self.approx_ttl_s = approx_ttl_s
        self.events = False  # the worker publishes KV events (its index is exact, not predicted)
        self.keys: dict[int, int] = {}  # router key -> how many engine blocks hold it
        self._key_of: dict[int, int] = {}  # engine hash -> router key
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
                for h in ev.block_hashes:
                    key = self._key_of.pop(h, None)
                    if key is not None:
                        self._drop(key)
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
        if ev.parent_block_hash is not None:
            known = self._key_of.get(ev.parent_block_hash)
            if known is None:
                self.unknown_parents += 1
                return
            parent = known
        keys = self.keys
        for h, key in zip(ev.block_hashes, block_keys(ev.token_ids, size, parent)):
            old = self._key_of.get(h)
            if old == key:
                continue
            if old is not None:
                self._drop(old)
            self._key_of[h] = key
            keys[key] = keys.get(key, 0) + 1

    def _drop(self, key: int) -> None:
        n = self.keys.get(key, 0) - 1
        if n > 0:
            self.keys[key] = n
        else:
            self.keys.pop(key, None)

    def clear(self) -> None:
        """Forget what the events said (AllBlocksCleared, or a reset after lost batches)."""
        self.keys.clear()
        self._key_of.clear()

    # --- placement --------------------------------------------------------------------------------
    def overlap(self, keys: Sequence[int], now: float) -> int:
        """How many of the leading `keys` the worker holds, or was recently given."""
        held, predicted = self.keys, self.predicted
        n = 0
        for key in keys:
            if key in held:
                n += 1
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
