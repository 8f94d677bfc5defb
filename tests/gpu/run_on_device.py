"""tandem on a GPU machine in one run: the CUDA tests, the KV handoff in VRAM, a streamed load.

On a bare GPU machine (Python 3.12, a CUDA build of torch, no package index), from the repository
root, with the wheels below in `.whl/`:

    tests/gpu/run_on_device.sh [--results DIR] [--budget-s 480]

It installs tandem's missing dependencies from those wheels into a scratch folder (nothing else
is installed; tandem itself runs from this tree), then runs, each with a deadline and all within
the budget (a step that would start past it is skipped and says so):
  1. env      what the machine has (GPU, driver, torch, the carried packages)
  2. tests    `pytest -m gpu tests/gpu`: 1P1D on CUDA equals aggregated serving token for token,
              greedy and seeded, every page free afterwards (junit.xml)
  3. kv       perf/transfer/bench_kv_handoff.py --memory cuda: NIXL WRITE between two processes on one GPU
              (VRAM on both sides, UCX cuda_ipc) at 1 MiB, 64 MiB and 1 GiB, beside a
              device-to-device copy of as many bytes in the same run (kv_handoff.json)
  4. load     perf.streaming.sweep through the frontend on the reference engine on CUDA, agg and 1P1D:
              TTFT and tok/s per concurrency (load_agg.json, load_1p1d.json)
and prints a short table last (summary.md). Every log, the clusters' too, is in logs.tar.gz.
The results folder is --results, else $OUT where that is set (a device machine's return folder),
else ./gpu-results; it never holds more than 8 files.

Getting the wheels, here, on a machine that reaches the package index (about 61 MB; they travel
with the tree, `.whl/` is git-ignored):

    make gpu-wheels          # = python3 tests/gpu/run_on_device.py --fetch

Which ones: WHEELS below, pinned to the versions CI tests (pyproject.toml's ranges hold them; a
test checks). The machine already has torch, transformers, tokenizers, jinja2, numpy,
safetensors, prometheus-client, uvloop, psutil, pytest, pytest-timeout, matplotlib. granian is
left out (only `--http-server granian` imports it).

On any machine, no GPU needed: `--dry-run` checks the wheels (each one there, one version each),
installs them into a scratch target for the device's Python (3.12, manylinux x86_64), checks that
the GPU tests are collected and that the benchmark commands start, in the environment the real
run gives its steps (`device_env`: tandem from this tree, never an installed one; the wheels'
target on the path when this Python is the device's 3.12), and runs nothing on a GPU.
tests/gpu/test_run_on_device.py runs it in `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# distribution -> version: what the device lacks, at the versions CI's venv runs.
WHEELS = {
    "pyzmq": "27.3.0",
    "msgspec": "0.22.0",
    "uvicorn": "0.54.0",
    "httptools": "0.9.0",
    "nixl": "1.5.1",
    "nixl-cu13": "1.5.1",
}
# The device's interpreter and platform, for `pip download` and the install into the target.
TARGET_PYTHON = (3, 12)
TARGET_TAGS = [
    "--python-version", "%d.%d" % TARGET_PYTHON, "--implementation", "cp", "--only-binary=:all:",
    *(a for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                    "manylinux2014_x86_64", "manylinux1_x86_64") for a in ("--platform", tag)),
]
UCX_ENV = {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,cma", "UCX_NET_DEVICES": "lo",
           "NIXL_LOG_LEVEL": "WARN"}
KV_SIZES_MIB = ["1", "64", "1024"]
LOAD_SHAPES = ("agg", "1p1d")
LOAD_ARGS = ["--concurrency", "1,16,64", "--requests-per-level", "32", "--max-tokens", "64"]
WORKER_ARGS = "--engine reference --device cuda:0 --max-batch 64 --num-pages 4096"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_dist(path: Path) -> tuple[str, str]:
    """(normalized distribution name, version) from a wheel's file name."""
    parts = path.name.split("-")
    if not path.name.endswith(".whl") or len(parts) < 5:
        raise ValueError(f"{path.name} is not a wheel file name")
    return norm(parts[0]), parts[1]


def check_wheels(folder: Path) -> list[Path]:
    """The wheels to install: each of WHEELS once, at its version. Raises SystemExit(why)."""
    if not folder.is_dir():
        raise SystemExit(f"no wheel folder {folder}: run `make gpu-wheels` where pip reaches the "
                         f"index, and carry {folder.name} with the tree")
    found: dict[str, list[tuple[str, Path]]] = {}
    for p in sorted(folder.glob("*.whl")):
        name, version = wheel_dist(p)
        found.setdefault(name, []).append((version, p))
    problems = []
    for name, version in WHEELS.items():
        have = found.get(norm(name), [])
        if not have:
            problems.append(f"missing {name}=={version}")
        elif len(have) > 1:
            problems.append(f"{name}: {len(have)} wheels ({', '.join(v for v, _ in have)}); "
                            "keep one")
        elif have[0][0] != version:
            problems.append(f"{name}: wheel is {have[0][0]}, the pin is {version}")
    extra = sorted(set(found) - {norm(n) for n in WHEELS})
    if problems:
        raise SystemExit(f"wheels in {folder}: " + "; ".join(problems))
    if extra:
        print(f"note: {folder} also holds {', '.join(extra)} (not installed)")
    return [found[norm(n)][0][1] for n in WHEELS]


def fetch(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    for p in folder.glob("*.whl"):  # another version of one of ours would make two
        if wheel_dist(p)[0] in {norm(n) for n in WHEELS}:
            p.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *TARGET_TAGS,
           "-d", str(folder), *(f"{n}=={v}" for n, v in WHEELS.items())]
    print(" ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc == 0:
        check_wheels(folder)
        mb = sum(p.stat().st_size for p in folder.glob("*.whl")) / 1e6
        print(f"{len(WHEELS)} wheels in {folder}, {mb:.1f} MB")
    return rc


def install(wheels: list[Path], site: Path) -> None:
    """Unpack the wheels into `site` for the device's interpreter (no index, no dependencies)."""
    shutil.rmtree(site, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--target", str(site), *TARGET_TAGS,
           *map(str, wheels)]
    subprocess.run(cmd, check=True, timeout=300)
    installed = {norm(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    missing = [n for n in WHEELS if norm(n) not in installed]
    if missing:
        raise SystemExit(f"installed into {site}, but no dist-info for {', '.join(missing)}")


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: float
    outcome: str = "not run"
    seconds: float = 0.0
    tail: list[str] = field(default_factory=list)


class Runner:
    """Runs steps one after another, each to its deadline and all within the budget; a step's
    output goes to LOGS/NAME.log. A step that times out is killed with its process group."""

    def __init__(self, logs: Path, env: dict[str, str], budget_s: float) -> None:
        self.logs, self.env = logs, env
        self.end = time.monotonic() + budget_s
        self.steps: list[Step] = []

    def run(self, step: Step) -> bool:
        self.steps.append(step)
        left = self.end - time.monotonic()
        if left < 20:
            step.outcome = "skipped: the budget is spent"
            print(f"== {step.name}: {step.outcome}", flush=True)
            return False
        timeout = min(step.timeout_s, left)
        print(f"== {step.name} (deadline {timeout:.0f} s): {' '.join(step.argv)}", flush=True)
        log = self.logs / f"{step.name}.log"
        t0 = time.monotonic()
        with open(log, "wb") as out:
            p = subprocess.Popen(step.argv, cwd=REPO, env=self.env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout)
                step.outcome = "ok" if rc == 0 else f"failed (exit {rc})"
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
                step.outcome = f"timed out after {timeout:.0f} s"
        step.seconds = time.monotonic() - t0
        step.tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"   {step.outcome} in {step.seconds:.0f} s", flush=True)
        if step.outcome != "ok":
            print("   " + "\n   ".join(step.tail), flush=True)
        return step.outcome == "ok"


def plan(py: str, work: Path, results: Path) -> list[Step]:
    model = str(work / "tiny")
    steps = [
        Step("env", [py, "-c", ENV_PROBE], 120),
        Step("model", [py, "-m", "tandem.cli", "model", "init", model], 120),
        Step("tests", [py, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "gpu",
                       "tests/gpu", f"--junitxml={results / 'junit.xml'}",
                       f"--basetemp={work / 'pytest'}"], 300),
        Step("kv", [py, "perf/transfer/bench_kv_handoff.py", "--memory", "cuda", "--sizes-mib",
                    *KV_SIZES_MIB, "--reps", "5", "--out", str(work / "kv")], 240),
    ]
    for shape in LOAD_SHAPES:
        steps.append(Step(f"load_{shape}", [
            py, "-m", "perf.streaming.sweep", "--launch", shape, "--model", model, *LOAD_ARGS,
            "--worker-args", WORKER_ARGS, "--out", str(work / f"load_{shape}")], 150))
    return steps


ENV_PROBE = """
import importlib.metadata as md, platform, subprocess, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory >> 30,
      "GiB")
print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
for n in ("pyzmq", "msgspec", "uvicorn", "httptools", "nixl", "nixl-cu13", "numpy",
          "tokenizers", "transformers", "pytest", "uvloop", "matplotlib"):
    try:
        print(n, md.version(n))
    except md.PackageNotFoundError:
        print(n, "MISSING")
import nixl._api, zmq, msgspec, uvicorn, httptools
print("imports ok")
"""


def summary(steps: list[Step], results: Path, work: Path) -> str:
    rows = ["| step | outcome | seconds |", "|---|---|---:|"]
    rows += [f"| {s.name} | {s.outcome} | {s.seconds:.0f} |" for s in steps]
    out = ["## Steps", "", *rows, ""]
    junit = results / "junit.xml"
    if junit.exists():
        out += ["## GPU tests", ""]
        for case in ET.parse(junit).getroot().iter("testcase"):
            verdict = "passed"
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    verdict = f"{tag}: {(el.get('message') or '')[:160]}"
            out.append(f"- {case.get('name')}: {verdict} ({float(case.get('time', 0)):.1f} s)")
        out.append("")
    kv = work / "kv" / "kv_handoff.json"
    if kv.exists():
        data = json.loads(kv.read_text())
        out += ["## KV handoff, VRAM to VRAM (GB/s, median; 1 GB = 1e9 bytes)", "",
                "| pages | handoff | descriptors | nixl x1 | nixl x2 | d2d copy | x2 / d2d |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for c in data["cases"]:
            m = c["gbps_median"]
            d2d = m.get("d2d copy", m["copy"])
            out.append(f"| {c['shape']} | {c['handoff_mib']} MiB | {c['num_descriptors']} | "
                       f"{m['x1']:.1f} | {m['x2']:.1f} | {d2d:.1f} | {m['x2'] / d2d:.2f} |")
        out.append("")
    for shape in LOAD_SHAPES:
        f = work / f"load_{shape}.json"
        if not f.exists():
            continue
        out += [f"## Streamed load, {shape}, reference engine on CUDA (64 tokens per request)", "",
                "| concurrency | requests | failed | tok/s | TTFT p50 ms | TTFT p99 ms | "
                "ITL p50 ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in json.loads(f.read_text())["levels"]:
            out.append(f"| {r['concurrency']} | {r['requests']} | {r['failed']} | "
                       f"{r['tokens_per_s']:.0f} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} "
                       f"| {r['itl_p50_ms']:.2f} |")
        out.append("")
    return "\n".join(out)


def device_env(site: Path | None) -> dict[str, str]:
    """The environment every step runs in, the dry run's too: tandem from this tree (the machine
    has it nowhere else), the carried wheels' `site` before what the machine has, then any
    PYTHONPATH the caller set; UCX's settings unless the caller set them."""
    path = [*([str(site)] if site is not None else []), str(REPO / "runtime"),
            str(REPO / "components"), str(REPO)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, **{k: os.environ.get(k, v) for k, v in UCX_ENV.items()},
            "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}


def dry_run(wheels: list[Path], site: Path, py: str) -> int:
    """Everything that needs no GPU: the wheels install into a target for the device's Python,
    the GPU tests are collected, the benchmark commands start."""
    install(wheels, site)
    print(f"installed {len(wheels)} wheels into {site} for cp312 manylinux x86_64")
    target = sys.version_info[:2] == TARGET_PYTHON
    if not target:  # (their compiled modules would not load here; this Python's own are used)
        print(f"this is Python {sys.version_info[0]}.{sys.version_info[1]}, the wheels are for "
              f"{TARGET_PYTHON[0]}.{TARGET_PYTHON[1]}: checking with this Python's packages in "
              "their place, on the real run's path otherwise")
    env = device_env(site if target else None)
    out = subprocess.run([py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "gpu", "tests/gpu"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    ids = [ln for ln in out.stdout.splitlines() if "::" in ln]
    if out.returncode != 0 or not ids:
        print(out.stdout[-3000:], out.stderr[-3000:])
        raise SystemExit("the GPU tests were not collected")
    print(f"collected {len(ids)} GPU tests:", *ids, sep="\n  ")
    work = Path(tempfile.mkdtemp(prefix="tandem-gpu-dry-"))
    for step in plan(py, work, work):  # the benchmarks' own parsers take the steps' arguments
        if step.name == "kv":
            module, args = "perf.transfer.bench_kv_handoff", step.argv[2:]
        elif step.name.startswith("load_"):
            module, args = "perf.streaming.sweep", step.argv[3:]
        else:
            continue
        probe = f"import sys; from {module} import parse_args; parse_args(sys.argv[1:])"
        subprocess.run([py, "-c", probe, *args], cwd=REPO, env=env, check=True, timeout=120)
        print(f"{step.name}: {module} takes {' '.join(args)}")
    shutil.rmtree(work, ignore_errors=True)
    print("dry run ok")
    return 0


def real_run(wheels: list[Path], site: Path, results: Path, budget_s: float) -> int:
    if shutil.which("nvidia-smi") is None:
        raise SystemExit("no GPU here (nvidia-smi not found): use --dry-run")
    results.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tandem-gpu-"))
    logs = work / "logs"
    logs.mkdir()
    install(wheels, site)
    env = device_env(site)
    runner = Runner(logs, env, budget_s)
    py = sys.executable
    for step in plan(py, work, results):
        if not runner.run(step) and step.name in ("env", "model"):
            break  # nothing after these can run
    for name in ("kv/kv_handoff.json", *(f"load_{s}.json" for s in LOAD_SHAPES)):
        if (work / name).exists():
            shutil.copy(work / name, results / Path(name).name)
    text = summary(runner.steps, results, work)
    (results / "summary.md").write_text(text + "\n")
    (results / "env.txt").write_text((logs / "env.log").read_text(errors="replace")
                                     if (logs / "env.log").exists() else "no env step\n")
    with tarfile.open(results / "logs.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="tandem-gpu", filter=lambda ti: None if ti.name.endswith(
            (".safetensors", ".png")) else ti)
    print(f"\nresults in {results}\n")
    print(text)
    return 0 if all(s.outcome == "ok" for s in runner.steps) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fetch", action="store_true", help="download the wheels (needs the index)")
    mode.add_argument("--dry-run", action="store_true", help="check all that needs no GPU")
    ap.add_argument("--wheels", type=Path, default=REPO / ".whl", help="the wheel folder")
    ap.add_argument("--site", type=Path, default=None,
                    help="where the wheels are installed (default: a new temporary folder)")
    ap.add_argument("--results", type=Path, default=None,
                    help="the results folder (default: $OUT if set, else ./gpu-results)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="seconds for all steps together; a step that would start past it is "
                         "skipped (default 480)")
    args = ap.parse_args(argv)
    if args.fetch:
        return fetch(args.wheels)
    wheels = check_wheels(args.wheels)
    with tempfile.TemporaryDirectory(prefix="tandem-site-") as scratch:
        site = args.site or Path(scratch)
        if args.dry_run:
            return dry_run(wheels, site, sys.executable)
        results = args.results or Path(os.environ.get("OUT") or REPO / "gpu-results")
        return real_run(wheels, site, results, args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
