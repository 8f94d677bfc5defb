"""One worker's KV event stream into the `kv` policy's index (tandem.router.kv_index): a
subscriber on the worker's event address (its handshake says where), and, when batches were lost,
a replay request on its replay socket (tandem.runtime.kv_events has the frames; the module
docstring of tandem.router.kv_index what a gap does to the index). Both are channels
(tandem.runtime.frames, with the format's codecs: `Subscribe` and `Ask` make them), so a feed
runs on memory ends in tests as it runs on sockets.

A feed is a task the pool owns (started when the worker says hello with an event address, ended
when it leaves or the pool closes). Every frame is untrusted: one that does not decode, whatever
is wrong with it, is dropped by the channel's receive loop, counted (`bad`, and in
`transport.bad_messages`) and logged rate-limited; a replay has a deadline (`REPLAY_TIMEOUT_S`)
and a cap on its batches, and a replay that fails is a replay that returned nothing (the index
starts over if it must). Events are applied on the event loop as they arrive: one batch per engine
step per worker.

Feeds are supervised (`KvFeeds`): a feed that ends or dies (a bug, a socket error) is logged,
counted (`restarts`, `tandem_router_kv_feed_restarts_total`) and started again after a backoff
(`RESTART_MIN_S`, doubling to `RESTART_MAX_S`; back to the least after a feed that ran
`RESTART_RESET_S`), with a fresh index: the worker's index never freezes on one bad moment.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from tandem.router.kv_index import EventLog
from tandem.router.kv_policy import KvAware
from tandem.runtime.channel import Channel, ChannelFull
from tandem.runtime.frames import FrameChannel, FrameCodec
from tandem.runtime.kv_events import REPLAY_ASKED, SUBSCRIBED, KvEvent, LiveBatch, ReplayBatch
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.metrics import Registry

log = logging.getLogger("tandem.router")

REPLAY_TIMEOUT_S = 5.0
RESTART_MIN_S = 0.1  # a dead feed's first backoff; it doubles per restart in a row
RESTART_MAX_S = 10.0
RESTART_RESET_S = 60.0  # a feed that ran this long restarts after the least backoff again
MAX_REPLAY_BATCHES = 20_000  # (a worker buffers 10,000 by default)
SUB_HWM = 100_000

Subscribe = Callable[[str, FrameCodec[Any, LiveBatch]], Channel[Any, LiveBatch]]
"""`subscribe(address, codec)` -> the worker's live stream, decoded by `codec`."""
Ask = Callable[[str, FrameCodec[int, ReplayBatch | None]], Channel[int, ReplayBatch | None]]
"""`ask(address, codec)` -> a channel to the worker's replay socket, for one request."""


def zmq_subscribe(address: str, codec: FrameCodec[Any, LiveBatch]) -> Channel[Any, LiveBatch]:
    return FrameChannel.subscriber(address, codec, log, ((zmq.RCVHWM, SUB_HWM),))


def zmq_ask(address: str, codec: FrameCodec[int, ReplayBatch | None]
            ) -> Channel[int, ReplayBatch | None]:
    return FrameChannel.dealer(address, b"kv-replay-" + secrets.token_hex(8).encode(), codec, log)


class KvFeed:
    def __init__(self, name: str, events_addr: str, replay_addr: str, events: EventLog,
                 clock: Callable[[], float] = time.monotonic, *,
                 subscribe: Subscribe = zmq_subscribe, ask: Ask = zmq_ask) -> None:
        self.name, self.events_addr, self.replay_addr = name, events_addr, replay_addr
        self.events = events
        self.clock = clock
        self._subscribe, self._ask = subscribe, ask
        self.bad = 0  # messages that did not decode
        self.replays = 0  # replay requests made
        self.seconds = 0.0  # wall time spent decoding and applying events
        # (the format's codecs, counting what this worker sends that does not decode)
        self._live = FrameCodec(SUBSCRIBED.name, SUBSCRIBED.encode, self._counted(SUBSCRIBED))
        self._asked = FrameCodec(REPLAY_ASKED.name, REPLAY_ASKED.encode,
                                 self._counted(REPLAY_ASKED))

    def _counted(self, codec: FrameCodec[Any, Any]) -> Callable[[list[bytes]], Any]:
        decode = codec.decode

        def counted(frames: list[bytes]) -> Any:
            try:
                return decode(frames)
            except Exception:
                self.bad += 1
                raise
        return counted

    async def run(self) -> None:
        """Catch up on what the worker still buffers (a frontend that starts after the worker
        learns what it holds now, not only from its next event), then read the stream until
        cancelled (batches that came meanwhile wait in the subscriber; those already replayed
        are skipped)."""
        live = self._subscribe(self.events_addr, self._live)
        try:
            got = await self.replay(0)
            self.events.replayed(got, self.clock(), catching_up=True)
            async for batch in live:
                t0 = time.perf_counter()
                want = self.events.live(batch.seq, batch.batch.events, self.clock())
                self.seconds += time.perf_counter() - t0
                if want is not None:
                    got = await self.replay(want)
                    t0 = time.perf_counter()
                    self.events.replayed(got, self.clock())
                    self.seconds += time.perf_counter() - t0
        finally:
            live.close()

    async def replay(self, start: int) -> Sequence[tuple[int, Sequence[KvEvent]]]:
        """Every batch the worker still buffers from `start` on (what came, if the replay
        fails or passes its deadline)."""
        self.replays += 1
        if not self.replay_addr:
            return []
        channel = self._ask(self.replay_addr, self._asked)
        out: list[tuple[int, Sequence[KvEvent]]] = []
        try:
            channel.send_nowait(start)
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                async for got in channel:
                    if got is None or len(out) >= MAX_REPLAY_BATCHES:
                        return out
                    out.append((got.seq, got.batch.events))
        except (TimeoutError, ChannelFull) as e:
            log.warning("worker %s: KV event replay from %d ended after %d batches: %s",
                        self.name, start, len(out), type(e).__name__)
        finally:
            channel.close()
        return out


class KvFeeds:
    """Every worker's feed, owned by the pool when its policy is `kv`: started when a worker says
    hello with an event address (started again, with a fresh index, at every hello: a restarted
    worker numbers its batches from 0; one that only reconnected replays what it buffers), ended
    when it leaves, all closed with the pool; supervised (see the module docstring).
    Also what `/workers` and `/metrics` show of the index per worker."""

    def __init__(self, policy: KvAware, *, subscribe: Subscribe = zmq_subscribe,
                 ask: Ask = zmq_ask, backoff: tuple[float, float] = (RESTART_MIN_S,
                                                                     RESTART_MAX_S)) -> None:
        self.policy = policy
        self._subscribe, self._ask = subscribe, ask
        self._backoff = backoff
        self.feeds: dict[str, tuple[str, KvFeed, asyncio.Task[None]]] = {}  # address -> ...
        self.restarts: dict[str, int] = {}  # address -> feeds of it that ended and were restarted
        self._tasks = TaskGroup()

    def up(self, address: str, name: str, events_addr: str, replay_addr: str,
           page_size: int) -> None:
        self.down(address)  # (a hello again may be a restarted worker: its seq starts over)
        feed = self._fresh(address, name, events_addr, replay_addr, page_size)
        if feed is None:
            return  # no events: the index is the approximation of its placements
        task = self._tasks.spawn(self._supervise(address, feed, page_size),
                                 name=f"kv-events {address}")
        self.feeds[address] = (events_addr, feed, task)
        log.info("worker %s: routing on its KV events from %s", address, events_addr)

    def _fresh(self, address: str, name: str, events_addr: str, replay_addr: str,
               page_size: int) -> KvFeed | None:
        """An empty index for the worker, and the feed that fills it (None: no events)."""
        self.policy.forget(address)
        index = self.policy.index(address, page_size)
        if not events_addr:
            return None
        index.events = True
        return KvFeed(name or address, events_addr, replay_addr, self.policy.logs[address],
                      self.policy.clock, subscribe=self._subscribe, ask=self._ask)

    async def _supervise(self, address: str, feed: KvFeed, page_size: int) -> None:
        """Run the worker's feed until cancelled, each time it ends or dies again after a backoff
        with a fresh index and feed."""
        least, most = self._backoff
        wait = least
        while True:
            started = time.monotonic()
            try:
                await feed.run()
                why = "its stream ended"
            except Exception as e:  # (CancelledError is not one: the owner's cancel ends this)
                why = repr(e)
                log.error("worker %s: KV event feed died", address, exc_info=e)
            if time.monotonic() - started >= RESTART_RESET_S:
                wait = least
            self.restarts[address] = self.restarts.get(address, 0) + 1
            log.warning("worker %s: KV event feed restarts in %.1fs (%d so far): %s", address,
                        wait, self.restarts[address], why)
            await asyncio.sleep(wait)
            wait = min(most, wait * 2)
            fresh = self._fresh(address, feed.name, feed.events_addr, feed.replay_addr,
                                page_size)
            assert fresh is not None  # (the same event address as before)
            feed = fresh
            entry = self.feeds.get(address)
            if entry is not None:
                self.feeds[address] = (entry[0], feed, entry[2])

    def down(self, address: str) -> None:
        old = self.feeds.pop(address, None)
        if old is not None:
            old[2].cancel()

    async def close(self) -> None:
        self.feeds.clear()
        await self._tasks.close()

    def row(self, address: str) -> dict[str, Any]:
        """What `/workers` shows of the worker's index."""
        index = self.policy.indexes.get(address)
        events = self.policy.logs.get(address)
        if index is None or events is None:
            return {}
        feed = self.feeds.get(address)
        now = self.policy.clock()
        return {
            "kv_index": "events" if index.events else "approximate (placements; no KV events)",
            "kv_events_applied": index.events_applied,
            "kv_index_blocks": index.size,
            "kv_index_host_blocks": len(index.host),
            "kv_last_event_age_s": None if index.last_event_at is None
            else round(now - index.last_event_at, 3),
            "kv_event_gaps": events.gaps, "kv_index_resets": events.resets,
            "kv_unknown_parents": index.unknown_parents, "kv_unusable_blocks": index.unusable,
            "kv_bad_event_messages": feed[1].bad if feed is not None else 0,
            "kv_feed_restarts": self.restarts.get(address, 0),
            "kv_predicted_cached_tokens": self.policy.predicted.get(address, 0),
        }

    def register_metrics(self, r: Registry) -> None:
        p = self.policy

        def per(get: Callable[[str], float]) -> Callable[[], list[Any]]:
            return lambda: [((a,), get(a)) for a in list(p.indexes)]

        r.callback("tandem_router_kv_events_applied_total", "KV events applied to the worker's "
                   "index (0 with the kv policy: the router routes on an empty index).",
                   per(lambda a: p.indexes[a].events_applied), ("worker",), kind="counter")
        r.callback("tandem_router_kv_index_blocks", "Blocks the router's index says the worker "
                   "holds on its device.", per(lambda a: p.indexes[a].size), ("worker",))
        r.callback("tandem_router_kv_index_host_blocks", "Blocks the router's index says the "
                   "worker holds in a lower tier (its host memory).",
                   per(lambda a: len(p.indexes[a].host)), ("worker",))
        r.callback("tandem_router_kv_last_event_age_seconds", "Seconds since the worker's last "
                   "KV event (absent before the first).",
                   lambda: [((a,), p.clock() - i.last_event_at) for a, i in list(p.indexes.items())
                            if i.last_event_at is not None], ("worker",))
        r.callback("tandem_router_kv_predicted_cached_tokens_total", "Prompt tokens the router "
                   "predicted cached on the worker when it placed requests there (compare with "
                   "the worker's tandem_prefix_cache_hits_total).",
                   per(lambda a: p.predicted.get(a, 0)), ("worker",), kind="counter")
        r.callback("tandem_router_kv_feed_restarts_total", "Times the worker's KV event feed "
                   "ended or died and was started again (with a fresh index).",
                   lambda: [((a,), n) for a, n in list(self.restarts.items())], ("worker",),
                   kind="counter")
        r.callback("tandem_router_kv_event_gaps_total", "Times batches of the worker's KV events "
                   "were found missing.", per(lambda a: p.logs[a].gaps), ("worker",),
                   kind="counter")
        r.callback("tandem_router_kv_seconds_total", "Wall time the kv policy spent, by part: "
                   "placement (choosing, recording) and events (decoding, applying).",
                   lambda: [(("placement",), p.seconds),
                            (("events",), sum(f[1].seconds for f in list(self.feeds.values())))],
                   ("part",), kind="counter")
