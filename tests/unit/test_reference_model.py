"""The reference model against transformers' Llama on the same tiny checkpoint, the paged KV paths
against the cache-free forward, and the tiny checkpoint's tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2.sandbox
import pytest
import torch
from tokenizers import Tokenizer

from tandem.engines.reference.checkpoint import load_checkpoint, write_tiny_model
from tandem.engines.reference.model import Decode, Llama, Prefill, page_table

PROMPTS = [
    [0, 17],
    [0, 5, 100, 200, 7, 900, 33, 44, 1000, 12, 13],
    [0, *range(300, 337)],  # crosses several pages of 4 and 16
    [3, 2, 1, 4, 1023],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path, seed=0)
    return path


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Llama:
    return Llama.from_checkpoint(model_dir)


def test_checkpoint_is_deterministic_in_seed(model_dir: Path, tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "same", seed=0)
    write_tiny_model(tmp_path / "other", seed=1)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (tmp_path / "same" / f).read_bytes() == (model_dir / f).read_bytes(), f
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != (
        model_dir / "model.safetensors").read_bytes()


def test_load_checkpoint(model_dir: Path) -> None:
    cfg, state = load_checkpoint(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 16
    assert cfg.vocab_size == 1024 and cfg.max_position_embeddings == 2048
    assert cfg.eos_token_ids == (1, 3)  # <|end_of_text|> from config, <|im_end|> from generation
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert state["lm_head.weight"].shape == (1024, 64)


def test_logits_match_transformers(model_dir: Path, model: Llama) -> None:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        ours = model.forward_full(ids)
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_output_is_varied(model: Llama) -> None:
    seq = [0, 5, 100]
    for _ in range(24):
        seq.append(int(model.forward_full(torch.tensor(seq))[-1].argmax()))
    assert len(set(seq[3:])) > 8


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_prefill_and_decode_match_full_logits(model: Llama, page_size: int) -> None:
    kv = model.new_kv_cache(num_pages=64, page_size=page_size)
    assert kv.shape == (64, 2, 2, page_size, 2, 16)
    full = [model.forward_full(torch.tensor(p)) for p in PROMPTS]
    # Scattered, interleaved page ids so a wrong page lookup cannot go unnoticed.
    free = list(range(63, -1, -1))
    pages = [[free.pop(3 * (i % 2)) for i in range(-(-len(p) // page_size))] for p in PROMPTS]
    # Prefill everything except the last 3 tokens of each prompt (prompt 2 in two chunks).
    for i, p in enumerate(PROMPTS):
        n = max(1, len(p) - 3)
        pt = torch.tensor(pages[i])
        if i == 2:
            a = model.prefill(kv, torch.tensor(p[:10]), pt, all_logits=True)
            torch.testing.assert_close(a, full[i][:10], atol=1e-4, rtol=1e-4)
            b = model.prefill(kv, torch.tensor(p[10:n]), pt, start_pos=10, all_logits=True)
            torch.testing.assert_close(b, full[i][10:n], atol=1e-4, rtol=1e-4)
        else:
            last = model.prefill(kv, torch.tensor(p[:n]), pt)
            torch.testing.assert_close(last, full[i][n - 1], atol=1e-4, rtol=1e-4)
    # Decode the rest, all sequences in one batch per step, until each prompt is used up.
    pos = [max(1, len(p) - 3) for p in PROMPTS]
    while True:
        live = [i for i, p in enumerate(PROMPTS) if pos[i] < len(p)]
        if not live:
            break
        toks = torch.tensor([PROMPTS[i][pos[i]] for i in live])
        positions = torch.tensor([pos[i] for i in live])
        table = page_table([pages[i][: pos[i] // page_size + 1] for i in live])
        logits = model.decode(kv, toks, positions, table)
        for row, i in enumerate(live):
            torch.testing.assert_close(logits[row], full[i][pos[i]], atol=1e-4, rtol=1e-4)
            pos[i] += 1


@pytest.mark.parametrize("page_size", [4, 16])
def test_one_step_of_prefills_and_decode_rows_matches_full_logits(model: Llama,
                                                                  page_size: int) -> None:
    """What the engine runs each step: several prompts' prefills (one from scratch, one after
    a cached prefix) and decode rows of others, in one pass through the layers."""
    kv = model.new_kv_cache(num_pages=64, page_size=page_size)
    full = [model.forward_full(torch.tensor(p)) for p in PROMPTS]
    free = list(range(63, -1, -1))
    pages = [[free.pop(3 * (i % 2)) for i in range(-(-len(p) // page_size))] for p in PROMPTS]
    tables = [torch.tensor(p) for p in pages]
    # Before the step: prompt 1 has its first 4 tokens cached, prompts 0 and 3 all but the last.
    model.prefill(kv, torch.tensor(PROMPTS[1][:4]), tables[1])
    for i in (0, 3):
        model.prefill(kv, torch.tensor(PROMPTS[i][:-1]), tables[i])
    prefills = [Prefill(tables[2], 0, len(PROMPTS[2])), Prefill(tables[1], 4, len(PROMPTS[1]) - 4)]
    ids = PROMPTS[2] + PROMPTS[1][4:] + [PROMPTS[0][-1], PROMPTS[3][-1]]
    pos = [len(PROMPTS[0]) - 1, len(PROMPTS[3]) - 1]
    decode = Decode(page_table([pages[0], pages[3]]), torch.tensor(pos))
    logits = model.step(kv, torch.tensor(ids), prefills, decode)
    assert logits.shape == (4, model.config.vocab_size)
    for row, (i, at) in enumerate([(2, -1), (1, -1), (0, pos[0]), (3, pos[1])]):
        torch.testing.assert_close(logits[row], full[i][at], atol=1e-4, rtol=1e-4)
    # The K/V it wrote are what later steps read: one more decode step over prompts 2 and 1.
    nxt = [PROMPTS[2][-1], PROMPTS[1][-1]]
    more = model.decode(kv, torch.tensor(nxt), torch.tensor([len(PROMPTS[2]), len(PROMPTS[1])]),
                        page_table([pages[2], pages[1]]))
    for row, i in enumerate((2, 1)):
        seq = PROMPTS[i] + [nxt[row]]
        torch.testing.assert_close(more[row], model.forward_full(torch.tensor(seq))[-1],
                                   atol=1e-4, rtol=1e-4)


def test_tokenizer_round_trips_utf8(model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 1024
    texts = ["héllo 世界 🎉", "The river ran slowly.", "  tabs\tand\nnewlines  ", "ñ€𝄞\u0000"]
    for text in texts:
        enc = tok.encode(text)
        assert enc.ids[0] == tok.token_to_id("<|begin_of_text|>")
        assert tok.decode(enc.ids) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    common = tok.encode(" the library", add_special_tokens=False)
    assert len(common.ids) <= 3  # learned merges, not bytes
    for special in ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"):
        assert tok.encode(special, add_special_tokens=False).ids == [tok.token_to_id(special)]


def test_chat_template_renders(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    template = env.from_string(cfg["chat_template"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user",
         "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    text = template.render(messages=messages, bos_token=cfg["bos_token"],
                           add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = template.render(messages=messages[:1], bos_token=cfg["bos_token"])
    assert no_prompt.endswith("<|im_end|>\n")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3 and ids[0] == 0


def test_transformers_reads_the_tokenizer(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "héllo"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(ids) == (
        "<|begin_of_text|><|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.bos_token_id == 0
