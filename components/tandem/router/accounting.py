"""Backpressure accounting for one worker, and the limits placement checks against it. Pure: no I/O,
no clock; the worker link calls it where requests start, deltas arrive and requests end
(ARCHITECTURE.md, "Backpressure accounting").

- `pending_prefill_tokens`: prompt tokens sent to a prefill or agg worker whose first delta has not
  come back (its prefill is not done), less those the router expects it to have cached;
- `active_decode_tokens`: prompt plus generated tokens of the requests decoding on an agg or decode
  worker;
- `num_in_flight`: requests placed on the worker and not ended, and `tenants`, how many of them
  each tenant has.

While tenants share the router (more than one sent work lately: tandem.runtime.sharing), the last
`INFLIGHT_HEADROOM` of a worker's in-flight places (`max_inflight_per_worker`) go only to a tenant
with nothing in flight there, as the engine keeps its batch's last place (tandem.engines.waiting):
a client that arrives while another holds every place is sent on at once, to be admitted at the
worker's next step, instead of waiting in the frontend's queue for one of the other's requests to
end (perf/results/tenants.md).

Each request leg carries its own share (`Share`), so ending it subtracts exactly what it added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config import RouterConfig
from tandem.runtime.wire import Load, WorkerInfo


INFLIGHT_HEADROOM = 1  # in-flight places kept for a tenant with nothing in flight, while sharing


class Share:
    """What one request leg counts on its worker."""

    __slots__ = ("prefill_tokens", "decode_tokens", "tenant", "fresh")

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.tenant = ""
        self.fresh = False  # its tenant had nothing in flight on the worker when it was placed


@dataclass(slots=True)
class WorkerAccount:
    num_in_flight: int = 0
    pending_prefill_tokens: int = 0
    fresh_prefill_tokens: int = 0  # of those, the prompts of legs placed `fresh` (Share)
    active_decode_tokens: int = 0
    tenants: dict[str, int] = field(default_factory=dict)  # requests in flight, per tenant
    # the same over every worker of the pool (one dict the pool gives all its accounts: the
    # admission queue's order, tandem.router.admission)
    everywhere: dict[str, int] = field(default_factory=dict)

    def open(self, share: Share, role: str, num_prompt_tokens: int, cached: int = 0,
             tenant: str = "") -> None:
        """A request leg of `tenant` was placed on this worker (of `role`); `cached`: of its
        prompt, the tokens the router expects the worker to have cached (not computed)."""
        self.num_in_flight += 1
        share.tenant = tenant
        n = self.tenants.get(tenant, 0)
        self.tenants[tenant] = n + 1
        self.everywhere[tenant] = self.everywhere.get(tenant, 0) + 1
        if role != "decode":
            share.prefill_tokens = max(0, num_prompt_tokens - cached)
            self.pending_prefill_tokens += share.prefill_tokens
            if not n:
                share.fresh = True
                self.fresh_prefill_tokens += share.prefill_tokens
        if role != "prefill":
            share.decode_tokens = num_prompt_tokens
            self.active_decode_tokens += num_prompt_tokens

    def progress(self, share: Share, num_tokens: int) -> None:
        """A delta of `num_tokens` arrived for the leg: its prefill is done; it decodes on."""
        if share.prefill_tokens:
            self.pending_prefill_tokens -= share.prefill_tokens
            if share.fresh:
                self.fresh_prefill_tokens -= share.prefill_tokens
            share.prefill_tokens = 0
        if share.decode_tokens:
            share.decode_tokens += num_tokens
            self.active_decode_tokens += num_tokens

    def close(self, share: Share) -> None:
        """The leg ended (finished, aborted or failed). Safe once per `open`."""
        self.num_in_flight -= 1
        _less(self.tenants, share.tenant)
        _less(self.everywhere, share.tenant)
        self.pending_prefill_tokens -= share.prefill_tokens
        if share.fresh:
            self.fresh_prefill_tokens -= share.prefill_tokens
        self.active_decode_tokens -= share.decode_tokens
        share.prefill_tokens = share.decode_tokens = 0


def _less(counts: dict[str, int], tenant: str) -> None:
    n = counts[tenant] - 1
    if n:
        counts[tenant] = n
    else:
        del counts[tenant]


def can_place(limits: RouterConfig, account: WorkerAccount, info: WorkerInfo, load: Load,
              num_tokens: int, kept_from: bool = False) -> bool:
    """Under the per-worker limits (requests in flight, pending prefill tokens) for a request
    the last in-flight places are kept from or not (`kept_from`: tenants share, and its tenant
    has something in flight here; see above); not draining (a worker whose last report says it
    is draining takes nothing). Pages are `has_pages`'s."""
    if getattr(load, "draining", False):
        return False
    most = limits.max_inflight_per_worker
    if most and account.num_in_flight >= most - (INFLIGHT_HEADROOM if kept_from else 0):
        return False
    limit = limits.max_pending_prefill_tokens_per_worker
    pending = account.pending_prefill_tokens
    return not (limit and info.role != "decode" and pending and pending + num_tokens > limit)


def has_pages(account: WorkerAccount, info: WorkerInfo, load: Load, num_tokens: int,
              cached: int = 0, newcomer: bool = False) -> bool:
    """Free pages for the prompt's pages less the `cached` tokens' full pages (what the router
    predicts the worker holds on its device: 0 asks for the whole prompt). A prompt bigger than
    the whole worker is let through: the worker refuses it itself.

    Free pages: the last report's, less those of the prompts this router sent there whose prefill
    has not come back (`pending_prefill_tokens`, uncached part only): the report may not count them
    yet (in flight, or queued at the worker, which holds no pages), and without them every request
    placed between two reports reads the same free pages, so a wake would send the whole admission
    queue to the first worker that reported room (perf/results/admission_page_gate_probe.md). A
    prompt already admitted and still prefilling is counted twice until its first token: the gate
    errs toward holding a request in the frontend's queue a step longer. A cached prefix that sits
    unheld in the worker's pool is counted among its free pages by the report, so asking only for
    the rest lets the request wait at the worker that holds its prefix (its engine admits it when
    pages free) rather than be computed again elsewhere (perf/results/trace_mooncake.md).

    A `newcomer` (a tenant with nothing in flight there, while tenants share) reads the report's
    free pages alone while no other newcomer's prompt is pending there: the engine admits it
    before the prompts of tenants with something admitted, and keeps pages for it
    (tandem.engines.waiting), so those prompts' pages are not its wait. One newcomer at a time per
    worker does this: when every request is a newcomer (many clients of one request each), the
    gate counts them all as above.
    """
    total = load.pages_total
    size = info.page_size
    need = -(-num_tokens // size)
    if not total or need > total:
        return True
    pending = 0 if info.role == "decode" or (newcomer and not account.fresh_prefill_tokens) \
        else account.pending_prefill_tokens
    free = load.pages_free - -(-pending // size)
    return free >= need - cached // size


STREAK_BACKOFF_S = (0.5, 30.0)  # first and longest wait before a failing worker is tried again


@dataclass(slots=True)
class FailureStreak:
    """The requests a worker ended in a row with an error of its own (its engine failed, or the KV
    did not arrive). While the streak lasts the worker is passed over whenever another can take the
    request, so a worker that fails at once does not attract traffic for being idle; it is tried
    again after a wait that doubles with each failure (0.5 s up to 30 s), so one that recovered is
    found; a request it ends well ends the streak."""

    count: int = 0
    retry_at: float = 0.0

    def failed(self, now: float) -> None:
        self.count += 1
        first, longest = STREAK_BACKOFF_S
        self.retry_at = now + min(longest, first * 2 ** min(self.count - 1, 16))

    def served(self) -> None:
        self.count = 0

    def avoid(self, now: float) -> bool:
        return self.count > 0 and now < self.retry_at

