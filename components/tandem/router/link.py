"""WorkerLink: the frontend's connection to one worker, as a state machine over a `Channel`.

The link owns the protocol with one worker and nothing else:
- the handshake: a Hello every heartbeat until the worker answers; a refused one makes the link
  `incompatible` for good. An unanswered handshake is logged once as unreachable: after the
  heartbeat deadline for a worker that was up, after `start_timeout_s` for one still starting. A
  connection whose security handshake failed (ZMQ says so: the keys differ) is logged at once,
  once per reason until the worker answers, and the unreachable line names it too;
- liveness: a worker silent past the heartbeat deadline, or whose connection drops (the channel's
  `disconnects()`), is marked down at once and every request on it fails with WorkerLost (which
  moves them to other workers: tandem.router.request); it comes back up when it answers a Hello
  again. Any message counts as a sign of life (deltas, not only load reports), so does one waiting
  unread, and silence is measured on this loop's own time: when a heartbeat tick comes late (the
  frontend's loop was blocked), the lateness is not counted against the worker;
- requests: the legs placed on it (tandem.router.request), routed their deltas; the Generates of the
  legs placed during one event loop pass leave as ONE `Generates` message, and a leg placed and
  ended within that pass never leaves at all; the legs it must abort in a pass leave as one `Abort`
  (tandem.runtime.passes);
- credit: after the deltas of each `Deltas` message were handed to their requests, one `Credit` per
  loop pass tells the worker how many messages it may send on (its outbox window);
- accounting (tandem.router.accounting): what each leg adds to the worker's counts;
- load: the last load report, and `query_load()` with a deadline.

Inputs are plain calls (`on_message`, `on_disconnected`, `tick`, `start`, `end`), time comes from an
injected `clock`, and "the end of this loop pass" from an injected `defer`, so tests drive the link
through a MemoryChannel without sockets or sleeps. `connect()` starts the three tasks that feed it
from the channel (receive, heartbeat, disconnects), supervised: if one dies, the process goes down.
A message the link fails on is dropped and counted (tandem.runtime.channel.serve), as on a worker.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import logging
import time
from collections.abc import Callable

from tandem.router.accounting import FailureStreak, WorkerAccount
from tandem.router.request import Leg
from tandem.runtime import errors, wire
from tandem.runtime.channel import Channel, ChannelFull, serve
from tandem.runtime.config import HEARTBEAT_DEADLINE_S, HEARTBEAT_INTERVAL_S, LOAD_QUERY_TIMEOUT_S
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.passes import PassBatcher
from tandem.runtime.wire import (Abort, Credit, Deltas, ErrorKind, Generate, Generates, Hello,
                                 HelloReply, Load, LoadQuery, LoadReport, Prefills, WorkerInfo)

log = logging.getLogger("tandem.router")

WorkerChannel = Channel[wire.Message, wire.ToFrontend]


_KEYS = ": this frontend and the worker likely hold different --auth-keys (or one has none)"


def _nothing() -> None:
    pass


class WorkerLink:
    def __init__(self, address: str, frontend_id: str, channel: WorkerChannel, *,
                 clock: Callable[[], float] = time.monotonic,
                 defer: Callable[[Callable[[], None]], None] | None = None,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 heartbeat_deadline_s: float = HEARTBEAT_DEADLINE_S,
                 start_timeout_s: float | None = None,
                 load_query_timeout_s: float = LOAD_QUERY_TIMEOUT_S) -> None:
        self.address = address
        self.frontend_id = frontend_id
        self.channel = channel
        self.clock = clock
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_deadline_s = heartbeat_deadline_s
        # How long a worker that never answered may take to start before it is called unreachable
        # (one that was up: the heartbeat deadline). Starting is not an alarm.
        self.start_timeout_s = heartbeat_deadline_s if start_timeout_s is None else start_timeout_s
        self.load_query_timeout_s = load_query_timeout_s
        self.info: WorkerInfo | None = None
        self.state = "connecting"  # connecting | up | down | incompatible
        self.error = ""
        self.load = Load()
        self.legs: dict[str, Leg] = {}
        self.account = WorkerAccount()
        self.streak = FailureStreak()  # requests it failed in a row (placement passes it over)
        self.on_capacity: Callable[[], None] = _nothing
        self.on_up: Callable[[WorkerLink], None] = lambda link: None  # each accepted handshake
        self.protocol_errors = 0  # deltas refused for a gap or an overlap
        self.last_seen = 0.0
        self._asking_since: float | None = None  # handshake unanswered since (said once)
        self.security_error = ""  # why the last security handshake failed, until one succeeds
        # This loop pass's: legs placed (not yet sent), legs to abort, Deltas messages handed to
        # their requests (to credit back).
        self._placed: PassBatcher[tuple[Leg, Generate]] = PassBatcher(self._send_placed, defer)
        self._aborts: PassBatcher[str] = PassBatcher(self._send_aborts, defer)
        self._credits: PassBatcher[None] = PassBatcher(self._give_credit, defer)
        self._seq = itertools.count(1)
        self._queries: dict[int, asyncio.Future[Load]] = {}
        self._up = asyncio.Event()
        self._tasks = TaskGroup(supervised=True)

    # --- what a routing policy reads (tandem.router.policy.Candidate) ----------------------------
    @property
    def usable(self) -> bool:
        return self.state == "up"

    @property
    def num_in_flight(self) -> int:
        return self.account.num_in_flight

    @property
    def pending_prefill_tokens(self) -> int:
        return self.account.pending_prefill_tokens

    @property
    def active_decode_tokens(self) -> int:
        return self.account.active_decode_tokens

    # --- running ----------------------------------------------------------------------------------
    async def connect(self) -> None:
        """Start feeding the link from its channel (and saying Hello)."""
        self._tasks.spawn(self._receive(), name=f"recv {self.address}")
        self._tasks.spawn(self._heartbeat(), name=f"heartbeat {self.address}")
        self._tasks.spawn(self._watch(), name=f"disconnects {self.address}")

    async def wait_up(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        self._fail_all(errors.Unavailable("the frontend is shutting down"))
        await self._tasks.close()
        self.channel.close()

    async def _receive(self) -> None:
        await serve(self.channel, self.on_message, "frontend", log)

    async def _heartbeat(self) -> None:
        late = 0.0
        while True:
            self.tick(late)
            woke = self.clock() + self.heartbeat_interval_s
            await asyncio.sleep(self.heartbeat_interval_s)
            late = max(0.0, self.clock() - woke)  # how long this loop could not run us

    async def _watch(self) -> None:
        async for why in self.channel.disconnects():
            self.on_disconnected(why)

    # --- inputs -----------------------------------------------------------------------------------
    def tick(self, late: float = 0.0) -> None:
        """One heartbeat: Hello until the handshake succeeds; then a load query, or down when the
        worker has been silent past the deadline. `late`: seconds this tick came after it was due
        (the loop was blocked); they are not counted as the worker's silence."""
        now = self.clock()
        if late > 0:
            self.last_seen += late
        if self.state == "up":
            if self.channel.unread():  # its messages wait for us: we are behind, it is not silent
                self.last_seen = now
            if now - self.last_seen > self.heartbeat_deadline_s:
                self._mark_down(f"silent for over {self.heartbeat_deadline_s:g}s")
            else:
                self._send_quietly(LoadQuery(0))
        if self.state in ("connecting", "down"):
            allowed = self.heartbeat_deadline_s if self.info is not None else self.start_timeout_s
            if self._asking_since is None:
                self._asking_since = now
            elif now - self._asking_since > allowed:
                log.warning("worker %s is unreachable: no answer to the handshake for %gs "
                            "(still trying)%s", self.address, now - self._asking_since,
                            f"; its connection's {self.security_error}{_KEYS}"
                            if self.security_error else "")
                self._asking_since = math.inf  # said once, until it answers
            self._send_quietly(Hello(wire.PROTOCOL_VERSION, self.frontend_id))
        else:
            self._asking_since = None

    def on_message(self, msg: wire.ToFrontend) -> None:
        self.last_seen = self.clock()
        if isinstance(msg, Deltas):
            self.on_deltas(msg)
        elif isinstance(msg, LoadReport):
            self.on_load(msg)
        elif isinstance(msg, HelloReply):
            self.on_hello(msg)

    def on_deltas(self, msg: Deltas) -> None:
        """Route each delta to its leg and account for it: the one loop over a step's deltas."""
        if msg.load is not None:
            self.load = msg.load
        legs, account = self.legs, self.account
        for d in msg.items:
            leg = legs.get(d.rid)
            if leg is None:
                continue  # ended here already (aborted; its last deltas were in flight)
            account.progress(leg, len(d.token_ids))
            if leg.on_delta(d):  # its last: the worker ended it, nothing to abort
                del legs[d.rid]
                account.close(leg)
                if d.finish_reason != "error":
                    self.streak.served()
                elif d.error_kind in (ErrorKind.ENGINE, ErrorKind.KV_TRANSFER):
                    self.streak.failed(self.clock())
        self._credits.add(None)  # credited at the pass's end, after the requests took them
        self.on_capacity()

    def on_load(self, msg: LoadReport) -> None:
        self.load = msg.load
        fut = self._queries.get(msg.seq)
        if fut is not None and not fut.done():
            fut.set_result(msg.load)
        self.on_capacity()

    def on_hello(self, msg: HelloReply) -> None:
        if not msg.ok or msg.info is None:
            self.state, self.error = "incompatible", msg.error
            log.error("worker %s refused the handshake: %s", self.address, msg.error)
            return
        if self.state != "up":
            log.info("worker %s is up: %s %s", self.address, msg.info.role, msg.info.engine)
        self.info, self.security_error = msg.info, ""
        self.state = "up"
        self._up.set()
        self.on_up(self)
        self.on_capacity()

    def on_disconnected(self, why: str = "") -> None:
        """The connection dropped: the worker process is gone or restarted (forgetting its
        requests); fail them now rather than after the heartbeat deadline. `why`: its security
        handshake failed, and why (the worker is there but the keys differ: said at once)."""
        if why and why != self.security_error:
            log.warning("worker %s: %s%s (still trying)", self.address, why, _KEYS)
        self.security_error = why or self.security_error
        self._mark_down(why or "connection closed")

    # --- requests ---------------------------------------------------------------------------------
    def start(self, leg: Leg, msg: Generate) -> None:
        """Place a leg here; its Generate leaves with the others of this loop pass."""
        if not self.usable:
            raise errors.Unavailable(f"worker {self.address} is {self.state}", retry_after=1.0)
        self._placed.add((leg, msg))
        self.legs[leg.rid] = leg
        role = self.info.role if self.info is not None else "agg"
        h = leg.handle
        self.account.open(leg, role, len(msg.prompt_ids), h.cached_hint if h is not None else 0,
                          msg.tenant)

    def end(self, leg: Leg, abort: bool) -> None:
        """The leg leaves (its request was left, or failed elsewhere). Safe twice."""
        if self.legs.get(leg.rid) is not leg:
            return
        del self.legs[leg.rid]
        self.account.close(leg)
        if self._placed.remove_if(lambda item: item[0] is leg):
            abort = False  # it never left: nothing to abort
        if abort and self.state == "up":
            self._aborts.add(leg.rid)
        self.on_capacity()

    def _send_placed(self, placed: list[tuple[Leg, Generate]]) -> None:
        """Send what was placed in this loop pass, as one message."""
        try:
            self._send(Generates([msg for _, msg in placed]))
        except errors.Unavailable as e:  # past the high-water mark: the worker is not reading
            for leg, _ in placed:
                if self.legs.get(leg.rid) is leg:
                    del self.legs[leg.rid]
                    self.account.close(leg)
                    leg.on_lost(e)
            self.on_capacity()

    def _send_aborts(self, rids: list[str]) -> None:
        if self.state == "up":
            self._send_quietly(Abort(rids))

    def announce(self, prefills: list[str]) -> None:
        """Tell a decode worker the prefill workers (bootstrap host:port) this frontend uses: it
        fetches KV only from those (before any Generate naming one: the channel keeps order)."""
        self._send_quietly(Prefills(prefills))

    async def query_load(self) -> Load:
        """Ask the worker for its load now (with a deadline); the last known on timeout."""
        if not self.usable:
            return self.load
        seq = next(self._seq)
        fut: asyncio.Future[Load] = asyncio.get_running_loop().create_future()
        self._queries[seq] = fut
        try:
            self._send(LoadQuery(seq))
            return await asyncio.wait_for(fut, self.load_query_timeout_s)
        except (asyncio.TimeoutError, errors.Unavailable):
            return self.load
        finally:
            self._queries.pop(seq, None)

    # --- internals --------------------------------------------------------------------------------
    def _send(self, msg: wire.Message) -> None:
        try:
            self.channel.send_nowait(msg)
        except ChannelFull:
            raise errors.Unavailable(f"worker {self.address} is not keeping up",
                                     retry_after=1.0) from None

    def _send_quietly(self, msg: wire.Message) -> None:
        if self.channel.closed:  # (the frontend is stopping)
            return
        try:
            self._send(msg)
        except errors.Unavailable:
            pass

    def _give_credit(self, messages: list[None]) -> None:
        self._send_quietly(Credit(len(messages)))

    def _fail_all(self, err: errors.TandemError) -> None:
        self._placed.clear()
        self._aborts.clear()
        legs, self.legs = self.legs, {}
        for leg in legs.values():
            self.account.close(leg)
            leg.on_lost(err)
        self.on_capacity()

    def _mark_down(self, why: str) -> None:
        if self.state == "up":
            log.warning("worker %s is down: %s", self.address, why)
        if self.state != "incompatible":
            self.state = "down"
        self._up.clear()
        self._fail_all(errors.WorkerLost(f"worker {self.address} stopped answering ({why})"))
