"""transformers' own greedy answers on a checkpoint: the reference tandem's answers are compared
with, token for token (tests/real, and SGLang's live tests)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Expected:
    """transformers' greedy answer to one prompt: the prompt's ids, the answer's ids, and the
    log-probability transformers gives each answer token (log_softmax of its logits)."""

    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]


class Transformers:
    """transformers' LlamaForCausalLM and tokenizer on the same checkpoint, greedy, in `dtype`
    (float32 unless told: "bfloat16" to compare with an engine that computes in it); answers are
    cached per (prompt, max_new_tokens)."""

    def __init__(self, path: str, dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
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



def token_bytes(path: str) -> list[bytes]:
    """Each token id's raw bytes in the checkpoint's tokenizer (special tokens included): what a
    chat answer's logprobs name each token by."""
    from tokenizers import Tokenizer

    from tandem.frontend.detokenizer import byte_table

    return byte_table(Tokenizer.from_file(f"{path}/tokenizer.json"), skip_special_tokens=False)
