"""The GPU machine's script, on a CPU: what it does that needs no GPU (tests/gpu/run_on_device.py).

The wheels it carries are checked (each pinned one there, one version each), installed into a
scratch target for the device's Python, and the tests it will run are collected. Without the real
wheels (CI does not download them) the same path runs over stand-in wheels of the same names and
versions; with `.whl/` present (`make gpu-wheels`), over the real ones too."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.gpu.run_on_device import WHEELS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "gpu" / "run_on_device.sh"




def stand_in_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of that name and version (installs anywhere)."""
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}_stand_in.py", "")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def run(*args: str, python: str = sys.executable,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env={**(env or os.environ), "PYTHON": python})


def stand_in_wheels(folder: Path) -> Path:
    folder.mkdir()
    for name, version in WHEELS.items():
        stand_in_wheel(folder, name, version)
    return folder


def test_dry_run_installs_the_wheels_and_collects_the_gpu_tests(tmp_path: Path) -> None:
    wheels = stand_in_wheels(tmp_path / "wheels")
    site = tmp_path / "site"
    out = run("--dry-run", "--wheels", str(wheels), "--site", str(site))
    assert out.returncode == 0, out.stdout + out.stderr
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert installed == {n.replace("-", "_") for n in WHEELS}
    assert "tests/gpu/test_pd_cuda.py::test_pd_on_cuda_equals_agg" in out.stdout
    for step in ("kv: perf.transfer.bench_kv_handoff takes --memory cuda", "load_agg: perf.streaming.sweep takes",
                 "load_1p1d: perf.streaming.sweep takes"):
        assert step in out.stdout


@pytest.mark.parametrize("problem", ["missing", "two versions", "wrong version"])
def test_dry_run_refuses_a_bad_wheel_set_by_name(tmp_path: Path, problem: str) -> None:
    for name, version in WHEELS.items():
        if not (problem == "missing" and name == "msgspec"):
            stand_in_wheel(tmp_path, name, version)
    if problem == "two versions":
        stand_in_wheel(tmp_path, "msgspec", "0.0.1")
    if problem == "wrong version":
        (tmp_path / f"msgspec-{WHEELS['msgspec']}-py3-none-any.whl").unlink()
        stand_in_wheel(tmp_path, "msgspec", "0.0.1")
    out = run("--dry-run", "--wheels", str(tmp_path), "--site", str(tmp_path / "site"))
    assert out.returncode != 0
    assert "msgspec" in out.stderr and "wheels in" in out.stderr, out.stderr
    assert not (tmp_path / "site").exists()  # nothing installed


def test_the_pins_are_within_the_projects_ranges() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ranges = {(r := Requirement(d)).name.lower(): r.specifier for d in deps}
    for name, version in WHEELS.items():
        if name in ranges:
            assert version in ranges[name], f"{name}=={version} is outside pyproject's {ranges[name]}"
    nixl = (REPO / "Makefile").read_text()
    assert f"nixl=={WHEELS['nixl']} nixl-cu13=={WHEELS['nixl-cu13']}" in nixl


def test_gpu_tests_live_where_the_script_looks() -> None:
    """The script runs `pytest -m gpu tests/gpu`: a gpu-marked test elsewhere would never run."""
    elsewhere = [p for p in (REPO / "tests").rglob("test_*.py")
                 if "mark.gpu" in p.read_text() and p.parent.name != "gpu"]
    assert not elsewhere


@pytest.mark.skipif(not (REPO / ".whl").is_dir(), reason="no .whl/ (make gpu-wheels)")
def test_dry_run_over_the_real_wheels(tmp_path: Path) -> None:
    out = run("--dry-run", "--site", str(tmp_path / "site"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dry run ok" in out.stdout


def test_dry_run_with_a_python_that_has_no_tandem_installed(tmp_path: Path) -> None:
    """As on the device: an interpreter with the libraries but no tandem (this one's base
    interpreter, this environment's packages on its path: a path entry's .pth files, tandem's
    editable install among them, are not read). The dry run's steps get the real run's path,
    tandem from this tree, so the GPU tests are collected."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if not base.exists() or sys.prefix == sys.base_prefix:
        pytest.skip("needs a virtual environment over a base interpreter")
    packages = sysconfig.get_paths()["purelib"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["PYTHONPATH"] = packages
    no_tandem = subprocess.run([str(base), "-c", "import tandem"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)
    assert "No module named 'tandem'" in no_tandem.stderr  # (the premise)
    out = run("--dry-run", "--wheels", str(stand_in_wheels(tmp_path / "wheels")), "--site",
              str(tmp_path / "site"), python=str(base), env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tests/gpu/test_pd_cuda.py::test_pd_on_cuda_equals_agg" in out.stdout
    assert "dry run ok" in out.stdout
