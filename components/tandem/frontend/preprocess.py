"""From request to prompt token ids: loads a model directory's `tokenizer.json` (the `tokenizers`
library) and `tokenizer_config.json` (chat template, bos/eos), renders the chat template in a
sandboxed jinja2 environment with `add_generation_prompt=True`, and tokenizes.

The template sees what transformers' `apply_chat_template` gives it: `messages`, `tools`,
`add_generation_prompt`, the special tokens by name, `raise_exception` and `strftime_now`. A
rendered chat prompt is tokenized without adding special tokens (the template has them); a raw
completions prompt is tokenized with them (vLLM does the same).

Every call that tokenizes or detokenizes takes `release_gil`: the `tokenizers` library's single
`encode`/`decode` hold the GIL for all of their work (a 3.9M-character prompt: 4-5 s, so a thread
running one stalls the event loop as long), its batch calls release it while they work. A caller
that runs a large one in a thread asks for the batch form (the loop then waits at most for the
conversion of the ids to a list); a small one on the loop keeps the cheaper single call.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from tandem.frontend.detokenizer import DetokenizerFactory
from tandem.runtime import errors
from tandem.config import FrontendConfig

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")


class TemplateRaised(jinja2.TemplateError):
    """The chat template refused the conversation (its `raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _token_text(entry: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _load_templates(model_dir: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """Named chat templates: `chat_template` as a string or a list of {name, template}, else the
    newer `chat_template.jinja` file next to it."""
    raw = cfg.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {t["name"]: t["template"] for t in raw
                if isinstance(t, dict) and isinstance(t.get("template"), str)}
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return {"default": path.read_text(encoding="utf-8")}
    return {}


class Preprocessor:
    """Owns the tokenizer and chat template of the served model."""

    def __init__(self, model_dir: str | os.PathLike[str], served_model_name: str = ""):
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {path}")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg: dict[str, Any] = {}
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        self.model_name = served_model_name or path.resolve().name
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            text = _token_text(cfg.get(key))
            if text is not None:
                self.special_tokens[key] = text
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        eos_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._templates = {name: env.from_string(src)
                           for name, src in _load_templates(path, cfg).items()}
        self.detokenizers = DetokenizerFactory(self.tokenizer)

    @classmethod
    def from_config(cls, config: FrontendConfig) -> Preprocessor:
        if not config.model:
            raise ValueError("FrontendConfig.model (the model directory) is not set")
        return cls(config.model, config.served_model_name)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The chat template applied with `add_generation_prompt=True`; a template error is 400."""
        template = None
        if tools:
            template = self._templates.get("tool_use")
        template = template or self._templates.get("default")
        if template is None:
            raise errors.BadRequest("This model has no chat template; use /v1/completions.",
                                    param="messages")
        context: dict[str, Any] = dict(template_kwargs or {})
        context.update(self.special_tokens)
        context.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            return template.render(**context)
        except TemplateRaised as e:
            raise errors.BadRequest(f"The chat template refused the messages: {e}",
                                    param="messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise errors.BadRequest(f"Could not apply the chat template: {e}",
                                    param="messages") from None

    def encode_text(self, text: str, add_special_tokens: bool,
                    release_gil: bool = False) -> list[int]:
        """The one call that tokenizes (see the module docstring for `release_gil`)."""
        if release_gil:
            enc = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids

    def encode_rendered(self, text: str, release_gil: bool = False) -> list[int]:
        """A rendered chat prompt's ids (the template wrote its special tokens)."""
        ids = self.encode_text(text, False, release_gil)
        if not ids:
            raise errors.BadRequest("The messages render to an empty prompt.", param="messages")
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.encode_rendered(self.render_chat(messages, tools, template_kwargs))

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True,
                      release_gil: bool = False) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode_text(prompt, add_special_tokens, release_gil)
        else:
            for t in prompt:
                if t >= self.vocab_size:
                    raise errors.BadRequest(
                        f"Token id {t} is out of range: the vocabulary has {self.vocab_size} "
                        f"tokens.", param="prompt")
            ids = prompt
        if not ids:
            raise errors.BadRequest("prompt must not be empty.", param="prompt")
        return ids

    def encode_prompts(self, prompts: list[str | list[int]],
                       release_gil: bool = False) -> list[list[int]]:
        """A completions request's prompts (text or ids) as ids."""
        return [self.encode_prompt(p, release_gil=release_gil) for p in prompts]

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               release_gil: bool = False) -> str:
        """Token ids -> text (/detokenize, completions `echo`); ids must be in the vocabulary."""
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise errors.BadRequest(
                    f"Token id {t} is out of range: the vocabulary has {self.vocab_size} "
                    f"tokens.", param="tokens")
        if release_gil:
            return str(self.tokenizer.decode_batch([ids],
                                                   skip_special_tokens=skip_special_tokens)[0])
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
