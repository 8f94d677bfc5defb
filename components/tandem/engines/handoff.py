"""The engine side of disaggregated prefill/decode: the one per-request KV handoff state machine,
used by every engine built on tandem.engines.stepper (mock and reference). See ARCHITECTURE.md,
"Disaggregated prefill/decode".

Decode role (`DecodeHandoff`): reserve -> fetch -> commit. The scheduler admits a request that
carries a bootstrap by *reserving* pages for its whole length (FETCHING); `admitted` then has the
channel fetch the prompt's K/V into them, and `Host.joined` commits the pages and runs the request
from the first token the prefill side sampled. Page quarantine lives here, once: while a fetch is
under way its pages belong to it, and on failure or cancellation they go back to the pool only
when the channel calls `release` (at once if the prefill side said done or died, otherwise after
its transfer deadline: a late write never lands in reused pages). A fetch cancelled before it
began releases at once.

Prefill role (`PrefillHandoff`): prefill -> wait for pages -> write -> done. From submission the
request waits for its decode side's pages (`wait_room`, with the channel's deadline) while the
step computes its prompt and samples the first token (`computed`); then the channel WRITEs the K/V
and the pages stay held until the write has ended, whatever happens to the request meanwhile. The
request ends with one output (the first token, "length"). Any end before the write tells the
decode side at once (`fail`).

Logprobs: a request that asked for them gets its first token's logprobs from the prefill side,
carried with the first token (`KvDone.first_logprobs`), so a PD stream's logprobs are an
aggregated run's. A channel says it carries them with `carries_logprobs = True`; its `send` then
takes `first_logprobs` and its `fetch` returns `(first_token, first_logprobs)`. With a channel that
does not, the engine refuses such requests at submit (tandem.engines.sampling.check_request).

The channels are the socket layer (tandem.kv.bootstrap.decode's PrefillSide and DecodeSide over ZMQ);
anything with the same methods will do, so this machine is tested with in-memory fakes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol, cast

from tandem.engines.scheduler import Sequence
from tandem.kv.bootstrap.decode import DecodeSide, Destination, PrefillSide
from tandem.kv.transfer.movers import KvMover
from tandem.runtime.errors import EngineError, KvHandoffError
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.wire import Bootstrap, TokenLogprobs

log = logging.getLogger("tandem.engine")

Role = Literal["prefill", "decode"]


class Host(Protocol):
    """What the handoff needs from its engine (tandem.engines.stepper.Stepper)."""

    page_bytes: int
    num_pages: int

    def free(self, seq: Sequence) -> None: ...  # its pages are safe to reuse
    def joined(self, seq: Sequence, first: int,  # decode: K/V in place
               logprobs: TokenLogprobs | None = None, cached_tokens: int = 0) -> None: ...
    def written(self, seq: Sequence, first: int,  # prefill: K/V written
                logprobs: TokenLogprobs | None = None) -> None: ...
    def failed(self, seq: Sequence, error: EngineError) -> None: ...  # ends with this error


class PrefillChannel(Protocol):
    @property
    def address(self) -> str: ...
    async def start(self) -> None: ...
    async def wait_room(self, room: int) -> Destination: ...
    def send(self, room: int, dest: Destination, local_pages: Seq[int],
             first_token: int) -> asyncio.Task[KvHandoffError | None]: ...
    def fail(self, room: int, error: str) -> None: ...
    async def close(self) -> None: ...


class LogprobsPrefillChannel(PrefillChannel, Protocol):
    """A prefill channel with `carries_logprobs = True`: KvDone carries the first token's
    logprobs, and the prompt tokens the prefill found cached."""

    def send(self, room: int, dest: Destination, local_pages: Seq[int], first_token: int,
             first_logprobs: TokenLogprobs | None = None, cached_tokens: int = 0
             ) -> asyncio.Task[KvHandoffError | None]: ...


# The first token; with a channel that carries them, its logprobs and the prefill's cached tokens.
First = tuple[int, TokenLogprobs | None, int]
Sampled = tuple[int, TokenLogprobs | None]  # a prefill's first token and its logprobs


class DecodeChannel(Protocol):
    async def fetch(self, bootstrap: Bootstrap, pages: list[int], release: Callable[[], None],
                    skip: int = 0) -> int | First: ...
    async def close(self) -> None: ...


class _State:
    """One request's handoff: its task (until the write starts or the fetch ends), whether the
    task began (a cancelled task that never began cleans up nothing), the first token."""

    __slots__ = ("task", "began", "first")

    def __init__(self, first: asyncio.Future[Sampled] | None = None) -> None:
        self.task: asyncio.Task[None] | None = None
        self.began = False
        self.first = first


class _Handoff:
    role: Role
    address = ""

    def __init__(self, host: Host, channel: object) -> None:
        self.host = host
        self.carries_logprobs = bool(getattr(channel, "carries_logprobs", False))
        self._tasks = TaskGroup()

    def _spawn(self, seq: Sequence, st: _State, coro: Any, on_unstarted: Callable[[], None]) -> None:
        seq.handoff = st
        st.task = self._tasks.spawn(coro, name=f"kv-{self.role} {seq.rid}")
        st.task.add_done_callback(lambda t: on_unstarted() if t.cancelled() and not st.began
                                  else None)

    def cancel(self, seq: Sequence) -> None:
        """The request was cancelled (it gets no more outputs): stop its handoff; its pages come
        back as soon as no transfer can write into them."""
        st: _State | None = seq.handoff
        if st is not None and st.task is not None:
            st.task.cancel()

    def submitted(self, seq: Sequence) -> None:
        """A request was queued (prefill role: its handoff begins now)."""

    def admitted(self, seq: Sequence, prompt_pages: list[int]) -> None:
        """Its pages were reserved (decode role: fetch the K/V into `prompt_pages`)."""

    def computed(self, seq: Sequence, first: int, logprobs: TokenLogprobs | None = None) -> None:
        """Its prompt was computed and `first` sampled (prefill role)."""


class PrefillHandoff(_Handoff):
    role: Role = "prefill"

    def __init__(self, host: Host, channel: PrefillChannel) -> None:
        super().__init__(host, channel)
        self.channel = channel

    async def start(self) -> None:
        await self.channel.start()
        self.address = self.channel.address

    async def close(self) -> None:
        await self._tasks.close()
        await self.channel.close()  # a write still running ends here; its pages come back

    def submitted(self, seq: Sequence) -> None:
        assert seq.bootstrap is not None
        st = _State(asyncio.get_running_loop().create_future())
        room = seq.bootstrap.room
        self._spawn(seq, st, self._prefill(seq, st, room),
                    partial(self._ended, seq, room, "the prefill request was aborted"))

    def computed(self, seq: Sequence, first: int, logprobs: TokenLogprobs | None = None) -> None:
        st: _State = seq.handoff
        assert st.first is not None
        if not st.first.done():
            st.first.set_result((first, logprobs))

    async def _prefill(self, seq: Sequence, st: _State, room: int) -> None:
        st.began = True
        assert st.first is not None
        try:
            dest = await self.channel.wait_room(room)
            first, logprobs = await st.first
        except KvHandoffError as e:
            self.host.failed(seq, e)
            self._ended(seq, room, str(e))
            return
        except asyncio.CancelledError:
            self._ended(seq, room, "the prefill request was aborted")
            raise
        if not self.carries_logprobs:  # (check_request refused requests for logprobs)
            write = self.channel.send(room, dest, list(seq.pages), first)
        else:
            channel = cast(LogprobsPrefillChannel, self.channel)
            write = channel.send(room, dest, list(seq.pages), first, logprobs, seq.cached_tokens)
        write.add_done_callback(partial(self._written, seq, first, logprobs))

    def _ended(self, seq: Sequence, room: int, why: str) -> None:
        """Ended before any write: the decode side learns at once; the pages are ours again."""
        self.channel.fail(room, why)
        self.host.free(seq)

    def _written(self, seq: Sequence, first: int, logprobs: TokenLogprobs | None,
                 write: asyncio.Task[KvHandoffError | None]) -> None:
        error = KvHandoffError("the KV write was stopped: shutting down") if write.cancelled() \
            else write.result()
        if error is None:
            self.host.written(seq, first, logprobs)  # frees the pages too
        else:
            self.host.failed(seq, error)
            self.host.free(seq)


class DecodeHandoff(_Handoff):
    role: Role = "decode"

    def __init__(self, host: Host, channel: DecodeChannel, trusted: bool = True) -> None:
        super().__init__(host, channel)
        self.channel = channel
        self.trusted = trusted  # K/V from its peers may be cached (HandoffConfig.trusted)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        await self._tasks.close()  # cancelled fetches quarantine their pages in the channel...
        await self.channel.close()  # ...which releases them once no write can land

    def admitted(self, seq: Sequence, prompt_pages: list[int]) -> None:
        st = _State()
        self._spawn(seq, st, self._fetch(seq, st, prompt_pages), partial(self.host.free, seq))

    async def _fetch(self, seq: Sequence, st: _State, pages: list[int]) -> None:
        st.began = True  # from here the channel releases the pages on every failure
        assert seq.bootstrap is not None
        try:
            got = await self.channel.fetch(seq.bootstrap, pages, partial(self.host.free, seq),
                                           seq.skip)
        except KvHandoffError as e:
            self.host.failed(seq, e)  # the pages come back when the channel releases them
            return
        first, logprobs, cached = got if isinstance(got, tuple) else (got, None, 0)
        if not self.trusted:  # (written by a peer that did not authenticate: its request's only)
            seq.cacheable = False
        self.host.joined(seq, first, logprobs, cached)


@dataclass(frozen=True)
class HandoffConfig:
    """How to build a worker's side of the handoff over tandem.kv.bootstrap.decode's ZMQ bootstrap."""

    role: Role
    name: str  # this worker's name (its mover's agent name)
    make_mover: Callable[[Any, int, int], KvMover]  # (KV memory, page_bytes, num_pages)
    room_timeout_s: float
    done_timeout_s: float
    transfer_timeout_s: float
    host: str = ""  # prefill: where the bootstrap socket binds
    port: int = 0
    advertise_host: str = ""  # prefill: what decode workers connect to (default: host)
    # decode: whether the peers that write K/V here authenticated (the cluster's keys). K/V from
    # a peer that did not is served to its request alone, never cached for others.
    trusted: bool = True

    def build(self, host: Host, memory: Any) -> PrefillHandoff | DecodeHandoff:
        mover = self.make_mover(memory, host.page_bytes, host.num_pages)
        if self.role == "prefill":
            side = PrefillSide(mover, self.host, self.port, room_timeout_s=self.room_timeout_s,
                               transfer_timeout_s=self.transfer_timeout_s,
                               advertise_host=self.advertise_host)
            return PrefillHandoff(host, side)
        return DecodeHandoff(host, DecodeSide(mover, self.name, done_timeout_s=self.done_timeout_s,
                                              transfer_timeout_s=self.transfer_timeout_s),
                             self.trusted)


Handoff = PrefillHandoff | DecodeHandoff


class HandoffSpec(Protocol):

    def build(self, host: Host, memory: Any) -> Handoff: ...
