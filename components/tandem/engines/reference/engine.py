"""ReferenceEngine: the torch Llama behind the Engine contract, with continuous batching.

Threads: the torch compute runs in one dedicated step thread, never on the event loop. Each step is
schedule (under the lock), compute and sample (no lock), postprocess (under the lock), then ONE
`loop.call_soon_threadsafe` hands the step's outputs to the loop, which feeds per-request queues.
`self._lock` guards the scheduler and the page pool; the loop thread takes it only for short
bookkeeping (add, abort, load), so the loop never waits on compute.

Abort (and a consumer that closes its generator) frees a request's pages at once, unless the step
thread is computing on them right now; then the step frees them as soon as it ends and emits the
"abort" output itself. Pages a KV transfer is using are freed when the transfer ends (pd.py).

Disaggregated prefill/decode: set `prefill_side` (a PrefillSide) or `decode_side` (a DecodeSide)
after `start()`; requests that carry a `bootstrap` then do the KV handoff of pd.py. Random draws
are keyed by (seed, position) (sampler.py), so P's first token and D's later ones are exactly the
tokens an aggregated run samples.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from tandem.engines.base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    ModelSpec,
)
from tandem.engines.reference.checkpoint import CheckpointError, load_checkpoint, read_config
from tandem.engines.reference.model import Llama, page_table
from tandem.engines.reference.pd import PdMixin
from tandem.engines.reference.sampler import SampleRow, base_seed, sample
from tandem.engines.reference.scheduler import Batch, Scheduler, Sequence, SeqStatus
from tandem.engines.reference.stream import Emit as _Emit
from tandem.engines.reference.stream import Stream as _Stream
from tandem.kv.handoff import DecodeSide, PrefillSide
from tandem.kv.pages import PagePool
from tandem.runtime.wire import Load, OutputMode, SamplingParams

DEFAULT_KV_BYTES = 1 << 30  # num_pages=0 sizes the cache for max_batch full contexts, within this
DEFAULT_MAX_PREFILL_TOKENS = 4096  # prompt tokens prefilled in one step (at least one prompt)
IDLE_WAIT_S = 0.5  # the step thread re-checks for work this often even without a wake-up

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ReferenceEngine(PdMixin, Engine):
    name = "reference"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        page_size: int = 16,
        num_pages: int = 0,
        max_batch: int = 64,
        output_mode: OutputMode = "cumulative",
        dtype: str = "float32",
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
    ) -> None:
        if output_mode not in ("cumulative", "incremental"):
            raise ValueError(f"output_mode must be cumulative or incremental, not {output_mode!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
        if page_size <= 0 or max_batch <= 0 or num_pages < 0:
            raise ValueError("page_size and max_batch must be positive, num_pages >= 0")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.output_mode = output_mode
        self.page_size = page_size
        self.max_batch = max_batch
        try:
            self.config = read_config(self.model_dir)
        except (CheckpointError, OSError, KeyError, ValueError) as e:
            raise EngineError(f"cannot load model from {self.model_dir}: {e}") from e
        cfg = self.config
        self.spec = ModelSpec(
            name=Path(os.path.abspath(self.model_dir)).name,
            max_context=cfg.max_position_embeddings,
            eos_token_ids=cfg.eos_token_ids,
            vocab_size=cfg.vocab_size,
        )
        pages_per_context = -(-cfg.max_position_embeddings // page_size)
        if num_pages == 0:
            by_memory = max(pages_per_context, DEFAULT_KV_BYTES // self.page_bytes)
            num_pages = min(max_batch * pages_per_context, by_memory)
        self.num_pages = num_pages
        self.pool = PagePool(num_pages, page_size)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._sched = Scheduler(self.pool, max_batch, max_prefill_tokens)
        self._streams: dict[str, _Stream] = {}
        self._model: Llama | None = None
        self.kv: torch.Tensor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._owner_ids = itertools.count()
        # PD: the worker sets one of these after start() (prefill or decode role).
        self.prefill_side: PrefillSide | None = None
        self.decode_side: DecodeSide | None = None

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page (all layers, K and V): one contiguous region of `self.kv`."""
        c = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return c.num_hidden_layers * 2 * self.page_size * c.num_key_value_heads * c.head_dim * elem

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None or self._closed:
            raise EngineError("start() called twice or after shutdown()")
        self._loop = asyncio.get_running_loop()
        self._model, self.kv = await asyncio.to_thread(self._load_model)
        self._thread = threading.Thread(target=self._run, name="tandem-reference-step", daemon=True)
        self._thread.start()

    def _load_model(self) -> tuple[Llama, torch.Tensor]:
        cfg, state = load_checkpoint(self.model_dir)
        model = Llama.from_state_dict(cfg, state, self.device, self.dtype)
        return model, model.new_kv_cache(self.num_pages, self.page_size)

    async def shutdown(self) -> None:
        """Stop the step thread, end every request with "abort", free every page (pages a KV
        transfer may still be using come back when it ends: close the PD side too). Safe twice."""
        if self._closed:
            return
        self._closed = True
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        with self._lock:
            seqs = self._sched.all()
        for seq in seqs:  # pages a KV transfer is using come back when it ends
            self._cancel(seq)

    # --- requests ---------------------------------------------------------------------------------
    def load(self) -> Load:
        with self._lock:
            return Load(
                running=self._sched.num_running,
                waiting=self._sched.num_waiting,
                pages_free=self.pool.num_free,
                pages_total=self.pool.num_pages,
                pages_reserved=self.pool.num_reserved,
            )

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        seq = self._new_sequence(req)
        stream = _Stream(seq)
        self._streams[req.rid] = stream
        with self._wake:
            self._sched.add(seq)
            self._wake.notify()
        prompt_tokens = len(seq.prompt_ids)
        carry: _Emit | None = None  # an error held back so the tokens before it go out first
        try:
            if req.bootstrap is not None and seq.pd == "prefill":
                yield await self._prefill_handoff(stream, req.bootstrap)
                return
            if req.bootstrap is not None and seq.pd == "decode":
                ended = await self._decode_handoff(stream, req.bootstrap)
                if ended is not None:
                    yield ended
                    return
            while True:
                emit = carry or await stream.queue.get()
                carry = None
                if emit.error:
                    raise EngineError(emit.error)
                new_ids, finish = list(emit.new_ids), emit.finish
                while finish is None and not stream.queue.empty():  # consumer lagged: merge
                    more = stream.queue.get_nowait()
                    if more.error:
                        carry = more
                        break
                    new_ids += more.new_ids
                    finish = more.finish
                stream.ids += new_ids
                ids = list(stream.ids) if self.output_mode == "cumulative" else new_ids
                yield EngineOutput(ids, finish, prompt_tokens, len(stream.ids))
                if finish is not None:
                    return
        finally:
            self._streams.pop(req.rid, None)
            self._cancel(seq)

    async def abort(self, rid: str) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            self._cancel(stream.seq)

    def _cancel(self, seq: Sequence) -> None:
        """End `seq` with "abort" (no-op if it already ended). Called on the loop thread."""
        with self._wake:
            if seq.status is SeqStatus.FINISHED or seq.abort_requested:
                return
            seq.abort_requested = True
            if seq.in_flight:
                return  # the step thread frees it when the step ends
            if not seq.kv_busy:  # else the KV transfer's end frees the pages (pd.py)
                self._sched.finish(seq, "abort")
                self._wake.notify()  # pages came back: a waiting request may fit now
        self._deliver([_Emit(seq, [], "abort")])

    def _new_sequence(self, req: EngineRequest) -> Sequence:
        if self._thread is None or self._closed:
            raise EngineError("engine is not running")
        if req.rid in self._streams:
            raise EngineRequestError(f"request id {req.rid!r} is already running")
        _check_sampling(req.sampling)
        prompt = list(req.prompt_ids)
        ctx = self.spec.max_context
        if not prompt:
            raise EngineRequestError("prompt is empty")
        if len(prompt) >= ctx:
            raise EngineRequestError(
                f"prompt has {len(prompt)} tokens; this model's context is {ctx} tokens")
        if min(prompt) < 0 or max(prompt) >= self.spec.vocab_size:
            raise EngineRequestError(f"prompt has token ids outside [0, {self.spec.vocab_size})")
        pd = ""  # a bootstrap on an engine with no PD side is served aggregated
        if req.bootstrap is not None and self.prefill_side is not None:
            pd = "prefill"
        elif req.bootstrap is not None and self.decode_side is not None:
            pd = "decode"
        max_total = min(len(prompt) + req.sampling.max_tokens, ctx)
        if pd == "prefill":
            max_total = len(prompt)  # pages for the prompt alone: only its K/V is handed over
        if not self._sched.fits_at_all(max_total):
            raise EngineRequestError(
                f"{max_total} tokens need {self.pool.pages_for(max_total)} KV pages; "
                f"this engine has {self.num_pages}")
        stop = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stop.update(self.spec.eos_token_ids)
        return Sequence(
            rid=req.rid,
            prompt_ids=prompt,
            sampling=req.sampling,
            max_total=max_total,
            stop_ids=frozenset(stop),
            owner=f"{req.rid}#{next(self._owner_ids)}",
            pd=pd,
            seed=base_seed(req.sampling),
        )

    # --- loop side of a step ----------------------------------------------------------------------
    def _deliver(self, emits: list[_Emit]) -> None:
        """On the loop: route each request's share of a step to its stream (if still consumed)."""
        for emit in emits:
            stream = self._streams.get(emit.seq.rid)
            if stream is not None and stream.seq is emit.seq:
                stream.queue.put_nowait(emit)

    # --- the step thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping:
                    batch = self._sched.schedule()
                    if batch:
                        break
                    self._wake.wait(IDLE_WAIT_S)
                else:
                    return
            emits = self._step(batch)
            if emits:
                try:
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(self._deliver, emits)
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    return

    def _step(self, batch: Batch) -> list[_Emit]:
        """Compute one step and apply it; returns what each request got."""
        seqs = batch.all()
        # Decode requests whose pages were just reserved: their KV fetch can begin.
        emits = [_Emit(seq, [], None) for seq in batch.reserved]
        try:
            tokens = self._compute(batch) if seqs else []
        except Exception as e:  # a failing step fails its requests, not the engine
            with self._wake:
                for seq in seqs:
                    seq.in_flight = False
                    self._sched.finish(seq, "error")
                self._wake.notify()
            error = f"reference engine step failed: {e!r}"
            return emits + [_Emit(seq, [], "error", error) for seq in seqs]
        with self._wake:
            for seq, token in zip(seqs, tokens):
                seq.in_flight = False
                if seq.abort_requested or seq.status is SeqStatus.FINISHED:
                    self._sched.finish(seq, "abort")
                    emits.append(_Emit(seq, [], "abort"))
                    continue
                seq.num_cached = seq.num_tokens
                if seq.pd == "prefill":  # first token sampled: the KV handoff takes over
                    seq.output_ids.append(token)
                    self._sched.to_sending(seq)
                    emits.append(_Emit(seq, [token], None))
                    continue
                finish = seq.finish_after(token)
                if finish is not None:
                    self._sched.finish(seq, finish)
                emits.append(_Emit(seq, [token], finish))
            self._wake.notify()
        return emits

    @torch.inference_mode()
    def _compute(self, batch: Batch) -> list[int]:
        """Run the model for the batch and sample one token per sequence (prefill rows first)."""
        model, kv, dev = self._model, self.kv, self.device
        assert model is not None and kv is not None
        rows: list[torch.Tensor] = []
        for seq in batch.prefill:
            ids = torch.tensor(seq.prompt_ids[seq.num_cached:], dtype=torch.int64, device=dev)
            pages = torch.tensor(seq.pages, dtype=torch.int64, device=dev)
            rows.append(model.prefill(kv, ids, pages, start_pos=seq.num_cached)[None])
        if batch.decode:
            ds = batch.decode
            last = torch.tensor([s.output_ids[-1] for s in ds], dtype=torch.int64, device=dev)
            pos = torch.tensor([s.num_tokens - 1 for s in ds], dtype=torch.int64, device=dev)
            pages_used = [s.pages[: self.pool.pages_for(s.num_tokens)] for s in ds]
            rows.append(model.decode(kv, last, pos, page_table(pages_used, dev)))
        logits = torch.cat(rows) if len(rows) > 1 else rows[0]
        seqs = batch.all()
        rows = [SampleRow(s.sampling, s.seed, s.num_completion, s.banned_ids()) for s in seqs]
        return sample(logits, rows)


def _check_sampling(p: SamplingParams) -> None:
    if p.max_tokens < 1:
        raise EngineRequestError("max_tokens must be at least 1")
    if p.temperature < 0:
        raise EngineRequestError("temperature must be >= 0")
    if not 0.0 < p.top_p <= 1.0:
        raise EngineRequestError("top_p must be in (0, 1]")
    if p.top_k < 0:
        raise EngineRequestError("top_k must be >= 0 (0 disables it)")
    if p.min_tokens < 0 or p.min_tokens > p.max_tokens:
        raise EngineRequestError("min_tokens must be in [0, max_tokens]")
