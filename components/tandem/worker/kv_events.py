"""A worker's KV event publisher (ARCHITECTURE.md, "KV events"): the engine's BlockStored /
BlockRemoved / AllBlocksCleared batches on a ZMQ PUB socket, in the format every router reads
(tandem.runtime.kv_events), with a replay ROUTER socket holding the last `buffer_steps` batches.

`publish(events)` is what a tandem engine's `on_kv_events` is set to: it is called on the event
loop after each engine step that produced events, and never waits. It gives the batch the next
sequence number (from 0), keeps it in the replay buffer and offers it to the PUB socket without
blocking. The PUB socket refuses a batch (counted in `batches_dropped`) instead of dropping it
silently for one subscriber (ZMQ_XPUB_NODROP): when a subscriber's queue is full (`hwm` batches
it has not read, 100,000 by default), no subscriber gets that batch. Its sequence number is
spent and it stays in the replay buffer, so every consumer sees the gap and gets it back by
replay. (The price: one subscriber that stops reading makes the others replay what they miss;
TCP keepalive ends a dead subscriber's connection within about a minute.)

The replay socket answers `[identity, b"", start_seq]` with every buffered batch whose seq >=
start_seq, then the end marker, in SGLang 0.5.23's form (`[topic, seq, payload]`, then `[b"",
END, b""]`, after identity and delimiter): a replayed batch is the live stream's three frames.
A request for a batch no longer buffered gets what is there, from the oldest: the consumer sees
the gap. Requests are served from the socket's descriptor callback on the event loop (no task),
at most REQUESTS_PER_PASS per loop pass; a malformed one is counted in `transport.protocol_errors`
("kv-replay", ...) and dropped.

Both sockets bind on the worker's `--host` (port 0: the OS picks one when it binds) and are
advertised on its `--advertise-host` in the handshake (`WorkerInfo.kv_events_addr`,
`kv_replay_addr`). With the cluster's keys both are CURVE servers, like the worker's other
sockets (a subscriber needs the keys), each with a monitor from before it binds that counts
failed handshakes; without keys they bind only on loopback.

For `--engine sglang`, tandem publishes nothing: SGLang's own `--kv-events-config` (passed
through) publishes the same format, and `sglang_event_addrs` reads where, for the handshake.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from tandem.runtime import auth, transport
from tandem.runtime.kv_events import (
    REPLAY_END, EventBatch, KvEvent, KvEventsError, encode_batch, live_frames,
    parse_replay_request, seq_frame,
)
from tandem.runtime.lifecycle import TaskGroup

log = logging.getLogger("tandem.worker.kv_events")

HWM = 100_000  # batches a subscriber may have unread before the PUB socket refuses more
BUFFER_STEPS = 10_000  # batches the replay socket holds
REQUESTS_PER_PASS = 16  # replay requests served per event loop pass
MAX_REQUEST_BYTES = 1024  # a replay request frame is at most this long (it needs 8 bytes)
_KEEPALIVE = ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, 30), (zmq.TCP_KEEPALIVE_INTVL, 10),
              (zmq.TCP_KEEPALIVE_CNT, 3))


@dataclass(slots=True)
class KvEventCounts:
    """What the worker's /metrics reports (tandem.worker.metrics), read at scrape time."""

    events_published: int = 0  # events in the batches the PUB socket took
    batches_published: int = 0
    batches_dropped: int = 0  # refused by the PUB socket (still replayable), or not encodable
    replay_requests: int = 0
    batches_replayed: int = 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bind(kind: int, host: str, port: int, keys: auth.ClusterKeys | None,
          options: Sequence[tuple[int, int]]) -> transport.Socket:
    """A socket of `kind` bound at tcp://host:port (0: a port the OS picks), with a monitor
    counting failed handshakes from before it binds, CURVE when the cluster has keys, and
    `options` (set before it binds: ZMQ gives the connections it accepts the options it had
    then)."""
    address = f"tcp://{_url_host(host)}:{port or '*'}"
    auth.require_for(address, keys)
    sock = transport.context().socket(kind, socket_class=transport.Socket)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.watcher = transport.Monitor(sock, transport.REFUSALS)
        if keys is not None:
            auth.make_server(sock, keys)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        for option, value in (*_KEEPALIVE, (zmq.MAXMSGSIZE, MAX_REQUEST_BYTES), *options):
            sock.setsockopt(option, value)
        sock.bind(address)
    except BaseException:
        transport.close(sock)
        raise
    return sock


def _port_of(sock: zmq.Socket) -> int:
    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


class KvEventPublisher:
    def __init__(self, host: str, port: int = 0, replay_port: int = 0, *,
                 advertise_host: str = "", keys: auth.ClusterKeys | None = None,
                 topic: bytes = b"", dp_rank: int = 0, hwm: int = HWM,
                 buffer_steps: int = BUFFER_STEPS) -> None:
        """Binds nothing yet: `start()` does (on the event loop)."""
        self.host, self.port, self.replay_port = host, port, replay_port
        self.advertise_host = advertise_host or host
        self.keys, self.topic, self.dp_rank, self.hwm = keys, topic, dp_rank, hwm
        self.counts = KvEventCounts()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0  # the next batch's
        self._pub: transport.Socket | None = None
        self._replay: transport.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1  # the replay socket's descriptor, while the loop watches it
        self._tasks = TaskGroup()  # the handshake counters
        self._last_log = 0.0

    @property
    def events_addr(self) -> str:
        """Where subscribers connect (advertised host, bound port); "" before `start()`."""
        return f"tcp://{_url_host(self.advertise_host)}:{self.port}" if self._pub else ""

    @property
    def replay_addr(self) -> str:
        return f"tcp://{_url_host(self.advertise_host)}:{self.replay_port}" if self._replay else ""

    @property
    def next_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        """Bind both sockets (AuthError beyond loopback without keys; ZMQError if a port is
        taken) and serve replay requests from now on."""
        # The PUB socket refuses a batch (counted) rather than drop it silently for one peer.
        self._pub = _bind(zmq.PUB, self.host, self.port, self.keys,
                          ((zmq.SNDHWM, self.hwm), (zmq.XPUB_NODROP, 1)))
        self.port = _port_of(self._pub)
        # A replay to a gone or full peer raises (ROUTER_MANDATORY): its answer stops there.
        whole = max(self.hwm, (self._buffer.maxlen or 0) + 1)  # room for a whole answer
        self._replay = replay = _bind(zmq.ROUTER, self.host, self.replay_port, self.keys, (
            (zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, whole), (zmq.RCVHWM, 1000)))
        self.replay_port = _port_of(replay)
        self._loop = asyncio.get_running_loop()
        self._fd = int(replay.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._on_readable)
        self._tasks.spawn(transport.count_refused_handshakes(self._pub, "kv-events", log),
                          name="kv-events-handshakes")
        self._tasks.spawn(transport.count_refused_handshakes(replay, "kv-replay", log),
                          name="kv-replay-handshakes")
        self._loop.call_soon(self._on_readable)  # (a request that came before the reader)
        log.info("KV events on %s, replay on %s", self.events_addr, self.replay_addr)

    async def close(self) -> None:
        """Stop serving and close both sockets (their monitors first); safe twice, and after a
        failed or no `start()`."""
        replay, pub, self._replay, self._pub = self._replay, self._pub, None, None
        if self._fd >= 0 and self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._fd = -1
        await self._tasks.close()
        for sock in (replay, pub):
            if sock is not None:
                transport.close(sock)

    # --- live -------------------------------------------------------------------------------------
    def publish(self, events: Sequence[KvEvent]) -> None:
        """One batch of `events`, now: never waits, never raises."""
        pub = self._pub
        if not events or pub is None:
            return
        counts = self.counts
        try:
            payload = encode_batch(EventBatch(time.time(), list(events), self.dp_rank))
        except Exception as e:  # an engine's bad event: it never becomes a batch
            counts.batches_dropped += 1
            return self._warn(f"a KV event batch could not be encoded: {e!r}")
        seq, self._seq = self._seq, self._seq + 1
        self._buffer.append((seq, payload))
        try:
            pub.send_multipart(live_frames(self.topic, seq, payload), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EAGAIN: a subscriber's queue is full (it stays replayable)
            counts.batches_dropped += 1
            return self._warn(f"KV event batch {seq} dropped ({counts.batches_dropped} so far; "
                              f"replayable): {e}")
        counts.batches_published += 1
        counts.events_published += len(events)

    def _warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= 1.0:
            self._last_log = now
            log.warning("%s", what)

    # --- replay -----------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        """Serve the requests waiting (at most REQUESTS_PER_PASS, then the next pass). ZMQ's
        descriptor is edge-triggered and our own sends may take its signal: the loop stops only
        after ZMQ_EVENTS (which re-arms it) said nothing waits."""
        sock = self._replay
        for _ in range(REQUESTS_PER_PASS):
            if sock is None or sock.closed or not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            self._serve(frames)
        if self._loop is not None:
            self._loop.call_soon(self._on_readable)

    def _serve(self, frames: list[bytes]) -> None:
        try:
            ident, start = parse_replay_request(frames)
        except KvEventsError as e:
            return transport.refused("kv-replay", "bad replay request", log, e)
        sock = self._replay
        assert sock is not None
        self.counts.replay_requests += 1
        buffer, sent = self._buffer, 0
        skip = max(0, start - buffer[0][0]) if buffer else 0  # (the buffer's seqs are consecutive)
        try:
            for seq, payload in itertools.islice(buffer, skip, None):
                sock.send_multipart([ident, b"", *live_frames(self.topic, seq, payload)],
                                    zmq.NOBLOCK)
                sent += 1
            sock.send_multipart([ident, b"", *REPLAY_END], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the peer is gone (EHOSTUNREACH) or not reading (EAGAIN)
            transport.refused("kv-replay", "replay cut short", log, f"{ident!r}: {e}")
        self.counts.batches_replayed += sent


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
            return f"tcp://{_url_host(reach_host)}:{port}"
        return endpoint if bound else ""

    events = config.get("endpoint", "tcp://*:5557")
    return reached(events, config.get("bind") is True), reached(config.get("replay_endpoint"), True)
