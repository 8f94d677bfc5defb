"""WorkerPool: the frontend's view of every worker, and placement — which worker(s) serve a request.

Workers announce their role in the handshake. With usable prefill and decode workers a request is
served disaggregated (a prefill and a decode leg, a fresh 63-bit room); otherwise by one aggregated
worker. Within a role the workers that can take the request (usable, under the per-worker limits of
RouterConfig, enough free pages in their last report: tandem.router.accounting) are offered to the
routing policy (tandem.router.policy). `open()` raises Unavailable (HTTP 503) at once when no worker
(or pair) is usable; otherwise it returns a RequestHandle (tandem.router.request), which on entry is
placed at once or waits for capacity in the bounded AdmissionQueue (503 when full or past the
deadline). The connections themselves are WorkerLinks (tandem.router.link).

The set of workers changes while serving (`add`, `remove`, `apply`: what tandem.router.discovery
reports). A new address gets a link at once (connected once the pool has started); a removed one
takes no new request and its link is closed once its last request ended (at once when it has
none); an address that comes back before that takes requests again on the same link. Whether a
worker is alive stays the heartbeats' business. A worker whose last load report says `draining`
(it is shutting down) gets nothing new either.

Cluster facts come from the workers that can serve: `max_context` is the smallest among the usable
workers (a request must fit on whichever worker the policy picks; on both legs of a PD request), and
a policy hashes prompts by the page size of the role it chooses within. The model name is the
frontend's own (its tokenizer's), not any worker's.

Every metric (per worker, admission) is registered in one Registry and read at scrape time; what
/workers and /metrics show per worker is tandem.router.views.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from tandem.config import RETRY_AFTER_S, RouterConfig
from tandem.router import views
from tandem.router.accounting import can_place, has_pages
from tandem.router.admission import AdmissionQueue
from tandem.router.discovery import Change
from tandem.router.link import WorkerChannel, WorkerLink
from tandem.router.kv_feed import KvFeeds
from tandem.router.blocks import Placement
from tandem.router.kv_policy import KvAware
from tandem.router.policy import make_policy
from tandem.router.request import RequestHandle, RequestOptions
from tandem.runtime import errors
from tandem.runtime.channel import ZmqChannel
from tandem.runtime.lifecycle import TaskGroup
from tandem.runtime.metrics import Registry
from tandem.runtime.sharing import RecentTenants
from tandem.runtime.wire import Bootstrap, SamplingParams

log = logging.getLogger("tandem.router")
LEAVE_GRACE_S = 0.2  # a removed link's last Abort/Credit get this long to leave before it closes

Connect = Callable[[str, str], WorkerChannel]
"""`connect(address, frontend_id)` -> a channel to that worker."""


def zmq_connect(address: str, frontend_id: str) -> WorkerChannel:
    return ZmqChannel.to_worker(address, frontend_id.encode(), log)


class WorkerPool:
    def __init__(self, addresses: Sequence[str] = (), frontend_id: str | None = None,
                 router: RouterConfig | None = None, *, connect: Connect = zmq_connect,
                 registry: Registry | None = None, **link_options: Any) -> None:
        """`addresses`: the workers known at the start (none is fine when discovery adds them)."""
        self.frontend_id = frontend_id or f"fe-{os.getpid()}-{secrets.token_hex(8)}"
        self._rand, self._rand_at = b"", 0  # random bytes drawn ahead (_random)
        self._connect, self._link_options = connect, link_options
        self.links: list[WorkerLink] = []  # every link, leaving ones too, in the order added
        self._leaving: set[str] = set()  # removed: no new requests; closed once they have none
        self._dropping = TaskGroup()  # the closing of links that left
        self._started = False
        self.placed: dict[str, int] = {}  # requests placed per worker address (a counter)
        self._tenants = RecentTenants()  # who sent requests lately (router.accounting's headroom)
        self._in_flight: dict[str, int] = {}  # request legs in flight, per tenant (every worker)
        self.router = router or RouterConfig()
        self.policy = make_policy(self.router, list(addresses))
        self.registry = registry if registry is not None else Registry()
        self._admission: AdmissionQueue[RequestHandle, RequestHandle] = AdmissionQueue(
            self._place, RequestHandle.release, self.router.max_queue,
            self.router.queue_timeout_s, RETRY_AFTER_S, self.registry,
            lambda h: (h.tenant, h.priority), self._in_flight.__contains__)
        for a in addresses:
            self._new_link(a)
        self.kv_feeds = KvFeeds(self.policy) \
            if isinstance(self.policy, KvAware) else None  # the kv policy's event feeds
        views.register_metrics(self.registry, self.links, self.placed)
        if self.kv_feeds is not None:
            self.kv_feeds.register_metrics(self.registry)
        self.requests = RequestOptions(self.router, self.registry)  # migration and deadline

    @property
    def num_queued(self) -> int:
        """Requests waiting in the admission queue."""
        return len(self._admission)

    async def start(self, wait_s: float = 0.0) -> None:
        self._started = True
        for w in self.links:
            await w.connect()
        if wait_s > 0:
            await asyncio.gather(*(w.wait_up(wait_s) for w in self.links))

    async def close(self) -> None:
        self._admission.fail_all(errors.Unavailable("the frontend is shutting down"), "shutdown")
        await self._dropping.close()
        if self.kv_feeds is not None:
            await self.kv_feeds.close()
        await asyncio.gather(*(w.close() for w in self.links))

    # --- the set of workers -----------------------------------------------------------------------
    def _new_link(self, address: str) -> WorkerLink:
        link = WorkerLink(address, self.frontend_id, self._connect(address, self.frontend_id),
                          **self._link_options)
        link.on_capacity = self._on_capacity
        link.on_up = self._on_up
        link.account.everywhere = self._in_flight
        self.links.append(link)
        return link

    def link(self, address: str) -> WorkerLink | None:
        return next((w for w in self.links if w.address == address), None)

    async def add(self, address: str) -> None:
        """Serve from the worker at `address` too (connected now if the pool has started)."""
        link = self.link(address)
        if link is not None:
            if address in self._leaving:  # it came back before its link was dropped
                self._leaving.discard(address)
                link.on_capacity = self._on_capacity
                log.info("worker %s is back", address)
                self._on_capacity()
            return
        link = self._new_link(address)
        log.info("worker %s added", address)
        if self._started:
            await link.connect()

    async def remove(self, address: str) -> None:
        """Place nothing more on `address`; drop its link once its requests have ended."""
        link = self.link(address)
        if link is None or address in self._leaving:
            return
        self._leaving.add(address)
        log.info("worker %s removed: %d request(s) left on it", address, len(link.legs))
        link.on_capacity = lambda: self._drop_when_idle(link)
        self._drop_when_idle(link)
        self._on_capacity()  # nothing usable left? queued requests fail now

    async def apply(self, change: Change) -> None:
        """A discovery change (tandem.router.discovery.Discovery's `on_change`)."""
        for address in change.removed:
            await self.remove(address)
        for address in change.added:
            await self.add(address)

    def _drop_when_idle(self, link: WorkerLink) -> None:
        if link.legs or link.address not in self._leaving or link not in self.links:
            return
        self._leaving.discard(link.address)
        self.links.remove(link)
        if self.kv_feeds is not None:
            self.kv_feeds.down(link.address)
        self.policy.forget(link.address)
        log.info("worker %s dropped", link.address)

        async def drop() -> None:
            await asyncio.sleep(LEAVE_GRACE_S)
            await link.close()

        self._dropping.spawn(drop(), name=f"drop {link.address}")

    def _serves(self, w: WorkerLink) -> bool:
        """May take new requests: up, said hello, not removed, not draining."""
        return (w.usable and w.info is not None and w.address not in self._leaving
                and not getattr(w.load, "draining", False))

    @property
    def max_context(self) -> int | None:
        """The longest prompt + completion every worker that may serve takes: the smallest among
        usable workers (among those that ever said hello when none is usable); None before any."""
        known = [w.info.max_context for w in self.links
                 if w.info is not None and self._serves(w)]
        if not known:
            known = [w.info.max_context for w in self.links if w.info is not None]
        return min(known) if known else None

    def _serving(self) -> dict[str, list[WorkerLink]]:
        """The workers that may take new requests (`_serves`), by role: one pass over the links
        (placing a request asks once, not once per role)."""
        out: dict[str, list[WorkerLink]] = {}
        for w in self.links:
            info = w.info
            if info is not None and self._serves(w):
                role = out.get(info.role)
                if role is None:
                    out[info.role] = [w]
                else:
                    role.append(w)
        return out

    def ready(self) -> bool:
        """Ready to serve: a usable aggregated worker, or a usable prefill AND decode worker."""
        serving = self._serving()
        return "agg" in serving or ("prefill" in serving and "decode" in serving)

    def _candidates(self, links: list[WorkerLink], h: RequestHandle, sharing: bool
                    ) -> tuple[list[WorkerLink], list[WorkerLink]]:
        """Those of `links` under their limits for `h` (router.accounting.can_place; `sharing`:
        tenants share the router), split into those with free pages for the whole prompt and
        those without (`has_pages`; the second list is empty for a policy that does not predict
        what workers hold, blocks.Policy.predicts). Workers in a failure streak
        (router.accounting.FailureStreak) are left out of the second list, and of the first when
        any other there is well."""
        n, limits, offer_short = len(h.prompt_ids), self.router, self.policy.predicts
        tenant = h.tenant
        room: list[WorkerLink] = []
        short: list[WorkerLink] = []
        for w in links:
            info = w.info
            here = sharing and tenant in w.account.tenants  # (else, sharing: a newcomer)
            if info is not None and can_place(limits, w.account, info, w.load, n, here):
                if has_pages(w.account, info, w.load, n, 0, sharing and not here):
                    room.append(w)
                elif offer_short:
                    short.append(w)
        if any(w.streak.count for w in room) or any(w.streak.count for w in short):
            well = [w for w in room if not w.streak.avoid(w.clock())]
            short = [w for w in short if not w.streak.avoid(w.clock())]
            return well or room, short
        return room, short

    def _choose(self, role: str, candidates: tuple[list[WorkerLink], list[WorkerLink]],
                h: RequestHandle) -> tuple[WorkerLink, Placement, int] | None:
        """The policy's choice among both of `_candidates`' lists, or None when none can take
        the request now. A worker short of pages for the whole prompt is kept when the rest,
        less the tokens the policy predicts it holds, fits (router.accounting.has_pages); when it
        does not, the policy chooses again among those with room for the whole prompt."""
        room, short = candidates
        if not room and not short:
            return None
        ids = h.prompt_ids
        page_size = (room or short)[0].info.page_size  # type: ignore[union-attr]
        placed = self.policy.choose(role, room + short if short else room, ids, page_size,
                                    h.session, h.salt)
        chosen = placed.worker
        assert isinstance(chosen, WorkerLink) and chosen.info is not None
        if short and chosen in short and not has_pages(chosen.account, chosen.info, chosen.load,
                                                       len(ids), placed.cached_tokens):
            if not room:
                return None
            placed = self.policy.choose(role, room, ids, page_size, h.session, h.salt)
            chosen = placed.worker
            assert isinstance(chosen, WorkerLink)
        if role != "decode":  # the accounting's pending prefill: what it will compute
            h.cached_hint = placed.cached_tokens
        return chosen, placed, page_size

    def _place(self, h: RequestHandle) -> RequestHandle | None:
        """Start `h` on the workers the policy picks among those that can take it; None if all
        are full. Raises Unavailable when no worker (or pair) is usable at all."""
        ids = h.prompt_ids
        serving = self._serving()
        sharing = self._tenants.sharing()
        prefill, decode = serving.get("prefill"), serving.get("decode")
        if prefill and decode:
            p_choice = self._choose("prefill", self._candidates(prefill, h, sharing), h)
            d_choice = self._choose("decode", self._candidates(decode, h, sharing), h) \
                if p_choice is not None else None
            if p_choice is None or d_choice is None:
                return None
            p, p_placed, p_page = p_choice
            d, d_placed, d_page = d_choice
            local = self.router.pd_local_prefill_tokens
            missing = len(ids) - d_placed.cached_tokens
            if local and missing <= local and missing < len(ids) - p_placed.cached_tokens:
                # Decode-held reuse: the decode worker holds more of the prompt than the prefill
                # worker (its last turn's completion), and lacks little: it prefills that itself.
                h.start(d)
                self._count(d)
                self.policy.served("decode", d_placed, ids, d_page, h.session, h.salt)
                return h
            h.start(d, p, bootstrap_of(p, self._room()))
            self._count(p, d)
            self.policy.served("prefill", p_placed, ids, p_page, h.session, h.salt)
            self.policy.served("decode", d_placed, ids, d_page, h.session, h.salt)
            return h
        agg_links = serving.get("agg")
        if not agg_links:
            raise errors.Unavailable("no worker is available", retry_after=RETRY_AFTER_S)
        choice = self._choose("agg", self._candidates(agg_links, h, sharing), h)
        if choice is None:
            return None
        agg, placed, page = choice
        h.start(agg)
        self._count(agg)
        self.policy.served("agg", placed, ids, page, h.session, h.salt)
        return h

    def _count(self, *links: WorkerLink) -> None:
        for w in links:
            self.placed[w.address] = self.placed.get(w.address, 0) + 1

    def _on_up(self, link: WorkerLink) -> None:
        """A worker answered the handshake: a decode worker learns the prefill workers this
        frontend uses; a prefill worker (new, or restarted on another port) is announced to every
        decode worker that is up."""
        info = link.info
        role = info.role if info is not None else "agg"
        if self.kv_feeds is not None and info is not None:
            self.kv_feeds.up(link.address, info.name, info.kv_events_addr, info.kv_replay_addr,
                             info.page_size)
        if role == "decode":
            link.announce(self._prefill_addresses())
        elif role == "prefill":
            addresses = self._prefill_addresses()
            for w in self.links:
                if w.usable and w.info is not None and w.info.role == "decode":
                    w.announce(addresses)

    def _prefill_addresses(self) -> list[str]:
        infos = [w.info for w in self.links if w.info is not None]
        return sorted({i.bootstrap_addr for i in infos if i.role == "prefill" and i.bootstrap_addr})

    def _on_capacity(self) -> None:
        if not len(self._admission):
            return
        if self.ready():
            self._admission.wake()
        else:
            self._admission.fail_all(
                errors.Unavailable("no worker is available", retry_after=RETRY_AFTER_S))

    def _random(self, n: int) -> bytes:
        """`n` bytes from the OS's CSPRNG, drawn 4 KiB at a time (one system call, not one or
        two per request)."""
        buf, at = self._rand, self._rand_at
        if at + n > len(buf):
            buf, at = secrets.token_bytes(4096), 0
            self._rand = buf
        self._rand_at = at + n
        return buf[at:at + n]

    def new_rid(self) -> str:
        """Unguessable: 96 random bits (a peer cannot name another's request)."""
        return self._random(12).hex()

    def _room(self) -> int:
        """A PD pair's bootstrap room: 63 random bits."""
        return int.from_bytes(self._random(8), "little") >> 1

    def open(self, prompt_ids: list[int], sampling: SamplingParams, session: str = "",
             tenant: str = "", priority: int = 0, salt: str = "") -> RequestHandle:
        """A request to place (`session`: its conversation key, "" for none; `tenant` and
        `priority`: its place in the admission queue and the workers' queues; `salt`: its cache
        salt, "" for none)."""
        if not self.ready():
            self._admission.rejected.labels("no_worker").inc()
            raise errors.Unavailable("no worker is available", retry_after=RETRY_AFTER_S)
        h = RequestHandle(self.new_rid(), prompt_ids, sampling, self._admission.admit,
                          self.requests, self._admission.try_admit)
        h.session, h.tenant, h.priority, h.salt = session, tenant, priority, salt
        self._tenants.saw(tenant)
        return h

    async def snapshot(self) -> list[dict[str, Any]]:
        """Every worker as /workers shows it (tandem.router.views)."""
        return await views.snapshot(self.links, self._leaving, self.placed, self.kv_feeds)


def bootstrap_of(p: WorkerLink, room: int) -> Bootstrap:
    assert p.info is not None and p.info.bootstrap_addr
    host, _, port = p.info.bootstrap_addr.rpartition(":")
    return Bootstrap(host, int(port), room)
