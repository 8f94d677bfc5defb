"""`--engine sglang --device cpu` without SGLang running: the flags and pool tandem adds, the worker
config and its help, and the torchvision stand-in (used only when the real one does not import;
any submodule and attribute exists, using one fails naming it). Each stand-in case runs in a fresh
interpreter, since it changes sys.path and sys.modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.engines import sglang_cpu
from tandem.engines.sglang import SGLangEngine, SGLangOptions, server_argv

ROOT = Path(__file__).resolve().parents[2]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_cpu_adds_sglangs_cpu_flags_and_a_bounded_pool() -> None:
    argv = server_argv(SGLangOptions(model="/m", device="cpu"))
    assert flag(argv, "--device") == "cpu" and "--disable-overlap-schedule" in argv
    assert flag(argv, "--max-total-tokens") == str(sglang_cpu.DEFAULT_MAX_TOTAL_TOKENS)
    argv = server_argv(SGLangOptions(model="/m", device="cpu", num_pages=10, page_size=32))
    assert flag(argv, "--max-total-tokens") == "320"
    engine = SGLangEngine(SGLangOptions(model="/m", device="cpu", page_size=32))
    assert engine.num_pages == sglang_cpu.DEFAULT_MAX_TOTAL_TOKENS // 32  # what load() reports


@pytest.mark.parametrize(("device", "added"), [
    ("", []), ("cuda", ["--device", "cuda"]),
    ("cuda:3", ["--device", "cuda", "--base-gpu-id", "3"]),
])
def test_a_gpu_device_adds_no_cpu_flag(device: str, added: list[str]) -> None:
    argv = server_argv(SGLangOptions(model="/m", device=device))
    assert "--disable-overlap-schedule" not in argv and "--max-total-tokens" not in argv
    assert argv[len(argv) - len(added):] == added if added else "--device" not in argv


def test_the_worker_takes_device_cpu_for_sglang_and_says_what_it_sets(tmp_path: Path) -> None:
    from tandem.cli import parse
    from tandem.config import WorkerConfig

    (tmp_path / "config.json").write_text("{}")
    cfg = parse(["worker", "--engine", "sglang", "--model", str(tmp_path), "--device", "cpu",
                 "--dtype", "float32"]).config
    assert isinstance(cfg, WorkerConfig)
    assert cfg.device == "cpu" and cfg.engine_args == ("--dtype", "float32")
    assert SGLangOptions.from_config(cfg).device == "cpu"
    assert WorkerConfig.device == ""  # each engine's own default: the CPU, or SGLang's GPU
    for said in ("SGLANG_USE_CPU_ENGINE=1", "--disable-overlap-schedule", "--max-total-tokens",
                 "torchvision"):
        assert said in sglang_cpu.DEVICE_HELP


def run(code: str, *path: Path) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter whose sys.path starts with `path`."""
    setup = f"import sys; sys.path[:0] = {[str(p) for p in path]!r}\n"
    return subprocess.run([sys.executable, "-c", setup + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


STANDIN_USE = """
    import os
    from tandem.engines import sglang_cpu
    sglang_cpu.prepare()
    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
    import torchvision
    print(getattr(torchvision, "TANDEM_STANDIN", False))
"""


def test_the_stand_in_is_used_when_torchvision_is_absent_or_broken(tmp_path: Path) -> None:
    absent = run(STANDIN_USE)
    assert absent.returncode == 0 and absent.stdout.strip() == "True", absent.stderr
    broken = tmp_path / "broken"
    (broken / "torchvision").mkdir(parents=True)
    (broken / "torchvision" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    res = run(STANDIN_USE, broken)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr
    real = tmp_path / "real"
    (real / "torchvision").mkdir(parents=True)
    (real / "torchvision" / "__init__.py").write_text("__version__ = '0.28.0'\n")
    res = run(STANDIN_USE, real)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


def test_the_stand_in_imports_anything_and_fails_only_when_used() -> None:
    res = run("""
        import torchvision
        import torchvision.transforms.v2.functional as tvF
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms import functional as F
        from torchvision import transforms
        mode = InterpolationMode.BICUBIC  # module-level use in SGLang: attribute access only
        assert torchvision.TANDEM_STANDIN and "stand-in" in repr(mode)

        class Processor(transforms.Compose):  # a class derived from one: defined
            pass

        for use in (lambda: tvF.resize(None, 1), lambda: F.to_tensor(None), Processor,
                    lambda: torchvision.ops.nms(None, None, 0.5)):
            try:
                use()
            except ImportError as e:
                assert "torchvision is not installed" in str(e), e
            else:
                raise AssertionError("no error")
        print("ok")
    """, sglang_cpu.STANDINS)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
