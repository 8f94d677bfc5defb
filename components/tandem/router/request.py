"""RequestHandle: one request as the frontend holds it, whether one worker serves it (aggregated:
one leg) or two at once (disaggregated: a prefill leg and a decode leg, the same `Generate` with
`bootstrap` sent to both).

The handle owns the request's one `DeltaCollector`: only the reading leg's deltas (the agg or
decode worker's) reach it. Each leg checks its worker's offsets (a gap or an overlap fails the
request with StreamProtocolError and is counted on the link). A worker's error delta reaches the
reader as it is: its `ErrorKind` is mapped to an HTTP status by the frontend alone. When either leg
fails — a prefill error, a refused delta — the request fails through the collector and every other
unfinished leg is aborted at once. Leaving the handle (`async with`) aborts every leg that has not
finished, so a client that goes away frees its pages on every worker.

Migration. When a leg is lost with its worker (WorkerLost: the connection dropped, or the worker
missed its heartbeat deadline), the request moves: its other legs are aborted and it is placed
again (through the pool's admission, so on surviving workers only; for PD a new prefill + decode
pair and a new room) as the prompt followed by every completion token already delivered, with
`max_tokens` (and `min_tokens`) reduced by their number, the same sampling and seed, a fresh leg
id, and `Generate.resume_offset` telling the engine how many prompt ids are completion tokens (so
seeded draws and penalties see the same positions as an unbroken run). The new leg's offsets
start at 0 and are shifted by what was delivered before the collector sees them, so the client's
stream goes on with no gap and no duplicate. A request moves at most `max_migrations` times, then
fails with WorkerLost. Errors a worker reports (an error delta: bad request, engine failure, KV
transfer) are never migrated: only the loss of the worker is.

Deadline. Every request has an end-to-end deadline (`timeout_s` from entry): past it, a request
that has not finished fails with DeadlineExceeded (504) and its legs are aborted, whatever it was
waiting for (a worker that never answers, a lost Generates, a migration).

Entering waits for placement (the pool's admission queue); placement itself is synchronous
(`start`), so the router places a request in one step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from tandem.router.accounting import Share
from tandem.runtime import errors, timeline
from tandem.runtime.collector import DeltaCollector
from tandem.runtime.lifecycle import running_loop
from tandem.runtime.metrics import Registry
from tandem.runtime.wire import Bootstrap, Delta, ErrorKind, Generate, SamplingParams, Usage

if TYPE_CHECKING:
    from tandem.config import RouterConfig

log = logging.getLogger("tandem.router")


class WorkerLink(Protocol):
    """What a request needs of the link to a worker its legs are placed on (tandem.router.link's
    WorkerLink, which imports this module: the dependency goes one way)."""

    address: str
    protocol_errors: int

    def start(self, leg: Leg, msg: Generate) -> None: ...

    def end(self, leg: Leg, abort: bool) -> None: ...


class DeadlineExceeded(errors.TandemError):
    """The request did not finish within its end-to-end deadline."""

    status = 504
    type = "timeout"
    code = "request_timeout"


class RequestOptions:
    """What every request of one pool shares: its limits (the router's flags), and the counters
    they move."""

    __slots__ = ("max_migrations", "timeout_s", "migrations", "deadlines")

    def __init__(self, router: RouterConfig, registry: Registry) -> None:
        self.max_migrations = router.max_migrations
        self.timeout_s = router.request_timeout_s  # 0 = no deadline
        r = registry
        self.migrations = r.counter(
            "tandem_request_migrations_total",
            "Requests moved to another worker after theirs was lost mid-request.")
        self.deadlines = r.counter(
            "tandem_request_deadline_exceeded_total",
            "Requests ended because they passed their end-to-end deadline.")


# A worker's error kinds that move a request (to other workers, within --max-migrations) instead
# of failing it, with what the move says of them.
_MOVED = {ErrorKind.DRAINING: "shutting down", ErrorKind.KV_TRANSFER: "the KV handoff failed"}


class Leg(Share):
    """The request on one worker. `reads`: its deltas are the client's (agg or decode)."""

    __slots__ = ("handle", "link", "rid", "reads", "received", "finished", "over", "base")

    def __init__(self, handle: RequestHandle, link: WorkerLink, reads: bool, rid: str,
                 base: int = 0) -> None:
        super().__init__()
        self.handle: RequestHandle | None = handle  # None once released
        self.link = link
        self.rid = rid
        self.reads = reads
        self.received = 0
        self.base = base  # completion tokens delivered before this leg (by legs that were lost)
        self.finished = False  # the worker sent the last delta: nothing to abort
        self.over = False  # no more deltas are taken (finished, or failed)

    def on_delta(self, d: Delta) -> bool:
        """Take one delta from the link; True when it was the leg's last (the worker ended it)."""
        h = self.handle
        if self.over or h is None:
            return False
        if d.offset != self.received:
            self.over = True  # unfinished: it is aborted on the worker
            self.link.protocol_errors += 1
            h.leg_failed(self, errors.StreamProtocolError(
                f"delta for {self.rid} at offset {d.offset}, expected {self.received}"))
            return False
        self.received += len(d.token_ids)
        fin = d.finish_reason
        if fin is not None:
            if fin == "error" and d.error_kind in _MOVED:
                # The worker is shutting down (it refused the request, or its drain deadline ended
                # it): a graceful restart moves the request like a crash would. Or its KV did not
                # come (the prefill worker died, which its own link may not have seen yet): a new
                # pair serves it, as when the prefill worker's loss is seen first.
                self.over = True  # (it ended there: nothing to abort)
                why = f"worker {self.link.address}: {_MOVED[d.error_kind]} ({d.error})"
                if self.reads and d.token_ids:  # (tokens merged into its last delta)
                    h.tokens += d.token_ids
                    d = msgspec.structs.replace(d, finish_reason=None, usage=None, error="",
                                                error_kind=None)
                    h.collector.put(h.shifted(d, self.base) if self.base else d)
                h.leg_failed(self, errors.WorkerLost(why, retry_after=1.0))
                return True
            self.over = self.finished = True
        if self.reads:
            h.tokens += d.token_ids
            if self.base:
                d = h.shifted(d, self.base)
            h.collector.put(d)
        elif fin == "error":
            h.prefill_failed(d)
        return fin is not None

    def on_lost(self, err: errors.TandemError) -> None:
        """The link dropped the leg (worker lost, or the request could not be sent)."""
        if not self.over and self.handle is not None:
            self.over = True
            self.handle.leg_failed(self, err)


class RequestHandle:
    __slots__ = ("rid", "prompt_ids", "sampling", "collector", "legs", "tokens", "migrations",
                 "options", "session", "salt", "cached_hint", "tenant", "priority", "_admit",
                 "_admit_now", "_timer", "_moving", "_left")

    def __init__(self, rid: str, prompt_ids: list[int], sampling: SamplingParams,
                 admit: Callable[[RequestHandle], Awaitable[Any]], options: RequestOptions,
                 admit_now: Callable[[RequestHandle], Any] | None = None) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.collector = DeltaCollector()
        self.legs: tuple[Leg, ...] = ()
        self.tokens: list[int] = []  # completion tokens delivered to the collector, in order
        self.migrations = 0
        self.options = options
        self.session = ""  # the conversation it belongs to (the kv policy's preference)
        self.salt = ""  # its cache salt (Generate.cache_salt; the kv policy's keys are rooted there)
        self.cached_hint = 0  # prompt tokens the policy expects its prefill worker to have cached
        self.tenant = ""  # who sent it (tandem.frontend.tenants) and its priority (lower first)
        self.priority = 0
        self._admit = admit
        self._admit_now = admit_now  # admit's no-wait path: placed, or None
        self._timer: asyncio.TimerHandle | None = None
        self._moving: asyncio.Task[None] | None = None  # placing it again after a lost worker
        self._left = False  # released: nothing more is placed

    @property
    def received(self) -> int:
        """Completion tokens the client's legs received (every leg, lost ones included)."""
        return len(self.tokens)

    @property
    def placed(self) -> bool:
        return bool(self.legs)

    @property
    def workers(self) -> tuple[str, ...]:
        """The addresses of the workers serving it: (reader,) or (decode, prefill)."""
        return tuple(leg.link.address for leg in self.legs)

    async def __aenter__(self) -> RequestHandle:
        self._arm()
        if not self.legs:
            await self._admit(self)
        return self

    def enter_now(self) -> bool:
        """Place the request at once if the pool can without waiting, so that its Generate leaves
        with this loop pass's others; entering then only returns it. False: not placed (entering
        waits in line, or raises why it cannot be placed). Leave it (`release`) like an entered
        one."""
        if not self.legs and self._admit_now is not None and not self._left:
            try:
                self._admit_now(self)
            except errors.TandemError:
                return False  # (entering meets the same refusal, and raises it)
        if self.legs:
            self._arm()
        return bool(self.legs)

    def _arm(self) -> None:
        timeout = self.options.timeout_s
        if self._timer is None and timeout > 0 and not self._left:
            self._timer = running_loop().call_later(timeout, self._expire)

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def start(self, reader: WorkerLink, prefill: WorkerLink | None = None,
              bootstrap: Bootstrap | None = None) -> None:
        """Place the request: on `reader` alone, or on `reader` (decode) and `prefill` with
        `bootstrap`. Synchronous; if the second leg cannot start the first is undone. A request
        that moved is placed as its prompt plus what was delivered (see the module docstring)."""
        done = len(self.tokens)
        rid = self.rid if not self.migrations else f"{self.rid}.{self.migrations}"
        if done or self.migrations:
            sp = self.sampling
            sp = msgspec.structs.replace(sp, max_tokens=sp.max_tokens - done,
                                         min_tokens=max(0, sp.min_tokens - done))
            msg = Generate(rid, self.prompt_ids + self.tokens, sp, bootstrap, done,
                           self.tenant, self.priority, self.salt)
        else:
            msg = Generate(rid, self.prompt_ids, self.sampling, bootstrap, 0, self.tenant,
                           self.priority, self.salt)
        first = Leg(self, reader, True, rid, done)
        if timeline.ON:
            timeline.mark("placed", rid)
        reader.start(first, msg)
        if prefill is None:
            self.legs = (first,)
            return
        second = Leg(self, prefill, False, rid, done)
        try:
            prefill.start(second, msg)
        except BaseException:
            reader.end(first, abort=True)
            raise
        self.legs = (first, second)

    def release(self) -> None:
        """Abort every leg that has not finished, stop any move and the deadline. Safe twice."""
        self._left = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._moving is not None:
            self._moving.cancel()
            self._moving = None
        for leg in self.legs:  # (kept afterwards, for `received` and `workers`)
            if not leg.finished:
                leg.over = True
                leg.link.end(leg, abort=True)
            leg.handle = None  # over: it takes nothing more (and the request is freed at once)

    def shifted(self, d: Delta, base: int) -> Delta:
        """A moved request's delta as the client's stream counts: offsets after what earlier
        legs delivered; usage as if one worker had served it all."""
        u = d.usage
        if u is not None:
            u = Usage(len(self.prompt_ids), u.completion_tokens + base, u.cached_tokens)
        return msgspec.structs.replace(d, rid=self.rid, offset=d.offset + base, usage=u)

    def leg_failed(self, leg: Leg, err: errors.TandemError) -> None:
        if not leg.reads:
            err = type(err)(f"prefill failed: {err.message}", param=err.param,
                            retry_after=err.retry_after)
        if isinstance(err, errors.WorkerLost):
            refused = self._migrate(err)
            if refused is None:
                return
            err = refused
        self.collector.fail(err)
        self._abort_others(leg)

    def prefill_failed(self, d: Delta) -> None:
        """The prefill worker ended the request with an error: the client sees it, with its
        kind, as if the decode worker had sent it; the decode leg is aborted."""
        reader = self.legs[0] if self.legs else None
        if reader is None or reader.over:
            return
        self.collector.put(Delta(self.rid, len(self.tokens), [], "error", None,
                                 f"prefill failed: {d.error or 'the engine failed'}",
                                 d.error_kind or ErrorKind.ENGINE, error_param=d.error_param))
        self._abort_others(None)

    def _abort_others(self, failed: Leg | None) -> None:
        for leg in self.legs:
            if leg is not failed and not leg.over:
                leg.over = True
                leg.link.end(leg, abort=True)

    # --- migration and the deadline ---------------------------------------------------------------
    def _migrate(self, err: errors.TandemError) -> errors.TandemError | None:
        """Move the request off a lost worker: None, or the error it fails with instead (`err`
        is shared by every request the worker held: never changed, a new one says more)."""
        if self._left or self.collector.failed or any(leg.reads and leg.finished
                                                      for leg in self.legs):
            return err
        if self.migrations >= self.options.max_migrations:
            return errors.WorkerLost(f"{err.message}; the request was already moved "
                                     f"{self.migrations} time(s), the most allowed",
                                     retry_after=err.retry_after)
        self._abort_others(None)
        self.legs = ()
        self.migrations += 1
        self.options.migrations.inc()
        done = len(self.tokens)
        log.info("request %s: %s; moving it with %d token(s) delivered (move %d)", self.rid,
                 err.message, done, self.migrations)
        if done >= self.sampling.max_tokens:  # every token arrived, only the finish was lost
            self.collector.put(Delta(self.rid, done, [], "length",
                                     Usage(len(self.prompt_ids), done)))
            return None
        self._moving = asyncio.get_running_loop().create_task(self._place_again(err))
        return None

    async def _place_again(self, lost: errors.TandemError) -> None:
        try:
            await self._admit(self)
        except errors.TandemError as e:
            self.collector.fail(errors.WorkerLost(
                f"{lost.message}; no worker could take the request over: {e.message}",
                retry_after=e.retry_after))
        finally:
            if self._moving is asyncio.current_task():
                self._moving = None

    def _expire(self) -> None:
        self._timer = None
        if self._left or self.collector.failed or any(leg.reads and leg.finished
                                                      for leg in self.legs):
            return
        self.options.deadlines.inc()
        if self._moving is not None:
            self._moving.cancel()
            self._moving = None
        self.collector.fail(DeadlineExceeded(
            f"The request did not finish within {self.options.timeout_s:g}s "
            "(--request-timeout)."))
        self._abort_others(None)
