"""Llama in torch (RMSNorm, RoPE, GQA attention, SwiGLU MLP) over a paged KV cache.

The KV cache is one tensor, page-major: `kv[num_pages, num_layers, 2 (k, v), page_size,
num_kv_heads, head_dim]`, so one page (all layers, K and V) is one contiguous memory region and can
be handed to another process with one NIXL descriptor. Token position `p` of a sequence lives in
page `pages[p // page_size]`, slot `p % page_size`.

Module names match Hugging Face's `LlamaForCausalLM`, so a checkpoint's state dict loads as is, and
RoPE uses HF's rotate_half convention, so logits match `transformers` on the same weights.

Two ways to run the layers, differing only in attention (`_Attend` below): `forward_full` (one
sequence, no cache; for checks) and `step` (`_StepAttend`: an engine step's new tokens in one
pass, several sequences' prefills and a batch of decode rows together, each attending to what its
pages hold). `prefill` (one sequence) and `decode` (decode rows only) are `step`'s two halves.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def pack(self) -> None:
        """q, k and v as one K-major matrix (`qkv_t`), o transposed (`o_t`); the projections'
        own weights become views of them (see Llama.pack)."""
        self.qkv_t = _packed([self.q_proj, self.k_proj, self.v_proj])
        self.o_t = _packed([self.o_proj])

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, attend: _Attend) -> Tensor:
        n = x.shape[0]
        hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = torch.mm(x, self.qkv_t)
        q = qkv[:, :hq].view(n, self.num_heads, self.head_dim)
        k = qkv[:, hq:hq + hkv].view(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, hq + hkv:].view(n, self.num_kv_heads, self.head_dim)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        return torch.mm(attend(layer, q, k, v).reshape(n, -1), self.o_t)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def pack(self) -> None:
        """gate and up as one K-major matrix (`gate_up_t`), down transposed (`down_t`)."""
        self.gate_up_t = _packed([self.gate_proj, self.up_proj])
        self.down_t = _packed([self.down_proj])

    def forward(self, x: Tensor) -> Tensor:
        gate, up = torch.mm(x, self.gate_up_t).chunk(2, dim=-1)
        return torch.mm(F.silu(gate) * up, self.down_t)


def _packed(linears: list[nn.Linear]) -> Tensor:
    """The linears' weights side by side, transposed to [in, sum of outs] and contiguous; each
    linear's weight becomes its slice of that (a view: no second copy)."""
    with torch.no_grad():
        t = torch.cat([lin.weight for lin in linears]).t().contiguous()
        at = 0
        for lin in linears:
            out = lin.weight.shape[0]
            lin.weight = nn.Parameter(t[:, at:at + out].t(), requires_grad=False)
            at += out
    return t


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


# --- the attention paths --------------------------------------------------------------------------


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
    """q [B, Hq, n, D], k/v [B, Hkv, T, D] -> [B, Hq, n, D]; q head j reads kv head j // rep
    (torch's grouped-query attention: no copy of K/V per query head)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


class _FullAttend:
    def __init__(self, n: int, device: torch.device) -> None:
        self.positions = torch.arange(n, device=device)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        o = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                  None, causal=True)
        return o[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class Prefill:
    """One sequence's new tokens in a step: `n` tokens at positions [start, start + n), its
    page ids in order (`pages`); positions before `start` are already in its pages."""

    pages: Tensor
    start: int
    n: int


@dataclass(frozen=True, slots=True)
class Decode:
    """One new token for each of B sequences: `positions[b]` is its position, `page_table[b]`
    its pages (padded with any valid page id; padding is masked out)."""

    page_table: Tensor
    positions: Tensor


class _StepAttend:
    """Every new token of a step in one pass through the layers: the prefill sequences' tokens
    first, one segment each, then the decode rows. The projections and MLPs run once over all of
    them; attention is per prefill segment (causal over its cached and new tokens) and batched over
    the decode rows. Each layer writes all new K/V into their pages with one index_put."""

    def __init__(self, kv: Tensor, prefills: list[Prefill], decode: Decode | None) -> None:
        self.kv, self.prefills, self.decode = kv, prefills, decode
        page_size, dev = kv.shape[3], kv.device
        pos: list[Tensor] = []
        pages: list[Tensor] = []
        self.segments: list[tuple[int, Prefill, Tensor]] = []  # (offset, prefill, read pages)
        offset = 0
        for p in prefills:
            ps = torch.arange(p.start, p.start + p.n, device=dev)
            pos.append(ps)
            pages.append(p.pages[ps // page_size])
            self.segments.append((offset, p, p.pages[: -(-(p.start + p.n) // page_size)]))
            offset += p.n
        self.n_prefill = offset
        if decode is not None:
            dp = decode.positions
            pos.append(dp)
            pages.append(decode.page_table.gather(1, (dp // page_size)[:, None]).squeeze(1))
            cols = torch.arange(decode.page_table.shape[1] * page_size, device=dev)
            self.mask = (cols[None, :] <= dp[:, None])[:, None, None, :]  # [B, 1, 1, T]
            self.read = decode.page_table.flatten()
        self.positions = pos[0] if len(pos) == 1 else torch.cat(pos)
        self.write_pages = pages[0] if len(pages) == 1 else torch.cat(pages)
        self.write_slots = self.positions % page_size

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv = self.kv
        kv[self.write_pages, layer, 0, self.write_slots] = k
        kv[self.write_pages, layer, 1, self.write_slots] = v
        outs = [self._prefill(layer, q[o:o + p.n], k[o:o + p.n], v[o:o + p.n], p, read)
                for o, p, read in self.segments]
        if self.decode is not None:
            outs.append(self._decode(layer, q[self.n_prefill:]))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, p: Prefill,
                 read: Tensor) -> Tensor:
        qh = q.transpose(0, 1)[None]
        if p.start == 0:  # nothing cached before: attend to the fresh K/V
            o = _sdpa(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, causal=True)
            return o[0].transpose(0, 1)
        total = p.start + p.n
        cached = self.kv[:, layer].index_select(0, read)  # [m, 2, P, Hkv, D]
        kk = cached[:, 0].flatten(0, 1)[:total].transpose(0, 1)[None]
        vv = cached[:, 1].flatten(0, 1)[:total].transpose(0, 1)[None]
        cols = torch.arange(total, device=q.device)
        mask = cols[None, :] <= torch.arange(p.start, total, device=q.device)[:, None]
        return _sdpa(qh, kk, vv, mask)[0].transpose(0, 1)

    def _decode(self, layer: int, q: Tensor) -> Tensor:
        assert self.decode is not None
        b, m = self.decode.page_table.shape
        cached = self.kv[:, layer].index_select(0, self.read)  # [B * M, 2, P, Hkv, D]
        cached = cached.view(b, m, *cached.shape[1:])
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
        m.pack()
        return m

    def pack(self) -> None:
        """Each layer's projections packed for its matmuls: q, k, v as one K-major matrix, gate
        and up as another, o and down transposed. One GEMM where there were three or two, over a
        layout the CPU's GEMM reads faster at decode batch sizes (a decode step of SmolLM2: about
        10% less at batch 16 and 64 on 2 cores). The modules' weights become views of the packed
        tensors, so memory is not doubled and `state_dict()` is what was loaded."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.pack()
            layer.mlp.pack()

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
    def step(self, kv: Tensor, token_ids: Tensor, prefills: list[Prefill],
             decode: Decode | None) -> Tensor:
        """One engine step in one pass: `token_ids` holds every prefill's new tokens (in order)
        and then each decode row's token. Writes their K/V; returns logits [len(prefills) + B, V]:
        each prefill's last position, then each decode row."""
        attend = _StepAttend(kv, prefills, decode)
        h = self._run(token_ids, attend)
        if prefills:
            ends = torch.tensor([o + p.n - 1 for o, p, _ in attend.segments], device=h.device)
            if decode is not None:
                ends = torch.cat((ends, torch.arange(attend.n_prefill, h.shape[0],
                                                     device=h.device)))
            h = h[ends]
        return self.lm_head(h).float()

    @torch.inference_mode()
    def prefill(
        self, kv: Tensor, token_ids: Tensor, pages: Tensor, start_pos: int = 0,
        all_logits: bool = False,
    ) -> Tensor:
        """Run one sequence's tokens at positions [start_pos, start_pos + n), writing their K/V
        into `pages` (the sequence's page ids in order). Logits [V] of the last position, or
        [n, V] for all of them with `all_logits`."""
        n = token_ids.shape[0]
        h = self._run(token_ids, _StepAttend(kv, [Prefill(pages, start_pos, n)], None))
        return self.lm_head(h if all_logits else h[-1]).float()

    @torch.inference_mode()
    def decode(
        self, kv: Tensor, token_ids: Tensor, positions: Tensor, page_table: Tensor
    ) -> Tensor:
        """One new token for each of B sequences: `token_ids[b]` at `positions[b]`, its pages in
        `page_table[b]` ([B, max pages], padded). Writes its K/V; returns logits [B, V]."""
        return self.step(kv, token_ids, [], Decode(page_table, positions))


def page_table(pages: list[list[int]], device: torch.device | str = "cpu") -> Tensor:
    """Pad page lists to one [B, max pages] int64 tensor (padding repeats a list's first page)."""
    width = max(len(p) for p in pages)
    rows = [p + [p[0]] * (width - len(p)) for p in pages]
    return torch.tensor(rows, dtype=torch.int64, device=device)
