"""HF-style Llama checkpoint directories: reading one (`load_checkpoint`) and writing the tiny one
with seeded random weights that demos and tests use (`write_tiny_model`).

A directory holds `config.json`, `*.safetensors` (one file or shards), `tokenizer.json`,
`tokenizer_config.json` (with `chat_template`) and optionally `generation_config.json`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tandem.runtime.errors import CheckpointError
from tandem.engines.reference.tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    PAD_TOKEN,
    train_tokenizer,
)


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any], eos_extra: tuple[int, ...] = ()) -> LlamaConfig:
        if d.get("model_type", "llama") != "llama":
            raise CheckpointError(f"model_type {d.get('model_type')!r} is not llama")
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise CheckpointError(f"rope scaling {rope_type!r} is not supported")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(_ids(d.get("eos_token_id")) + tuple(eos_extra))),
        )


def _ids(v: int | list[int] | None) -> tuple[int, ...]:
    if v is None:
        return ()
    return (int(v),) if isinstance(v, int) else tuple(int(x) for x in v)


def read_config(path: str | Path) -> LlamaConfig:
    """The model's shape and special ids, without touching the weights. EOS ids are the union of
    config.json's and generation_config.json's (chat models stop on both)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    gen_eos = _ids(gen.get("eos_token_id"))
    return LlamaConfig.from_dict(json.loads(cfg_file.read_text()), gen_eos)


def load_checkpoint(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Read config and weights (tensors as stored, on CPU). `lm_head.weight` is always present;
    with tied embeddings it is the embedding tensor itself."""
    path = Path(path)
    config = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if "lm_head.weight" not in state:
        if not config.tie_word_embeddings:
            raise CheckpointError("lm_head.weight missing and embeddings are not tied")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return config, state


# --- the tiny model -------------------------------------------------------------------------------

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
TINY_VOCAB = 1024


def _tiny_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights scaled so every sublayer moves the residual stream by O(1) and logits have a
    std of about 3: greedy output then depends on context instead of repeating one token."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    def norm_weight() -> torch.Tensor:  # not all ones, so a missing norm weight shows in tests
        return 1.0 + normal((h,), 0.1)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, h), 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal((q_out, h), 1 / math.sqrt(h))
        w[p + "self_attn.k_proj.weight"] = normal((kv_out, h), 1 / math.sqrt(h))
        w[p + "self_attn.v_proj.weight"] = normal((kv_out, h), 1 / math.sqrt(h))
        w[p + "self_attn.o_proj.weight"] = normal((h, q_out), 1 / math.sqrt(q_out))
        w[p + "mlp.gate_proj.weight"] = normal((inter, h), 1 / math.sqrt(h))
        w[p + "mlp.up_proj.weight"] = normal((inter, h), 1 / math.sqrt(h))
        w[p + "mlp.down_proj.weight"] = normal((h, inter), 1 / math.sqrt(inter))
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "post_attention_layernorm.weight"] = norm_weight()
    w["model.norm.weight"] = norm_weight()
    w["lm_head.weight"] = normal((vocab, h), 3.0 / math.sqrt(h))
    return {k: v.contiguous() for k, v in w.items()}


def write_tiny_model(path: str | Path, seed: int = 0) -> None:
    """Write a tiny Llama checkpoint (GQA, 2 layers, hidden 64) to `path`; deterministic in seed."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(TINY_VOCAB)
    vocab = tok.get_vocab_size()
    bos, eos, im_end = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, IM_END))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        **TINY,
        "head_dim": TINY["hidden_size"] // TINY["num_attention_heads"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    _write_json(path / "config.json", cfg)
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": [eos, im_end], "do_sample": False},
    )
    tok.save(str(path / "tokenizer.json"))
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": IM_END,
            "pad_token": PAD_TOKEN,
            "model_max_length": TINY["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    save_file(_tiny_weights(cfg, seed), str(path / "model.safetensors"), metadata={"format": "pt"})


def _write_json(file: Path, obj: dict[str, Any]) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
