"""`--engine sglang --device cpu` without SGLang running: the flags and pool tandem adds, the worker
config and its help, and the torchvision stand-in (used only when the real one does not import;
any submodule and attribute exists, using one fails naming it). Each stand-in case runs in a fresh
interpreter, since it changes sys.path and sys.modules."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

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


# --- PD on a CPU: SGLang's KV pool described to NIXL as host memory --------------------------------

class Agent:
    """NIXL's agent, as far as the wrapper sees it: methods with a memory-type parameter."""

    def register_memory(self, reg_list: object, mem_type: str | None = None,
                        backends: tuple[str, ...] = ()) -> str | None:
        return mem_type

    def get_xfer_descs(self, descs: object, mem_type: str | None = None) -> str | None:
        return mem_type


def test_the_wrapper_reads_vram_as_dram_positional_or_by_keyword() -> None:
    class Wrapped(Agent):
        pass

    cls: Any = Wrapped
    sglang_cpu.nixl_on_host(cls, ("register_memory", "get_xfer_descs"))
    sglang_cpu.nixl_on_host(cls, ("register_memory", "get_xfer_descs"))  # not wrapped twice
    a = cls()
    assert a.register_memory([], "VRAM") == "DRAM"
    assert a.register_memory([], mem_type="VRAM") == "DRAM"
    assert a.get_xfer_descs([], "VRAM") == "DRAM" and a.get_xfer_descs([], "DRAM") == "DRAM"
    assert a.register_memory([], None) is None and a.get_xfer_descs([]) is None
    assert cls.register_memory.__wrapped__ is Agent.register_memory  # wrapped once
    assert Agent().register_memory([], "VRAM") == "VRAM"  # the base class untouched
    with pytest.raises(RuntimeError, match="mem_type"):
        sglang_cpu.host_mem_type(lambda self, descs: None)


def test_every_memory_typed_method_of_nixls_agent_is_wrapped() -> None:
    """A NIXL release with a new memory-typed method fails here, not as a UCX error in PD."""
    nixl_api = pytest.importorskip("nixl._api", reason="NIXL is not installed")
    typed = {name for name, fn in inspect.getmembers(nixl_api.nixl_agent, inspect.isfunction)
             if sglang_cpu.NIXL_MEM_PARAM in inspect.signature(fn).parameters}
    assert typed == set(sglang_cpu.NIXL_MEM_TYPED)


def _source(module: str) -> ast.Module:
    """An installed sglang module's source, found without importing its packages (some need a
    CUDA torchvision)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed: pip install --no-deps -r tests/sglang/requirements.txt")
    path = Path(spec.origin).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return ast.parse(path.read_text(encoding="utf-8"))


def test_sglangs_nixl_transfer_passes_memory_types_only_where_the_wrapper_reads_them() -> None:
    """Every call SGLang's NIXL transfer makes on its agent with a memory type (a literal, or a
    variable named for one) is to a method tandem wraps; and the calls REAL.md found are there, so
    the scan is not vacuous. A later SGLang that moves the memory type elsewhere fails here."""
    tree = _source("sglang.srt.disaggregation.nixl.conn")
    typed_calls: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = ast.unparse(node.func.value)
        if not receiver.endswith("agent"):
            continue
        args = [*node.args, *(k.value for k in node.keywords)]
        for arg in args:
            text = ast.unparse(arg)
            if text in ("'VRAM'", "'DRAM'") or "mem_kind" in text or "mem_type" in text:
                typed_calls.add(node.func.attr)
    assert {"register_memory", "get_xfer_descs", "prep_xfer_dlist"} <= typed_calls
    assert typed_calls <= set(sglang_cpu.NIXL_MEM_TYPED), typed_calls


def test_sglangs_engine_has_the_scheduler_seam_the_cpu_engine_uses() -> None:
    """`Engine.run_scheduler_process_func`: the scheduler process's entry point, a class attribute
    a subclass may replace (tandem's CPU engine runs `run_scheduler` there)."""
    tree = _source("sglang.srt.entrypoints.engine")
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert any(isinstance(n, ast.AnnAssign) and ast.unparse(n.target) ==
               "run_scheduler_process_func" for n in cls.body)
    assert "self.run_scheduler_process_func" in ast.unparse(cls)
    argv = server_argv(SGLangOptions(model="/m", device="cpu", role="decode"))
    assert flag(argv, "--disaggregation-decode-retraction-backup") == "cpu_tensor"
    assert "--disaggregation-decode-retraction-backup" not in server_argv(
        SGLangOptions(model="/m", device="cpu", role="prefill"))


def test_float32_turns_sglangs_amx_choice_off_now_and_for_later_imports() -> None:
    from types import SimpleNamespace

    common = SimpleNamespace(is_amx_tile_supported=True)
    loaded = {"sglang.srt.layers.layernorm": SimpleNamespace(_is_cpu_amx_available=True),
              "sglang.srt.layers.other": SimpleNamespace(),
              "numpy": SimpleNamespace(_is_cpu_amx_available=True)}
    sglang_cpu.float32_kernels(common, loaded)
    assert common.is_amx_tile_supported is False  # what cpu_has_amx_support() reads later
    assert loaded["sglang.srt.layers.layernorm"]._is_cpu_amx_available is False
    assert loaded["numpy"]._is_cpu_amx_available is True  # only SGLang's modules


def test_sglangs_amx_choice_is_the_one_float32_kernels_turns_off() -> None:
    """SGLang's modules decide `_is_cpu_amx_available = cpu_has_amx_support()` at import, and
    cpu_has_amx_support reads the module global `is_amx_tile_supported`: a later SGLang that
    decides elsewhere fails here."""
    common = ast.unparse(_source("sglang.srt.utils.common"))
    assert "def cpu_has_amx_support():\n    return is_amx_tile_supported and" in common
    layernorm = ast.unparse(_source("sglang.srt.layers.layernorm"))
    assert "_is_cpu_amx_available = cpu_has_amx_support()" in layernorm
