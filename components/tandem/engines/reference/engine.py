"""ReferenceEngine: the torch Llama behind the engine contract, with continuous batching.

The step is tandem.engines.stepper's, on its thread driver: the engine's step thread schedules,
computes (torch, never on the event loop), postprocesses, and hands each step's outputs to the
loop with one `call_soon_threadsafe`, which delivers them with one `sink.on_step`. This module
adds the model: loading a checkpoint, the page-major KV cache, and `model_step`, which runs the
model for a batch and samples one token per sequence (and, for the sequences that asked, computes
their logprobs into `batch.logprobs`: tandem.engines.reference.sampler says which).

`compute_hook` is the public seam for tests: when set, the step thread calls
`compute_hook(batch, model_step)` instead of `model_step(batch)` (to hold a step, record it, or
fail it).

Constrained output (json_schema, regex): tandem.engines.reference.grammar compiles a request's
grammar at submit (`constraint`) and masks its logits before each of its tokens is sampled, the
prefill side's first token and a resumed request's next ones included.

PD: with a handoff (tandem.engines.handoff) its KV memory is this cache. Random draws are keyed by
(seed, position) (sampler.py), so a prefill engine's first token and a decode engine's later ones
are exactly the tokens an aggregated run samples.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.config import WorkerConfig
from tandem.engines.base import EngineError, EngineRequest, EngineRequestError, ModelSpec
from tandem.engines.grammars import Deferred
from tandem.engines.handoff import HandoffSpec
from tandem.engines.host_tier import EWMA
from tandem.engines.sampling import grammar_param
from tandem.engines.reference.checkpoint import load_checkpoint, read_config
from tandem.engines.reference.grammar import GrammarState, Grammars
from tandem.engines.reference.model import Decode, Llama, Prefill, page_table
from tandem.engines.reference.sampler import SampleRow, base_seed, sample, token_logprobs
from tandem.engines.scheduler import Batch, Scheduler, Sequence
from tandem.engines.stepper import Stepper
from tandem.engines.pages import page_bytes
from tandem.runtime.errors import CheckpointError
from tandem.runtime.wire import OutputMode, TokenLogprobs

DEFAULT_KV_BYTES = 1 << 30  # num_pages=0 sizes the cache for max_batch full contexts, within this
DEFAULT_MAX_PREFILL_TOKENS = 4096  # prompt tokens prefilled in one step (at least one prompt)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

T = TypeVar("T")
Compute = Callable[[Batch], list[int]]
ComputeHook = Callable[[Batch, Compute], list[int]]


class ReferenceEngine(Stepper):
    name = "reference"

    def __init__(self, model_dir: str | Path, *, device: str = WorkerConfig.device,
                 page_size: int = WorkerConfig.page_size, num_pages: int = WorkerConfig.num_pages,
                 max_batch: int = WorkerConfig.max_batch, output_mode: OutputMode | None = None,
                 dtype: str = "float32", max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 handoff: HandoffSpec | None = None,
                 compute_hook: ComputeHook | None = None,
                 prefix_cache: bool = WorkerConfig.prefix_cache,
                 check_pages: bool = WorkerConfig.check_kv,
                 threads: int = WorkerConfig.threads,
                 host_pages: int = WorkerConfig.host_kv_pages) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
        if page_size <= 0 or max_batch <= 0 or num_pages < 0:
            raise ValueError("page_size and max_batch must be positive, num_pages >= 0")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device or "cpu")  # "": the config's default, the CPU
        self.dtype = _DTYPES[dtype]
        try:
            self.config = cfg = read_config(self.model_dir)
        except (CheckpointError, OSError, KeyError, ValueError) as e:
            raise EngineError(f"cannot load model from {self.model_dir}: {e}") from e
        self.spec = ModelSpec(
            name=Path(os.path.abspath(self.model_dir)).name,
            max_context=cfg.max_position_embeddings,
            eos_token_ids=cfg.eos_token_ids,
            vocab_size=cfg.vocab_size,
        )
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.page_bytes = page_bytes(cfg.num_hidden_layers, page_size, cfg.num_key_value_heads,
                                     cfg.head_dim, elem)
        if num_pages == 0:
            pages_per_context = -(-cfg.max_position_embeddings // page_size)
            by_memory = max(pages_per_context, DEFAULT_KV_BYTES // self.page_bytes)
            num_pages = min(max_batch * pages_per_context, by_memory)
        super().__init__(page_size=page_size, num_pages=num_pages, max_batch=max_batch,
                         output_mode=output_mode, max_prefill_tokens=max_prefill_tokens,
                         handoff=handoff, prefix_cache=prefix_cache, check_pages=check_pages,
                         host_pages=host_pages)
        self.compute_hook = compute_hook
        self.threads = threads
        self._model: Llama | None = None
        self.kv: torch.Tensor | None = None
        # Built beside the model's load and first steps (xgrammar's import takes most of a
        # second); the first constrained request waits for it.
        self._grammars: Future[Grammars] | None = None

    # --- the Stepper hooks ------------------------------------------------------------------------
    step_thread = True

    async def load_memory(self) -> torch.Tensor:
        self._model, kv = await asyncio.to_thread(self._load_model)
        self.kv = kv
        host = self.pool.host
        if host is not None:  # (no page is cached before the model is up: nothing to copy yet)
            with self._lock:
                host.copier = TensorCopies(kv, host.num_slots)
        return kv

    def _load_model(self) -> tuple[Llama, torch.Tensor]:
        self._grammars = _in_thread(Grammars, self.model_dir, self.spec.vocab_size,
                                    self.spec.eos_token_ids)
        cfg, state = load_checkpoint(self.model_dir)
        model = Llama.from_state_dict(cfg, state, self.device, self.dtype)
        return model, model.new_kv_cache(self.num_pages, self.page_size)

    async def shutdown(self) -> None:
        await super().shutdown()
        if self._grammars is not None and self._grammars.done() and \
                self._grammars.exception() is None:
            self._grammars.result().close()

    def check_prompt(self, prompt: list[int]) -> None:
        if min(prompt) < 0 or max(prompt) >= self.spec.vocab_size:
            raise EngineRequestError(f"prompt has token ids outside [0, {self.spec.vocab_size})")

    def new_sequence(self, req: EngineRequest, pd: str) -> Sequence:
        seq = super().new_sequence(req, pd)
        seq.seed = base_seed(req.sampling)
        return seq

    @property
    def grammars(self) -> Grammars:
        assert self._grammars is not None  # (started: submit refuses before)
        return self._grammars.result()

    def constraint(self, req: EngineRequest) -> GrammarState | Deferred | None:
        if grammar_param(req.sampling) is None:
            return None
        return self.grammars.constraint(req, self.name)

    def compute(self, batch: Batch) -> list[int]:
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # (where the math runs, before its first step)
        hook = self.compute_hook
        host = self.pool.host
        if host is None or not batch.prefill:
            return self.model_step(batch) if hook is None else hook(batch, self.model_step)
        t0 = time.perf_counter()
        tokens = self.model_step(batch) if hook is None else hook(batch, self.model_step)
        # What the host tier weighs a load against: this step's seconds per token it computed
        # (prompt tokens and decode rows alike; a moving average).
        n = Scheduler.prefill_tokens(batch) + len(batch.decode)
        per = (time.perf_counter() - t0) / max(1, n)
        was = host.compute_s_per_token
        host.compute_s_per_token = per if not was else (1 - EWMA) * was + EWMA * per
        return tokens

    # --- compute (on the compute thread) ----------------------------------------------------------
    @torch.inference_mode()
    def model_step(self, batch: Batch) -> list[int]:
        """Run the model for the batch and sample one token per sequence (prefill rows first)."""
        model, kv, dev = self._model, self.kv, self.device
        assert model is not None and kv is not None
        ids: list[int] = []
        prefills: list[Prefill] = []
        for seq in batch.prefill:
            new = seq.prompt_ids[seq.num_cached:seq.prefill_end]
            ids += new
            prefills.append(Prefill(torch.tensor(seq.pages, dtype=torch.int64, device=dev),
                                    seq.num_cached, len(new)))
        decode = None
        if batch.decode:
            ds = batch.decode
            ids += [s.output_ids[-1] for s in ds]
            pos = torch.tensor([s.num_tokens - 1 for s in ds], dtype=torch.int64, device=dev)
            pages_used = [s.pages[: self.pool.pages_for(s.num_tokens)] for s in ds]
            decode = Decode(page_table(pages_used, dev), pos)
        # One pass for the whole step: every prefill and every decode row share the weights' reads.
        logits = model.step(kv, torch.tensor(ids, dtype=torch.int64, device=dev), prefills, decode)
        seqs = batch.all()
        rows = [i for i, s in enumerate(seqs) if Scheduler.samples(s)]
        if len(rows) == len(seqs):
            tokens, batch.logprobs = self._sample(seqs, logits)
            return tokens
        # A prompt's chunk before its last samples nothing (its token is not one: 0).
        tokens = [0] * len(seqs)
        if rows:
            sampled, lps = self._sample([seqs[i] for i in rows], logits[rows])
            every: list[TokenLogprobs | None] = [None] * len(seqs)
            for j, i in enumerate(rows):
                tokens[i] = sampled[j]
                if lps is not None:
                    every[i] = lps[j]
            if lps is not None:
                batch.logprobs = every
        return tokens

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor
                ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """One token per row of `logits` (one per sequence of `seqs`, in order), after the
        grammars' masks; and the logprobs of the rows that ask (None when none does)."""
        sample_rows = [SampleRow(s.sampling, s.seed, s.position, s.banned_ids(),
                                 s.origin_prompt, s.all_output, s.extras) for s in seqs]
        asked = [i for i, s in enumerate(seqs) if s.extras and s.logprobs is not None]
        raw = logits[asked].log_softmax(dim=-1) if asked else None  # (before sample changes it)
        constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:
            self.grammars.mask(logits, constrained)
        tokens = sample(logits, sample_rows)
        if raw is None:
            return tokens, None
        lps = token_logprobs(raw, [seqs[i].sampling.logprobs or 0 for i in asked],
                             [tokens[i] for i in asked])
        out: list[TokenLogprobs | None] = [None] * len(seqs)
        for i, lp in zip(asked, lps):
            out[i] = lp
        return tokens, out


class TensorCopies:
    """The host tier's copier: a host tensor of `num_slots` pages in the KV cache's layout (pinned
    when the cache is on a GPU), rows copied to and from the cache's pages."""

    def __init__(self, kv: torch.Tensor, num_slots: int) -> None:
        self.kv = kv
        self.host = torch.empty((num_slots, *kv.shape[1:]), dtype=kv.dtype,
                                pin_memory=kv.is_cuda)

    def save(self, pages: Seq[int], slots: Seq[int]) -> None:
        self.host[torch.tensor(slots)] = self.kv[torch.tensor(pages, device=self.kv.device)].cpu()

    def load(self, slots: Seq[int], pages: Seq[int]) -> None:
        rows = self.host[torch.tensor(slots)].to(self.kv.device)
        self.kv[torch.tensor(pages, device=self.kv.device)] = rows


def _in_thread(fn: Callable[..., T], *args: Any) -> Future[T]:
    """`fn(*args)` on a thread of its own; its result (or its exception) in the future."""
    fut: Future[T] = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # (the future carries it to whoever waits)
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="tandem-grammars").start()
    return fut
