"""Which sequences run in the next step, and their page bookkeeping. Plain Python over PagePool;
no torch here. It is called from one thread at a time: the event loop's for the mock engine; for
the reference engine, its step thread's and the loop's, under the stepper's lock
(tandem.engines.stepper).

A sequence is admitted from the waiting queue (by priority, then fairly across tenants, then in
arrival order, the batch's last place and the pool's last pages kept for a tenant with nothing
admitted: tandem.engines.waiting) only when the pool can give it pages for
`max_total` tokens: its prompt's pages now, the rest promised (tandem.engines.pages), each taken
when a decode step first writes into it, so decode never runs out of pages mid-request and no
cached page is evicted before it must be. A step is: the running sequences that are ready to
decode, plus prompts to prefill: first the next chunk of those prefilled part way, then newly
admitted ones, as far as the step's prefill budget (`max_prefill_tokens`) goes.

Chunked prefill: a prompt longer than what is left of the budget computes that much of itself
(`prefill_end`) and the rest in later steps, the next chunk first in each, before anything new
is admitted but a request of a tenant with nothing admitted while tenants share (it goes first:
one tenant's long prompts do not hold another's first token back); it samples its first token
with its last chunk. So no step computes more prompt tokens than the budget, and the decodes
that share a step with a long prompt are not held for all of it (vLLM's chunked prefill under
max-num-batched-tokens; SGLang's --chunked-prefill-size). Its pages are taken whole at
admission, as for any prompt. Such a newcomer's first `NEWCOMER_STEPS` steps (its prompt's and
its next token's) compute no other tenant's prompt, so its first text waits for no one else's
prefill; the others' prompts wait at most that many steps in a row (a stream of newcomers takes
at most two steps of three from them), and never for a newcomer that has ended.

Token bookkeeping: `tokens = prompt_ids + output_ids`; the K/V of `tokens[:num_cached]` sit in
`pages`. Prefill computes `tokens[num_cached:prefill_end]`, and samples the first output token when
`prefill_end` is the prompt's end; decode feeds `tokens[-1]` at position `num_tokens - 1`.

Disaggregated serving (`pd`): a prefill-only sequence ("prefill") holds pages for its prompt only;
after its prefill step it leaves the batch as SENDING, keeping its pages until its KV has been sent.
A decode sequence ("decode") is admitted by *reserving* pages for its prompt (and a promise of
the rest of `max_total` tokens); it waits as FETCHING, outside the batch but counted against
`max_batch`, while its prompt's K/V is written into them, then `join` commits the pages and it
runs with `num_cached == len(prompt_ids)`: it skips prefill, and its first token (the prefill
side's) is recorded as a step's token is, by the Stepper's postprocess. (The handoff itself:
tandem.engines.handoff.)

Prefix cache (when the pool caches): at admission a sequence takes the cached pages of its
prompt's leading full pages (`keys`, computed at submit; at most the pages before its last prompt
token, so a step always computes at least one token and samples from it) and starts with
`num_cached` past them; `cached_tokens` is what it reports. A decode sequence takes them too and
has only the rest written (`skip`). `publish` caches its computed full pages: its prompt's once
they are computed (`publish_at`: the prompt's length, then never), the rest when it finishes (one
call, not one per page: a decode step's cost stays one comparison).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.engines.pages import PagePool
from tandem.engines.prefix import page_keys, salt_root
from tandem.engines.waiting import WaitQueue
from tandem.runtime.wire import Bootstrap, FinishReason, Load, SamplingParams, TokenLogprobs


# A newcomer's (tandem.engines.waiting) first steps: its prompt's and its second token's (a first
# token's text is not always whole: a byte-level token of a multi-byte character needs the next).
NEWCOMER_STEPS = 2
NEVER = 1 << 62  # `publish_at` of a sequence whose pages are not cached


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FETCHING = "fetching"  # decode: pages reserved, waiting for the prompt's K/V to arrive
    SENDING = "sending"  # prefill: computed, pages held until the K/V has been sent
    FINISHED = "finished"


@dataclass(eq=False, slots=True, kw_only=True)
class Sequence:
    # (The fields every step reads come first: their slots share the fewest cache lines.)
    rid: str
    output_ids: list[int] = field(default_factory=list)  # handed out live in cumulative mode
    prompt_ids: list[int]
    in_flight: bool = False  # a step computes on its pages right now: they stay until it ends
    done: bool = False  # its last output went out, or it was cancelled: no more outputs
    logprobs: list[TokenLogprobs] | None = None  # one per output id, when asked for (as live)
    pd: str = ""  # "" aggregated, "prefill" (prefill-only) or "decode" (K/V arrives by transfer)
    status: SeqStatus = SeqStatus.WAITING
    num_cached: int = 0
    prefill_end: int = 0  # while a step prefills it: its prompt tokens computed when it ends
    publish_at: int = NEVER  # num_cached at which its prompt's full pages are cached
    stop_ids: frozenset[int]  # a sampled id in here finishes it with "stop"
    resume: int = 0  # the last `resume` prompt ids are completion tokens of an earlier leg
    max_total: int  # prompt + completion tokens it may reach: min(prompt + max_tokens, context)
    memo: Any = None  # the engine's own per-request constant (the mock: its token seed)
    sink: Any = None  # the OutputSink its outputs go to
    sampling: SamplingParams
    owner: str = ""  # its name in the page pool, unique per request (rids can be reused)
    seed: int | None = None  # base seed of a sampled request (sampler.base_seed)
    bootstrap: Bootstrap | None = None  # PD: where the other side of its KV handoff is
    extras: bool = False  # it asks for logprobs, a bias or a penalty: its step does more work
    pages: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cancelled: bool = False  # by its handle: not even an output a step already made goes out
    handoff: Any = None  # PD: its handoff state (tandem.engines.handoff), while the handoff runs
    keys: list[int] = field(default_factory=list)  # prefix cache keys of its leading full pages
    salt: str = ""  # its cache salt: its first page's key is rooted at it (tandem.engines.prefix)
    published: int = 0  # leading pages cached (or found cached) so far
    cached_tokens: int = 0  # prompt tokens it did not compute (usage.cached_tokens)
    skip: int = 0  # decode: leading prompt pages it had cached (not written by the prefill side)
    grammar: Any = None  # constrained output: what its tokens must follow (reference/grammar.py)
    cacheable: bool = True  # False: its K/V came from a peer that did not authenticate (keyless)
    tenant: str = ""  # who sent it, and its priority (lower first): its place in the queue
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.owner:
            self.owner = self.rid

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def position(self) -> int:
        """Completion tokens before the next one, counting an earlier leg's (its draw position)."""
        return self.resume + len(self.output_ids)

    @property
    def origin_prompt(self) -> list[int]:
        """The prompt as the client sent it (without an earlier leg's completion tokens)."""
        return self.prompt_ids[:len(self.prompt_ids) - self.resume] if self.resume else self.prompt_ids

    @property
    def all_output(self) -> list[int]:
        """Every completion token so far, an earlier leg's included (what penalties look at)."""
        if self.resume:
            return self.prompt_ids[len(self.prompt_ids) - self.resume:] + self.output_ids
        return self.output_ids

    def banned_ids(self) -> frozenset[int]:
        """Stop ids may not be sampled before min_tokens completion tokens exist."""
        return self.stop_ids if self.position < self.sampling.min_tokens else frozenset()


@dataclass(slots=True)
class Batch:
    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    reserved: list[Sequence] = field(default_factory=list)  # decode seqs that just got pages
    # Set by the step's compute when a sequence of it asked for logprobs: one per all() item.
    logprobs: list[TokenLogprobs | None] | None = None

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode or self.reserved)

    def all(self) -> list[Sequence]:
        return self.prefill + self.decode


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int, max_prefill_tokens: int) -> None:
        self.pool = pool
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting = WaitQueue()  # (priority, then fair across tenants: engines/waiting.py)
        self.running: dict[str, Sequence] = {}
        self.fetching: dict[str, Sequence] = {}
        self.sending: dict[str, Sequence] = {}
        self._spare: dict[str, tuple[str, int]] = {}  # newcomer owner: (tenant, steps kept to come)
        self._held = 0  # steps in a row that computed no other tenant's prompt, for newcomers

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Admitted and not finished: computing, fetching its K/V, or sending it."""
        return len(self.running) + len(self.fetching) + len(self.sending)

    def load(self) -> Load:
        """What runs and waits, and the pool's pages and prefix cache counts (the engine's load)."""
        pool, host = self.pool, self.pool.host
        load = Load(running=self.num_running, waiting=self.num_waiting,
                    pages_free=pool.num_available, pages_total=pool.num_pages,
                    pages_reserved=pool.num_reserved, pages_cached=pool.num_cached,
                    cache_queries=pool.queries, cache_hits=pool.hits)
        if host is not None:
            load.host_pages_total, load.host_pages_cached = host.num_slots, host.num_cached
            load.host_hits, load.host_load_s_per_page = pool.host_hits, host.load_s_per_page
            load.prefill_s_per_token = host.compute_s_per_token
        return load

    def all(self) -> list[Sequence]:
        return [*self.waiting, *self.running.values(), *self.fetching.values(),
                *self.sending.values()]

    def fits_at_all(self, max_total: int) -> bool:
        return self.pool.pages_for(max_total) <= self.pool.num_pages

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Batch:
        """Pick the next step's work and mark it in flight."""
        decode: list[Sequence] = []
        chunked: list[Sequence] = []
        pool = self.pool
        size = pool.page_size
        for s in self.running.values():
            if s.num_cached >= len(s.prompt_ids):  # its prompt is computed: it decodes
                if len(s.pages) * size < s.num_tokens:  # its next K/V starts a page
                    s.pages.append(pool.grow(s.owner))
                s.in_flight = True
                decode.append(s)
            else:  # a prompt prefilled in chunks, part way
                chunked.append(s)
        batch = Batch(decode=decode)
        budget = self.max_prefill_tokens
        spare = self._spare
        if self.waiting:  # a tenant with nothing admitted goes before the chunks
            budget = self._admit(batch, budget, newcomers=True)
            for s in batch.prefill:  # (a PD prefill sequence has one step: its prompt's)
                spare[s.owner] = (s.tenant, 1 if s.pd == "prefill" else NEWCOMER_STEPS)
        only: set[str] | None = None  # the tenants whose prompts this step may compute
        if spare:  # a newcomer's first steps compute no other tenant's prompt, and the others'
            running = self.running  # wait no longer than that in a row, nor for a newcomer
            for owner in [o for o in spare if o not in running]:  # that ended (or went to send)
                del spare[owner]
        if spare:  # (so the newcomer is in this step: it is never empty while work waits)
            if self._held < NEWCOMER_STEPS:
                only = {t for t, _ in spare.values()}
                self._held += 1
            else:
                self._held = 0
            for owner, (t, n) in list(spare.items()):
                if n > 1:
                    spare[owner] = (t, n - 1)
                else:
                    del spare[owner]
        else:
            self._held = 0
        for s in chunked:  # (in admission order) the next chunk of each, while the budget lasts
            if budget <= 0:
                break
            if only is not None and s.tenant not in only:
                continue
            s.prefill_end = min(len(s.prompt_ids), s.num_cached + budget)
            budget -= s.prefill_end - s.num_cached
            s.in_flight = True
            batch.prefill.append(s)
        self._admit(batch, budget, only=only)
        return batch

    def _admit(self, batch: Batch, budget: int, newcomers: bool = False,
               only: set[str] | None = None) -> int:
        """Admit waiting sequences into `batch`, in the queue's order, while the batch, the
        pool and the prefill `budget` allow (`newcomers`: only those of a tenant with nothing
        admitted while tenants share, tandem.engines.waiting; `only`: only those of these
        tenants); what is left of the budget."""
        pool, waiting = self.pool, self.waiting
        while waiting and len(self.running) + len(self.fetching) < self.max_batch:
            seq = waiting.head()
            if newcomers and not waiting.newcomer(seq):
                break
            hits = self._hits(seq)
            now, later = self._pages(seq, hits)
            if seq.pd == "decode":
                if not self._reserve(seq, hits, now, later):
                    break
                batch.reserved.append(seq)
                continue
            if budget <= 0 or only is not None and seq.tenant not in only \
                    or not self._fits(seq, hits, now + later):
                break
            waiting.pop(seq)
            seq.pages = pool.take(seq.owner, hits, now, later)
            self._admitted(seq, hits)
            seq.status = SeqStatus.RUNNING
            self.running[seq.owner] = seq
            seq.in_flight = True
            seq.prefill_end = min(len(seq.prompt_ids), seq.num_cached + budget)
            budget -= seq.prefill_end - seq.num_cached
            batch.prefill.append(seq)
        return budget

    def reserve_waiting(self) -> list[Sequence]:
        """Reserve pages now for the PD decode requests at the head of the queue, in order, as
        far as pages and the batch allow (what `schedule` would do first): a decode request's
        K/V can be fetched without waiting for a step boundary."""
        out: list[Sequence] = []
        while (self.waiting and self.waiting.head().pd == "decode"
               and len(self.running) + len(self.fetching) < self.max_batch):
            seq = self.waiting.head()
            hits = self._hits(seq)
            if not self._reserve(seq, hits, *self._pages(seq, hits)):
                break
            out.append(seq)
        return out

    def _hits(self, seq: Sequence) -> list[int]:
        """The cached pages `seq` would start with (none when the pool does not cache)."""
        if not seq.keys:
            return []
        return self.pool.match(seq.keys, (len(seq.prompt_ids) - 1) // self.pool.page_size)

    def _pages(self, seq: Sequence, hits: list[int]) -> tuple[int, int]:
        """The pages `seq` takes at admission (its prompt's, past the cached `hits`) and those it
        is promised (the rest of its `max_total` tokens')."""
        now = self.pool.pages_for(len(seq.prompt_ids)) - len(hits)
        return now, self.pool.pages_for(seq.max_total) - len(hits) - now

    def _admitted(self, seq: Sequence, hits: list[int]) -> None:
        pool, num_hits = self.pool, len(hits)
        if pool.caching:
            pool.admitted(len(seq.prompt_ids), hits)
            seq.published = num_hits
            seq.publish_at = len(seq.prompt_ids)
        if seq.pd == "decode":
            seq.skip = num_hits
        else:
            seq.num_cached = seq.cached_tokens = num_hits * pool.page_size

    def _fits(self, seq: Sequence, hits: list[int], num_pages: int) -> bool:
        """The pool can give `seq` (the head) its pages, and its tenant may take them and a place
        of the batch (the batch's last place and the pool's last pages are kept for another
        tenant while tenants share: tandem.engines.waiting)."""
        spare = self.pool.spare(hits, num_pages)
        return spare >= 0 and not self.waiting.held_back(
            seq, self.max_batch - len(self.running) - len(self.fetching), spare,
            self.pool.num_pages)

    def _reserve(self, seq: Sequence, hits: list[int], now: int, later: int) -> bool:
        if not self._fits(seq, hits, now + later):
            return False
        self.waiting.pop(seq)
        self.pool.reserve(seq.owner, now, hits, later)
        seq.pages = self.pool.pages_of(seq.owner)
        self._admitted(seq, hits)
        seq.status = SeqStatus.FETCHING
        self.fetching[seq.owner] = seq
        return True

    @staticmethod
    def prefill_tokens(batch: Batch) -> int:
        """The prompt tokens a step computes."""
        return sum(s.prefill_end - s.num_cached for s in batch.prefill)

    @staticmethod
    def samples(seq: Sequence) -> bool:
        """Whether the step computing `seq` samples a token for it (not a prompt's chunk before
        its last)."""
        return seq.prefill_end >= len(seq.prompt_ids) or seq.num_cached >= len(seq.prompt_ids)

    def publish(self, seq: Sequence) -> None:
        """Cache `seq`'s computed full pages not cached yet (the keys of pages past its prompt's
        are computed here, from its tokens)."""
        size = self.pool.page_size
        n_full = seq.num_cached // size
        seq.publish_at = NEVER
        if n_full <= seq.published or not seq.cacheable:
            return
        keys = seq.keys
        tokens = seq.prompt_ids if n_full * size <= len(seq.prompt_ids) else \
            seq.prompt_ids + seq.output_ids
        if len(keys) < n_full:
            keys += page_keys(tokens, size, keys[-1] if keys else salt_root(seq.salt), len(keys),
                              n_full)
        self.pool.publish(seq.pages, keys, seq.published, n_full, lambda a, b: tokens[a:b],
                          seq.salt)
        seq.published = n_full

    def to_sending(self, seq: Sequence) -> None:
        """A prefill-only sequence computed its first token: out of the batch, pages kept."""
        del self.running[seq.owner]
        seq.status = SeqStatus.SENDING
        self.sending[seq.owner] = seq

    def join(self, seq: Sequence) -> None:
        """A decode sequence's prompt K/V arrived: its pages become its own and it runs (its
        first token, sampled by the prefill side, is postprocessed like a step's)."""
        del self.fetching[seq.owner]
        self.pool.commit(seq.owner)
        seq.status = SeqStatus.RUNNING
        self.running[seq.owner] = seq
        seq.num_cached = len(seq.prompt_ids)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence wherever it is and give its pages back. Idempotent."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.waiting.finished(seq)
            for group in (self.running, self.fetching, self.sending):
                if group.get(seq.owner) is seq:
                    del group[seq.owner]
        self.pool.free(seq.owner)
        seq.pages = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
