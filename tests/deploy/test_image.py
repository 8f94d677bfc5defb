"""The container images (Containerfile, launch/image.sh, `make image`).

Static, always: the Containerfile's versions equal the project's pins and the manifests' tags;
both final stages run as an unprivileged user and hold no model and no build tools; the build
context is only the wheelhouse and perf/. Running, where podman and the CPU image are here: the
image starts a 1P1D mock cluster (`tandem up`), the host streams a completion from it, and the
sweep Job's command runs in it against that cluster.
"""

from __future__ import annotations

import hashlib
import re
import resource
import secrets
import shutil
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import K8S, REPO
from tests.deploy.test_launch_run import free_base
from tests.sse import Stream

CF = REPO / "Containerfile"
SCRIPT = REPO / "launch" / "image.sh"


def containerfile_args() -> dict[str, str]:
    """Every `ARG NAME=default` of the Containerfile (the first one of each name)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^ARG (\w+)=(\S+)$", CF.read_text(), re.M):
        out.setdefault(m.group(1), m.group(2))
    return out


def stages() -> dict[str, list[str]]:
    """Each stage's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", CF.read_text())
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM (\S+) AS (\S+)$", line)
        if m:
            current = out.setdefault(m.group(2), [line])
        elif out:
            current.append(line)
    return out


ARGS = containerfile_args()
VERSION = ARGS["TANDEM_VERSION"]
CPU_IMAGE = f"localhost/tandem:{VERSION}-cpu"


# --- versions ----------------------------------------------------------------------------------

def test_the_containerfile_versions_are_the_projects_pins() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    make = (REPO / "Makefile").read_text()
    sglang_req = (REPO / "tests" / "sglang" / "requirements.txt").read_text()
    assert ARGS["TANDEM_VERSION"] == project["version"]
    assert project["optional-dependencies"]["sglang"] == [f"sglang=={ARGS['SGLANG_VERSION']}"]
    assert re.search(rf"^sglang=={re.escape(ARGS['SGLANG_VERSION'])}$", sglang_req, re.M)
    reference = project["optional-dependencies"]["reference"]  # (torch, and xgrammar for grammars)
    assert f"torch=={ARGS['TORCH_VERSION']}" in reference and all("==" in r for r in reference)
    assert re.search(rf"^TORCH\s*:= torch=={re.escape(ARGS['TORCH_VERSION'])}$", make, re.M)
    nixl = re.escape(ARGS["NIXL_VERSION"])
    assert re.search(rf"^NIXL\s*:= nixl=={nixl} nixl-cu13=={nixl}$", make, re.M)
    # SGLang's image of that very release, its CUDA 13 build (what nixl-cu13 is built for).
    assert ARGS["SGLANG_IMAGE"] == \
        "docker.io/lmsysorg/sglang:v${SGLANG_VERSION}-cu130-runtime"


def test_the_manifests_name_the_images_that_launch_image_sh_builds() -> None:
    tags = {}
    for k in (K8S / "base" / "kustomization.yaml", K8S / "sweep" / "kustomization.yaml"):
        for image in yaml.safe_load(k.read_text())["images"]:
            assert image["newName"] == "registry.example.com/tandem", k
            tags.setdefault(image["name"], set()).add(image["newTag"])
    assert tags == {"tandem": {VERSION}, "tandem-cpu": {f"{VERSION}-cpu"}}
    script = SCRIPT.read_text()
    assert 'tandem:$VERSION-cpu' in script and 'tandem:$VERSION}' in script
    readme = (REPO / "launch" / "README.md").read_text()
    for name in (f"tandem:{VERSION}", f"tandem:{VERSION}-cpu", "launch/image.sh gpu --push",
                 "make image"):
        assert name in readme, name


# --- what the images hold ----------------------------------------------------------------------

def test_two_targets_each_an_unprivileged_user_no_model_no_build_tools() -> None:
    st = stages()
    assert st["gpu"][0] == "FROM ${SGLANG_IMAGE} AS gpu"
    assert st["cpu"][0] == "FROM ${CPU_BASE} AS cpu"
    uid = ARGS["UID"]
    assert int(uid) >= 1000
    for target in ("gpu", "cpu"):
        users = [i for i in st[target] if i.startswith("USER ")]
        # numeric, so that Kubernetes' runAsNonRoot can check it
        assert users and users[-1] == "USER ${UID}:${UID}", (target, users)
    everything = "\n".join(i for s in st.values() for i in s)
    for tool in ("build-essential", "gcc", "g++", "make ", "cmake", "git "):
        assert not re.search(rf"apt-get install[^\n]*\b{re.escape(tool)}", everything), tool
    for i in (i for s in st.values() for i in s):
        if i.startswith(("COPY", "ADD")):
            assert "model" not in i and ".safetensors" not in i, i  # models are mounted
    # the cpu image takes only the venv and the perf tools from its build stage
    copies = [i for i in st["cpu"] if i.startswith("COPY")]
    assert copies == ["COPY --from=cpu-build /opt/venv /opt/venv",
                      "COPY --from=cpu-build /opt/tandem /opt/tandem"]
    build = " ".join(st["cpu-build"])
    assert "venv --without-pip" in build and "--no-index" in build


def test_the_build_context_is_the_wheelhouse_and_perf_only() -> None:
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln and not ln.startswith("#")]
    assert lines[0] == "*"
    assert {ln for ln in lines if ln.startswith("!")} == {"!build/image/wheels", "!perf"}
    assert "perf/results" in lines


def test_image_sh_explains_itself_and_refuses_a_bad_target() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    ok = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "usage:" in ok.stdout and "--push REPO" in ok.stdout
    bad = subprocess.run([str(SCRIPT), "arm"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage:" in bad.stderr


# --- running -----------------------------------------------------------------------------------

def source_sha256() -> str:
    """launch/image.sh's label: sha256sum over tandem's sources and pyproject.toml, hashed."""
    paths = sorted([*(str(p.relative_to(REPO)) for d in ("runtime", "components")
                      for p in (REPO / d).rglob("*.py")), "pyproject.toml"],
                   key=lambda p: p.encode())
    listing = "".join(f"{hashlib.sha256((REPO / p).read_bytes()).hexdigest()}  {p}\n"
                      for p in paths)
    return hashlib.sha256(listing.encode()).hexdigest()


def _podman() -> str:
    exe = shutil.which("podman")
    if exe is None:
        pytest.skip("podman is not installed (make image installs it from Debian's packages)")
    build = "build it with `make image` (launch/image.sh cpu, a few minutes; a minute again)"
    if subprocess.run([exe, "image", "exists", CPU_IMAGE], timeout=60).returncode != 0:
        pytest.skip(f"no image {CPU_IMAGE}: {build}")
    label = subprocess.run([exe, "image", "inspect", "--format",
                            '{{index .Labels "tandem.source-sha256"}}', CPU_IMAGE],
                           capture_output=True, text=True, timeout=60).stdout.strip()
    if label != source_sha256():
        pytest.skip(f"{CPU_IMAGE} holds another checkout's tandem: {build}")
    return exe


def _run_options(exe: str) -> list[str]:
    """What lets a container start here: rlimits no higher than ours (podman asks for more by
    default, which a sandbox may refuse; a few processes are all the cluster needs), and runc
    where crun cannot manage this cgroup setup."""
    limits = []
    for name, which, most in (("nofile", resource.RLIMIT_NOFILE, 1 << 20),
                              ("nproc", resource.RLIMIT_NPROC, 4096)):
        hard = resource.getrlimit(which)[1]
        n = most if hard == resource.RLIM_INFINITY else min(hard, most)
        limits.append(f"--ulimit={name}={n}:{n}")
    tried = []
    for runtime in ([], ["--runtime", "runc"]):
        if runtime and shutil.which("runc") is None:
            continue
        argv = [exe, *runtime, "run", "--rm", "--network", "host", *limits, CPU_IMAGE, "true"]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if res.returncode == 0:
            return [*runtime, "run", *limits]
        tried.append(f"{' '.join(argv)}: {res.stderr.strip()[-300:]}")
    pytest.skip("podman cannot start a container here:\n" + "\n".join(tried))


def _in(exe: str, name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, "exec", name, *argv], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(300)
def test_the_cpu_image_serves_a_1p1d_mock_cluster_that_the_host_streams_from(
        tiny_model: str) -> None:
    exe = _podman()
    run = _run_options(exe)
    name = f"tandem-test-{secrets.token_hex(4)}"
    base = free_base(4)
    http, url = base, f"http://127.0.0.1:{base}"
    # Host network, every process bound to 127.0.0.1: nothing is reachable beyond loopback.
    argv = [exe, *run, "--detach", "--name", name, "--network", "host",
            "--volume", f"{tiny_model}:/models/model:ro", CPU_IMAGE,
            "tandem", "up", "--model", "/models/model", "--engine", "mock",
            "--prefill", "1", "--decode", "1", "--host", "127.0.0.1", "--port", str(http),
            "--worker-base-port", str(base + 1), "--ready-timeout", "90"]
    started = time.monotonic()
    subprocess.run(argv, check=True, capture_output=True, timeout=120)
    try:
        deadline = started + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            state = subprocess.run([exe, "inspect", "--format", "{{.State.Running}}", name],
                                   capture_output=True, text=True, timeout=60).stdout.strip()
            logs = lambda: subprocess.run([exe, "logs", name], capture_output=True,  # noqa: E731
                                          text=True, timeout=60)
            assert state == "true", f"the container exited:\n{logs().stdout}{logs().stderr}"
            assert time.monotonic() < deadline, f"not ready in 120 s:\n{logs().stderr}"
            time.sleep(0.5)
        ready_s = time.monotonic() - started

        result = Stream(url, "/v1/completions", {
            "model": "model", "prompt": "Tell me about the sea.", "max_tokens": 16,
            "stream": True, "stream_options": {"include_usage": True}}).read_all()
        assert result.status == 200 and result.error is None, result
        assert result.done and result.finish_reason in ("length", "stop"), result
        assert len([e for e in result.events if e.get("choices")]) >= 2  # streamed, in pieces
        usage = [e["usage"] for e in result.events if e.get("usage")]
        assert usage and 0 < usage[-1]["completion_tokens"] <= 16

        # Inside: the unprivileged user, and no pip or compiler to be found.
        assert _in(exe, name, "id", "-u").stdout.strip() == ARGS["UID"]
        assert _in(exe, name, "python", "-c", "import pip").returncode != 0
        tools = _in(exe, name, "sh", "-c", "command -v pip pip3 gcc cc c++ make || true")
        assert tools.stdout.strip() == "", tools.stdout

        # The sweep Job's command (perf/ in /opt/tandem), briefly, against this cluster.
        sweep = subprocess.run([exe, "exec", "--workdir", "/opt/tandem", name, "python", "-m",
                                "perf.streaming.sweep", "--url", url, "--model", "/models/model",
                                "--concurrency", "1,4", "--requests-per-level", "8",
                                "--max-tokens", "8", "--out", "/tmp/sweep/sweep"],
                               capture_output=True, text=True, timeout=180)
        assert sweep.returncode == 0, sweep.stdout + sweep.stderr
        assert _in(exe, name, "test", "-s", "/tmp/sweep/sweep.png").returncode == 0

        # SIGTERM: tandem up stops its cluster and the container ends by itself.
        subprocess.run([exe, "stop", "--time", "30", name], capture_output=True, timeout=90)
        out = subprocess.run([exe, "logs", name], capture_output=True, text=True, timeout=60)
        assert "tandem up: stopping" in out.stdout + out.stderr
        print(f"container ready in {ready_s:.1f} s; whole run {time.monotonic() - started:.1f} s")
    finally:
        subprocess.run([exe, "rm", "--force", "--time", "0", name], capture_output=True,
                       timeout=120)
