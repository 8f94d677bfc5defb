"""Llama in torch (RMSNorm, RoPE, GQA attention, SwiGLU MLP) over a paged KV cache.

The KV cache is one tensor, page-major: `kv[num_pages, num_layers, 2 (k, v), page_size,
num_kv_heads, head_dim]`, so one page (all layers, K and V) is one contiguous memory region and can
be handed to another process with one NIXL descriptor. Token position `p` of a sequence lives in
page `pages[p // page_size]`, slot `p % page_size`.

Module names match Hugging Face's `LlamaForCausalLM`, so a checkpoint's state dict loads as is, and
RoPE uses HF's rotate_half convention, so logits match `transformers` on the same weights.

Three ways to run the layers, differing only in attention (`_Attend` below): `forward_full` (one
sequence, no cache; for checks), `prefill` (one sequence's new tokens into its pages, attending to
everything already there), `decode` (one new token for each of many sequences).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.engines.reference.checkpoint import LlamaConfig, load_checkpoint


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [n, heads, head_dim]; cos, sin: [n, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class _Attend(Protocol):
    """Where K/V go and come from: given one layer's q [n, Hq, D], k and v [n, Hkv, D] for the new
    tokens, return attention output [n, Hq, D]."""

    positions: Tensor

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, attend: _Attend) -> Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        return self.o_proj(attend(layer, q, k, v).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, layer: int, attend: _Attend) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, layer, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# --- the three attention paths --------------------------------------------------------------------


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
    """q [B, Hq, n, D], k/v [B, Hkv, T, D] -> [B, Hq, n, D]; q head j reads kv head j // rep."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


class _FullAttend:
    def __init__(self, n: int, device: torch.device) -> None:
        self.positions = torch.arange(n, device=device)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        o = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                  None, causal=True)
        return o[0].transpose(0, 1)


class _PrefillAttend:
    """New tokens at positions [start, start + n) of one sequence; positions before `start` are
    already in its pages (a prefix computed earlier)."""

    def __init__(self, kv: Tensor, pages: Tensor, start: int, n: int) -> None:
        self.kv, self.start, self.n = kv, start, n
        page_size = kv.shape[3]
        self.positions = torch.arange(start, start + n, device=kv.device)
        self.write_pages = pages[self.positions // page_size]
        self.write_slots = self.positions % page_size
        self.read_pages = pages[: -(-(start + n) // page_size)]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.kv[self.write_pages, layer, 0, self.write_slots] = k
        self.kv[self.write_pages, layer, 1, self.write_slots] = v
        qh = q.transpose(0, 1)[None]
        if self.start == 0:  # nothing cached before: attend to the fresh K/V
            o = _sdpa(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, causal=True)
            return o[0].transpose(0, 1)
        total = self.start + self.n
        cached = self.kv[self.read_pages, layer]  # [m, 2, P, Hkv, D]
        kk = cached[:, 0].flatten(0, 1)[:total].transpose(0, 1)[None]
        vv = cached[:, 1].flatten(0, 1)[:total].transpose(0, 1)[None]
        cols = torch.arange(total, device=q.device)
        mask = cols[None, :] <= self.positions[:, None]
        return _sdpa(qh, kk, vv, mask)[0].transpose(0, 1)


class _DecodeAttend:
    """One new token per sequence; `positions[b]` is its position, `page_table[b]` its pages
    (padded with any valid page id; padding is masked out)."""

    def __init__(self, kv: Tensor, page_table: Tensor, positions: Tensor) -> None:
        self.kv, self.page_table, self.positions = kv, page_table, positions
        page_size = kv.shape[3]
        self.write_pages = page_table.gather(1, (positions // page_size)[:, None]).squeeze(1)
        self.write_slots = positions % page_size
        cols = torch.arange(page_table.shape[1] * page_size, device=kv.device)
        self.mask = (cols[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, T]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.kv[self.write_pages, layer, 0, self.write_slots] = k
        self.kv[self.write_pages, layer, 1, self.write_slots] = v
        cached = self.kv[self.page_table, layer]  # [B, M, 2, P, Hkv, D]
        kk = cached[:, :, 0].flatten(1, 2).transpose(1, 2)  # [B, Hkv, T, D]
        vv = cached[:, :, 1].flatten(1, 2).transpose(1, 2)
        return _sdpa(q[:, :, None, :], kk, vv, self.mask)[:, :, 0, :]


# --- the model ------------------------------------------------------------------------------------


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # RoPE tables for every position, float32 as HF computes them (cast per forward). Plain
        # attributes, not buffers, so `.to(dtype)` leaves them float32; `to_device` moves them.
        with torch.device("cpu"):
            self.rope_cos, self.rope_sin = self._rope_tables(cfg)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Llama:
        cfg, state = load_checkpoint(path)
        return cls.from_state_dict(cfg, state, device, dtype)

    @classmethod
    def from_state_dict(
        cls,
        cfg: LlamaConfig,
        state: dict[str, Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Llama:
        with torch.device("meta"):
            m = cls(cfg)
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        m.load_state_dict(state, strict=False, assign=True)
        missing = [n for n, p in m.named_parameters() if p.is_meta]
        if missing:
            raise KeyError(f"checkpoint lacks {missing[:4]}")
        m = m.to(device=device, dtype=dtype).eval()
        m.rope_cos, m.rope_sin = m.rope_cos.to(device), m.rope_sin.to(device)
        return m

    @staticmethod
    def _rope_tables(cfg: LlamaConfig) -> tuple[Tensor, Tensor]:
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(cfg.max_position_embeddings).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    # --- KV cache ---------------------------------------------------------------------------------
    def new_kv_cache(self, num_pages: int, page_size: int) -> Tensor:
        c = self.config
        shape = (num_pages, c.num_hidden_layers, 2, page_size, c.num_key_value_heads, c.head_dim)
        w = self.lm_head.weight
        return torch.zeros(shape, dtype=w.dtype, device=w.device)

    # --- forward paths ----------------------------------------------------------------------------
    def _run(self, token_ids: Tensor, attend: _Attend) -> Tensor:
        cos = self.rope_cos[attend.positions].to(self.lm_head.weight.dtype)
        sin = self.rope_sin[attend.positions].to(self.lm_head.weight.dtype)
        h = self.model.embed_tokens(token_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, i, attend)
        return self.model.norm(h)

    @torch.inference_mode()
    def forward_full(self, token_ids: Tensor) -> Tensor:
        """Logits [T, V] for every position of one sequence, no cache: the check for the rest."""
        h = self._run(token_ids, _FullAttend(token_ids.shape[0], token_ids.device))
        return self.lm_head(h).float()

    @torch.inference_mode()
    def prefill(
        self, kv: Tensor, token_ids: Tensor, pages: Tensor, start_pos: int = 0,
        all_logits: bool = False,
    ) -> Tensor:
        """Run one sequence's tokens at positions [start_pos, start_pos + n), writing their K/V
        into `pages` (the sequence's page ids in order). Logits [V] of the last position, or
        [n, V] for all of them with `all_logits`."""
        h = self._run(token_ids, _PrefillAttend(kv, pages, start_pos, token_ids.shape[0]))
        return self.lm_head(h if all_logits else h[-1]).float()

    @torch.inference_mode()
    def decode(
        self, kv: Tensor, token_ids: Tensor, positions: Tensor, page_table: Tensor
    ) -> Tensor:
        """One new token for each of B sequences: `token_ids[b]` at `positions[b]`, its pages in
        `page_table[b]` ([B, max pages], padded). Writes its K/V; returns logits [B, V]."""
        h = self._run(token_ids, _DecodeAttend(kv, page_table, positions))
        return self.lm_head(h).float()


def page_table(pages: list[list[int]], device: torch.device | str = "cpu") -> Tensor:
    """Pad page lists to one [B, max pages] int64 tensor (padding repeats a list's first page)."""
    width = max(len(p) for p in pages)
    rows = [p + [p[0]] * (width - len(p)) for p in pages]
    return torch.tensor(rows, dtype=torch.int64, device=device)
