"""A worker's KV event publisher (ARCHITECTURE.md, "KV events"): the engine's BlockStored /
BlockRemoved batches on a PUB socket, in the format every router reads (tandem.runtime.kv_events),
with a replay ROUTER socket holding the last `buffer_steps` batches. Both are channels
(tandem.runtime.frames, with the format's codecs), so the publisher runs on memory ends in tests
as it runs on sockets.

`publish(events)` is what a tandem engine's `on_kv_events` is set to: it is called on the event
loop after each engine step that produced events, and never waits. It gives the batch the next
sequence number (from 0), keeps it in the replay buffer and offers it to the PUB socket without
blocking. A subscriber that does not keep up loses batches alone: the PUB socket holds at most
`hwm` batches (1,000 by default) it has not read, and drops what comes past that for that
subscriber only, which sees the gap in the sequence numbers and gets them back by replay. So a
subscriber that never reads costs the worker at most `hwm` batches, and never holds back the
others. (TCP keepalive ends a dead subscriber's connection within about a minute.)

The replay socket answers `[identity, b"", start_seq]` with every buffered batch whose seq >=
start_seq, then the end marker, in SGLang 0.5.23's form (`[topic, seq, payload]`, then `[b"",
END, b""]`, after identity and delimiter): a replayed batch is the live stream's three frames.
A request for a batch no longer buffered gets what is there, from the oldest: the consumer sees
the gap. The buffer (the last `buffer_steps` batches, at most `buffer_bytes` bytes of them) and
the answers are tandem.worker.kv_replay's: requests are only queued where they arrive, answers
sent by the replay server's own task with a budget per event loop pass, one answer in progress
per peer and a small queue per peer (more is refused, counted). A malformed request is dropped
and counted in `transport.bad_messages` ("kv-replay").

Both sockets bind on the worker's `--host` (port 0: the OS picks one when it binds) and are
advertised on its `--advertise-host` in the handshake (`WorkerInfo.kv_events_addr`,
`kv_replay_addr`). With the cluster's keys (tandem.runtime.transport's, as every socket of the
process) both are CURVE servers, each with a monitor from before it binds that counts failed
handshakes; without keys they bind only on loopback.

For `--engine sglang`, tandem publishes nothing: SGLang's own `--kv-events-config` (passed
through) publishes the same format, and `sglang_event_addrs` reads where, for the handshake.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from tandem.runtime import transport
from tandem.runtime.channel import ChannelFull, RouterChannel, serve
from tandem.runtime.frames import FrameChannel, FrameRouter, Outlet
from tandem.runtime.kv_events import (PUBLISHED, REPLAY_SERVED, EventBatch, KvEvent, LiveOut,
                                      encode_batch)
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.refusals import Throttled
from tandem.worker.kv_replay import ReplayBuffer, ReplayServer

log = logging.getLogger("tandem.worker.kv_events")

HWM = 1_000  # batches a subscriber may have unread before the PUB socket drops its next ones
BUFFER_STEPS = 10_000  # batches the replay socket holds
BUFFER_BYTES = 64 << 20  # ... and at most this many bytes of them
REPLAY_SNDHWM = 256  # replayed batches queued on the socket for one peer (then: retried later)
REQUESTS_PER_PASS = 16  # replay requests taken per event loop pass (each only queued)
MAX_REQUEST_BYTES = 1024  # a replay request frame is at most this long (it needs 8 bytes)
_KEEPALIVE = ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, 30), (zmq.TCP_KEEPALIVE_INTVL, 10),
              (zmq.TCP_KEEPALIVE_CNT, 3))

Replay = RouterChannel[LiveOut | None, int]
Bind = Callable[[str, int, int, int, int], tuple[Outlet[LiveOut], Replay, int, int]]
"""`bind(host, port, replay_port, hwm, replay_sndhwm)` -> (live end, replay end, their ports)."""


def zmq_bind(host: str, port: int, replay_port: int, hwm: int,
             replay_sndhwm: int) -> tuple[Outlet[LiveOut], Replay, int, int]:
    """The two sockets, bound (port 0: one the OS picks); AuthError beyond loopback without the
    cluster's keys, ZMQError if a port is taken."""
    def at(p: int) -> str:
        return f"tcp://{transport.url_host(host)}:{p or '*'}"

    # Past `hwm` unread batches a subscriber's next ones are dropped (for it alone).
    live = FrameChannel.publisher(at(port), PUBLISHED, log, (
        *_KEEPALIVE, (zmq.MAXMSGSIZE, MAX_REQUEST_BYTES), (zmq.SNDHWM, hwm)))
    try:
        # A replay to a gone or full peer raises (ROUTER_MANDATORY): gone ends its answer, full
        # makes the server try it again later.
        replay = FrameRouter(at(replay_port), REPLAY_SERVED, log, (
            *_KEEPALIVE, (zmq.MAXMSGSIZE, MAX_REQUEST_BYTES), (zmq.SNDHWM, replay_sndhwm),
            (zmq.RCVHWM, 1000)))
    except BaseException:
        live.close()
        raise
    return live, replay, live.port, replay.port


@dataclass(slots=True)
class KvEventCounts:
    """What the worker's /metrics reports (tandem.worker.metrics), read at scrape time."""

    events_published: int = 0  # events in the batches the PUB socket took
    batches_published: int = 0
    batches_dropped: int = 0  # refused by the PUB socket (still replayable), or not encodable
    replay_requests: int = 0
    replay_refused: int = 0  # past the per-peer queue or the peers answered at once
    batches_replayed: int = 0


class KvEventPublisher:
    def __init__(self, host: str, port: int = 0, replay_port: int = 0, *,
                 advertise_host: str = "", topic: bytes = b"", dp_rank: int = 0, hwm: int = HWM,
                 buffer_steps: int = BUFFER_STEPS, buffer_bytes: int = BUFFER_BYTES,
                 bind: Bind = zmq_bind) -> None:
        """Binds nothing yet: `start()` does (on the event loop)."""
        self.host, self.port, self.replay_port = host, port, replay_port
        self.advertise_host = advertise_host or host
        self.topic, self.dp_rank, self.hwm = topic, dp_rank, hwm
        self.counts = KvEventCounts()
        self._bind = bind
        self._buffer = ReplayBuffer(buffer_steps, buffer_bytes)
        self._seq = 0  # the next batch's
        self._live: Outlet[LiveOut] | None = None
        self._replay: Replay | None = None
        self.replays: ReplayServer | None = None  # (from `start()`)
        # The replay server, its answers and the handshake counters: a death is fatal (the worker
        # would go on publishing with no replay, and every router that lost a batch would reset).
        self._tasks = TaskGroup(supervised=True)
        self._warn = Throttled(log)

    @property
    def events_addr(self) -> str:
        """Where subscribers connect (advertised host, bound port); "" before `start()`."""
        host = transport.url_host(self.advertise_host)
        return f"tcp://{host}:{self.port}" if self._live else ""

    @property
    def replay_addr(self) -> str:
        host = transport.url_host(self.advertise_host)
        return f"tcp://{host}:{self.replay_port}" if self._replay else ""

    @property
    def next_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        """Bind both sockets and serve replay requests from now on."""
        live, replay, self.port, self.replay_port = self._bind(
            self.host, self.port, self.replay_port, self.hwm, REPLAY_SNDHWM)
        self._live, self._replay = live, replay
        self.replays = ReplayServer(self._buffer, self.topic, replay.send_nowait, self.counts)
        self._tasks.spawn(serve(replay, self.replays.request, "kv-replay", log,
                                REQUESTS_PER_PASS), name="kv-replay")
        self._tasks.spawn(self.replays.run(), name="kv-replay-answers")
        self._tasks.spawn(live.count_refused_handshakes("kv-events", log),
                          name="kv-events-handshakes")
        self._tasks.spawn(replay.count_refused_handshakes("kv-replay", log),
                          name="kv-replay-handshakes")
        log.info("KV events on %s, replay on %s", self.events_addr, self.replay_addr)

    async def close(self) -> None:
        """Stop serving and close both sockets (their monitors first); safe twice, and after a
        failed or no `start()`."""
        replay, live, self._replay, self._live = self._replay, self._live, None, None
        await self._tasks.close()  # (before the sockets: a task on a closed one would fail)
        for end in (replay, live):
            if end is not None:
                end.close()

    # --- live -------------------------------------------------------------------------------------
    def publish(self, events: Sequence[KvEvent]) -> None:
        """One batch of `events`, now: never waits, never raises."""
        live = self._live
        if not events or live is None:
            return
        counts = self.counts
        try:
            payload = encode_batch(EventBatch(time.time(), list(events), self.dp_rank))
        except Exception as e:  # an engine's bad event: it never becomes a batch
            counts.batches_dropped += 1
            return self._warn.warning("a KV event batch could not be encoded: %r", e)
        seq, self._seq = self._seq, self._seq + 1
        self._buffer.append(seq, payload)
        try:
            live.send_nowait((self.topic, seq, payload))
        except ChannelFull as e:  # (the socket is closed)
            counts.batches_dropped += 1
            return self._warn.warning("KV event batch %d dropped (%d so far; replayable): %s",
                                      seq, counts.batches_dropped, e)
        counts.batches_published += 1
        counts.events_published += len(events)


# --- SGLang publishes its own ---------------------------------------------------------------------

_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


def sglang_event_addrs(engine_args: Sequence[str], reach_host: str) -> tuple[str, str]:
    """(events, replay) addresses of the publisher SGLang's own `--kv-events-config` (among the
    flags passed through to it) binds, as other processes reach them ("" where there is none: no
    config, not the zmq publisher, or an endpoint SGLang connects to rather than binds). A
    wildcard host becomes `reach_host`. With data parallelism SGLang adds the rank to each
    port: this is rank 0's."""
    text = ""
    for i, arg in enumerate(engine_args):
        if arg == "--kv-events-config" and i + 1 < len(engine_args):
            text = engine_args[i + 1]
        elif arg.startswith("--kv-events-config="):
            text = arg.split("=", 1)[1]
    try:
        config = json.loads(text) if text else {}
    except ValueError:
        config = {}  # (SGLang refuses it at start, saying why)
    if not isinstance(config, dict) or config.get("publisher") != "zmq":
        return "", ""

    def reached(endpoint: object, bound: bool) -> str:
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            return ""
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host in _WILDCARDS:
            return f"tcp://{transport.url_host(reach_host)}:{port}"
        return endpoint if bound else ""

    events = config.get("endpoint", "tcp://*:5557")
    return reached(events, config.get("bind") is True), reached(config.get("replay_endpoint"), True)
