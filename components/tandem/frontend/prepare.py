"""A generation request's preparation, and /tokenize and /detokenize: a body validated
(tandem.frontend.validate), templated and tokenized (tandem.frontend.preprocess) into the
GenerationJob tandem.frontend.respond answers; every refusal raises a TandemError.

Templating and tokenizing a large prompt runs in a thread, so the event loop (and the workers'
heartbeats it answers) never waits long on it: each step is sized by its own work (a template by
the characters of its messages plus MESSAGE_COST for each message, a tokenization by the length of
the text it tokenizes, a detokenization by its ids), and a step past THREAD_CHARS runs in a
thread through the tokenizer's calls that release the GIL (tandem.frontend.preprocess), at most
OFF_LOOP_JOBS at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from tandem.config import FrontendConfig
from tandem.frontend.salt import check_client_salt
from tandem.frontend import schemas, validate
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.respond import ChoiceSpec, GenerationJob
from tandem.runtime import errors

__all__ = ["MESSAGE_COST", "OFF_LOOP_JOBS", "THREAD_CHARS", "Prepare"]

THREAD_CHARS = 16_384  # work (characters, or their equivalent) past which a step runs in a thread
MESSAGE_COST = 64  # a chat message costs the template this many characters' work, empty or not
OFF_LOOP_JOBS = 2  # large templating/tokenizing jobs at once (a 3.9M-char prompt: ~0.8 GB)
OFF_LOOP_WAIT_S = 60.0  # how long a large job waits for its turn before a 503
_encode = msgspec.json.Encoder().encode
T = TypeVar("T")


class Prepare:
    """`max_context()`: the cluster's context length, which a generation needs (it raises
    Unavailable before any worker is ready); `context_now()`: the same or None, for /tokenize."""

    def __init__(self, config: FrontendConfig, preprocessor: Preprocessor,
                 max_context: Callable[[], int], context_now: Callable[[], int | None]) -> None:
        self.config = config
        self.preprocessor = preprocessor
        self.model_name = preprocessor.model_name
        self._max_context = max_context
        self._context_now = context_now  # (what /tokenize reports: None before any worker)
        self._heavy = asyncio.Semaphore(OFF_LOOP_JOBS)  # large jobs off the loop, at once

    async def job(self, kind: str, body: bytes, t0: float) -> GenerationJob:
        """Validate, template, tokenize and size one request; every refusal raises."""
        pre = self.preprocessor
        vocab = pre.vocab_size
        req: schemas.ChatCompletionRequest | schemas.CompletionRequest
        texts: list[str | list[int]] = []
        if kind == "chat":
            req = validate.decode_request(body, schemas.ChatCompletionRequest)
            validate.check_model(req, self.model_name)
            messages = validate.validate_chat(req, vocab)
            max_tokens = validate.chat_max_tokens(req)
            default_max: int | None = None  # vLLM: the rest of the context
            max_context = self._max_context()
            text = await self.off_loop(_template_work(messages), pre.render_chat, messages,
                                       req.tools, req.chat_template_kwargs, gil=True)
            prompts = [await self.off_loop(len(text), pre.encode_rendered, text)]
        else:
            req = validate.decode_request(body, schemas.CompletionRequest)
            validate.check_model(req, self.model_name)
            texts = validate.validate_completion(req, vocab)
            max_tokens = req.max_tokens
            default_max = self.config.default_max_tokens
            max_context = self._max_context()
            chars = sum(len(p) for p in texts if isinstance(p, str))
            prompts = await self.off_loop(chars, pre.encode_prompts, texts)
        opts = validate.options(req)
        choices: list[ChoiceSpec] = []
        for p, prompt_ids in enumerate(prompts):
            sampling = validate.sampling_params(req, max_tokens, len(prompt_ids), max_context,
                                                default_max, opts.constraint)
            echo = ""
            if opts.echo:
                t = texts[p]
                echo = t if isinstance(t, str) else pre.decode(t, opts.skip_special_tokens)
            for i in range(opts.n):
                sp = sampling if i == 0 or sampling.seed is None else \
                    msgspec.structs.replace(sampling, seed=validate.seed_of(req.seed, i))
                detok = pre.detokenizers.new(opts.stops, prompt_ids, opts.skip_special_tokens,
                                             opts.include_stop)
                choices.append(ChoiceSpec(p, prompt_ids, sp, detok, echo))
        validate.check_response_logprobs(req, opts, [c.sampling.max_tokens for c in choices],
                                         self.config.max_response_logprobs)
        return GenerationJob(
            kind="chat" if kind == "chat" else "completion", model=self.model_name,
            stream=opts.stream, include_usage=opts.include_usage,
            interval=req.stream_interval or self.config.stream_interval, t0=t0, choices=choices,
            logprobs=opts.logprobs, continuous_usage=opts.continuous_usage and opts.stream,
            token=pre.detokenizers.token, user=req.user or "", constraint=opts.constraint,
            priority=req.priority or 0, cache_salt=check_client_salt(req.cache_salt))

    async def tokenize(self, body: bytes) -> bytes:
        """vLLM's /tokenize: `prompt` (special tokens added unless `add_special_tokens` is false)
        or chat `messages` through the template (`add_generation_prompt`, default true)."""
        req = validate.decode_request(body, schemas.TokenizeRequest)
        validate.check_model(req, self.model_name)
        pre = self.preprocessor
        if (req.prompt is None) == (req.messages is None):
            raise errors.BadRequest("Send either `prompt` or `messages`.", param="prompt")
        if req.prompt is not None:
            prompt = req.prompt
            validate.check_prompt_chars(len(prompt), "prompt")
            ids = await self.off_loop(len(prompt), pre.encode_text, prompt,
                                      req.add_special_tokens is not False)
        else:
            messages = [validate.message_dict(m, i) for i, m in enumerate(req.messages or ())]
            validate.check_prompt_chars(sum(len(m["content"] or "") for m in messages), "messages")
            text = await self.off_loop(_template_work(messages), pre.render_chat, messages, None,
                                       None, req.add_generation_prompt is not False, gil=True)
            ids = await self.off_loop(len(text), pre.encode_text, text,
                                      bool(req.add_special_tokens))
        return _encode(schemas.TokenizeResponse(len(ids), self._context_now(), list(ids)))

    async def detokenize(self, body: bytes) -> bytes:
        req = validate.decode_request(body, schemas.DetokenizeRequest)
        validate.check_model(req, self.model_name)
        text = await self.off_loop(len(req.tokens), self.preprocessor.decode, req.tokens, False)
        return _encode(schemas.DetokenizeResponse(text))

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any, gil: bool = False) -> T:
        """`fn(*args)` here when `size` is small, else in a thread, so the loop keeps serving: as
        `fn(*args, release_gil=True)` (a tokenizer's call, which would otherwise hold the GIL all
        along), or with `gil` as it is (pure Python: the loop runs every switch interval). At most
        OFF_LOOP_JOBS at once (each may hold hundreds of MB); the rest wait, within a deadline."""
        if size <= THREAD_CHARS:
            return fn(*args)
        call = functools.partial(fn, *args) if gil else functools.partial(fn, *args,
                                                                         release_gil=True)
        try:
            async with asyncio.timeout(OFF_LOOP_WAIT_S):
                await self._heavy.acquire()
        except TimeoutError:
            raise errors.Unavailable("The server is busy with other large prompts.",
                                     retry_after=1.0) from None
        try:
            return await asyncio.to_thread(call)
        finally:
            self._heavy.release()



def _template_work(messages: list[dict[str, Any]]) -> int:
    """What rendering the chat template over `messages` costs, in characters' worth."""
    return sum(len(m["content"] or "") for m in messages) + MESSAGE_COST * len(messages)
