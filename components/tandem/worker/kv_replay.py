"""A worker's KV event replay (ARCHITECTURE.md, "KV events"): the buffer of the last batches it
published (`ReplayBuffer`), and the server that answers replay requests from it (`ReplayServer`),
both owned by the publisher (tandem.worker.kv_events).

The buffer holds at most `steps` batches and `max_bytes` bytes of payload (the oldest go first):
what a worker keeps for late consumers is bounded whatever its batches weigh.

Serving is bounded the same way, so that nothing a peer asks grows the worker's memory or holds
its event loop (the engine steps on that loop): a request is only queued where it arrives (the
channel's receive loop calls `request`); the answers are sent by the server's own task, at most
`per_pass` batches per event loop pass over all peers (round robin), one answer in progress per
peer, with at most `peer_queue` more of its requests waiting behind it, and answers in progress
for at most `max_peers` peers at once. A request past those bounds is refused: counted
(`KvEventCounts.replay_refused`, and in `transport.protocol_errors` as ("kv-replay", "replay
refused")) and not answered, so its asker's deadline ends its wait. A peer that does not read
(its queue on the socket full: a small high-water mark) is retried after `RETRY_S`, and an answer
not finished `ANSWER_DEADLINE_S` after it started is cut short, as is one to a peer that is gone
(counted as "replay cut short"). An answer runs to the newest batch buffered when it started: the
batches published meanwhile reach that consumer live. An answer whose next batch is no longer
buffered (evicted while it was sent) goes on from the oldest one there: the consumer sees the gap.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tandem.runtime import transport
from tandem.runtime.channel import ChannelFull
from tandem.runtime.kv_events import LiveOut

__all__ = ["ReplayBuffer", "ReplayServer"]

log = logging.getLogger("tandem.worker.kv_events")

BATCHES_PER_PASS = 256  # replayed batches sent per event loop pass, over all peers
PEER_QUEUE = 2  # a peer's requests that may wait behind its answer in progress
MAX_PEERS = 16  # peers with an answer in progress at once
RETRY_S = 0.01  # how soon a peer that was not reading is tried again
ANSWER_DEADLINE_S = 30.0  # an answer not sent by then is cut short


class ReplayBuffer:
    """The last batches published, oldest first, their seqs consecutive."""

    def __init__(self, steps: int, max_bytes: int) -> None:
        self.steps, self.max_bytes = steps, max_bytes
        self.batches: deque[tuple[int, bytes]] = deque()
        self.bytes = 0

    def append(self, seq: int, payload: bytes) -> None:
        b = self.batches
        b.append((seq, payload))
        self.bytes += len(payload)
        while len(b) > self.steps or (self.bytes > self.max_bytes and len(b) > 1):
            self.bytes -= len(b.popleft()[1])

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def oldest(self) -> int | None:
        return self.batches[0][0] if self.batches else None


@dataclass(slots=True)
class _Answer:
    next: int  # the seq to send next
    last: int  # the last seq this answer sends (the newest buffered when it started)
    deadline: float
    not_before: float = 0.0  # (a peer that was not reading: when to try it again)


@dataclass(slots=True)
class _Peer:
    answer: _Answer | None = None
    waiting: deque[int] = field(default_factory=deque)  # start seqs asked for


class Counts(Protocol):
    """What the server counts (tandem.worker.kv_events.KvEventCounts)."""

    replay_requests: int
    replay_refused: int
    batches_replayed: int


Send = Callable[[bytes, "LiveOut | None"], None]
"""`send(identity, batch or None for the end marker)`: ChannelFull if the peer is not reading
(`gone` False) or gone."""


class ReplayServer:
    def __init__(self, buffer: ReplayBuffer, topic: bytes, send: Send, counts: Counts, *,
                 per_pass: int = BATCHES_PER_PASS, peer_queue: int = PEER_QUEUE,
                 max_peers: int = MAX_PEERS, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.buffer, self.topic, self._send, self.counts = buffer, topic, send, counts
        self.per_pass, self.peer_queue, self.max_peers = per_pass, peer_queue, max_peers
        self.clock = clock
        self.peers: dict[bytes, _Peer] = {}
        self._work = asyncio.Event()

    # --- where requests arrive (the receive loop's handler): only queued ------------------------
    def request(self, item: tuple[bytes, int]) -> None:
        ident, start = item
        self.counts.replay_requests += 1
        peer = self.peers.get(ident)
        if peer is None:
            if len(self.peers) >= self.max_peers:
                return self._refuse(ident, f"{self.max_peers} peers are being answered")
            peer = self.peers[ident] = _Peer()
        elif len(peer.waiting) + (peer.answer is not None) > self.peer_queue:
            return self._refuse(ident, f"{self.peer_queue} of its requests wait already")
        peer.waiting.append(start)
        self._work.set()

    def _refuse(self, ident: bytes, why: str) -> None:
        self.counts.replay_refused += 1
        transport.refused("kv-replay", "replay refused", log, f"{ident!r}: {why}")

    # --- the server's task ------------------------------------------------------------------------
    async def run(self) -> None:
        """Send answers until cancelled: a pass, then the rest of the event loop, and so on."""
        while True:
            if not self.peers:
                self._work.clear()
                await self._work.wait()  # (idle: a request wakes it)
            delay = self.one_pass()
            await asyncio.sleep(delay)

    def one_pass(self) -> float:
        """Send up to `per_pass` batches over the peers with an answer to send; the seconds until
        the next pass (0, or the soonest retry when every peer was not reading)."""
        now = self.clock()
        ready = []
        for ident, peer in list(self.peers.items()):
            if peer.answer is None:
                self._begin(peer, now)
            a = peer.answer
            if a is not None and a.not_before <= now:
                ready.append(ident)
        budget = self.per_pass
        for i, ident in enumerate(ready):
            share = max(1, budget // (len(ready) - i))
            budget -= self._send_some(ident, self.peers[ident], share, now)
            if budget <= 0:
                break
        waits = [p.answer.not_before - now for p in self.peers.values() if p.answer is not None]
        return max(0.0, min(waits)) if waits and min(waits) > 0 else 0.0

    def _begin(self, peer: _Peer, now: float) -> None:
        if peer.waiting:
            newest = self.buffer.oldest
            last = -1 if newest is None else newest + len(self.buffer) - 1
            peer.answer = _Answer(peer.waiting.popleft(), last, now + ANSWER_DEADLINE_S)

    def _send_some(self, ident: bytes, peer: _Peer, n: int, now: float) -> int:
        """Up to `n` batches of the peer's answer (its end marker the last); how many sent."""
        a = peer.answer
        assert a is not None
        if now >= a.deadline:
            return self._cut(ident, peer, f"not sent within {ANSWER_DEADLINE_S:g}s")
        oldest, sent = self.buffer.oldest, 0
        if oldest is not None and a.next < oldest:
            a.next = oldest  # (evicted meanwhile: the consumer sees the gap)
        skip = a.next - oldest if oldest is not None else 0
        todo = min(n, a.last - a.next + 1) if oldest is not None else 0
        try:
            for seq, payload in itertools.islice(self.buffer.batches, skip, skip + max(0, todo)):
                self._send(ident, (self.topic, seq, payload))
                a.next, sent = seq + 1, sent + 1
            if a.next > a.last or oldest is None:
                self._send(ident, None)  # the end marker
                self._finish(ident, peer)
        except ChannelFull as e:
            if e.gone:
                self._cut(ident, peer, str(e))
            else:
                a.not_before = now + RETRY_S
        self.counts.batches_replayed += sent
        return max(1, sent)

    def _cut(self, ident: bytes, peer: _Peer, why: str) -> int:
        transport.refused("kv-replay", "replay cut short", log, f"{ident!r}: {why}")
        self.peers.pop(ident, None)  # (and what it asked for besides)
        return 1

    def _finish(self, ident: bytes, peer: _Peer) -> None:
        peer.answer = None
        if not peer.waiting:
            del self.peers[ident]

