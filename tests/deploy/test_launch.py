"""Planning a cluster with `tandem up --dry-run`, through launch/single_node.sh and launch/node.sh
(thin wrappers that exec it): the GPUs each worker gets, its ports, its command, the cluster's
keys, and clear errors. Nothing starts. (Running: tests/deploy/test_launch_run.py.)"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import parse
from tandem.config import FrontendConfig, WorkerConfig
from tandem.runtime.auth import write_keys
from tests.deploy.manifests import REPO, flag

SINGLE = REPO / "launch" / "single_node.sh"
NODE = REPO / "launch" / "node.sh"
TANDEM = f"{sys.executable} -m tandem.cli"
GPUS8 = "0,1,2,3,4,5,6,7"
NEW_KEYS = "<new key pair>"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory that passes for a model (`--model` checks for config.json); nothing loads it."""
    path = tmp_path_factory.mktemp("m")
    (path / "config.json").write_text("{}")
    return str(path)


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | (env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=full)


def script(path: Path, *args: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run(["bash", str(path), "--tandem", TANDEM, *args], env)


def up(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "tandem.cli", "up", *args], env)


def plan_of(res: subprocess.CompletedProcess) -> tuple[dict[str, str], list[dict]]:
    """The `plan` line's fields, and one dict per process (with `env` and `argv` from its cmd)."""
    assert res.returncode == 0, res.stderr
    head: dict[str, str] = {}
    procs = []
    for line in res.stdout.splitlines():
        kind, *fields = line.split("\t")
        kv: dict = dict(f.split("=", 1) for f in fields)
        if kind == "plan":
            head = kv
            continue
        assert kind in ("worker", "frontend"), line
        words = shlex.split(kv["cmd"])
        env = [w for w in words[:2] if "=" in w]
        kv["env"] = dict(w.split("=", 1) for w in env)
        assert words[len(env):len(env) + 3] == [sys.executable, "-m", "tandem.cli"], words
        kv["argv"] = words[len(env) + 3:]
        kv["kind"] = kind
        procs.append(kv)
    return head, procs


def dry(path: Path | None, *args: str, env: dict[str, str] | None = None
        ) -> tuple[dict[str, str], list[dict]]:
    res = script(path, "--dry-run", *args, env=env) if path else up("--dry-run", *args, env=env)
    assert res.stderr == "", res.stderr
    return plan_of(res)


def gpus(p: dict) -> set[str]:
    return set(p["gpus"].split(",")) if p["gpus"] not in ("-", "none") else set()


def check_consistent(procs: list[dict]) -> None:
    """Fields agree with the commands; GPU sets disjoint and each worker's visible devices; every
    port distinct (frontends share theirs)."""
    used: list[str] = []
    seen: list[str] = []
    for p in procs:
        argv = p["argv"]
        assert flag(argv, "--port") == p["port"]
        if p["kind"] == "frontend":
            assert argv[0] == "frontend" and p["env"] == {} and p["gpus"] == "-"
            continue
        assert argv[0] == "worker" and flag(argv, "--role") == p["role"]
        assert flag(argv, "--health-port") == p["health_port"]
        assert flag(argv, "--bootstrap-port") == (None if p["bootstrap_port"] == "-"
                                                 else p["bootstrap_port"])
        assert (p["bootstrap_port"] != "-") == (p["role"] == "prefill")
        if p["gpus"] != "-":
            assert p["env"]["CUDA_VISIBLE_DEVICES"] == p["gpus"].replace("none", "")
        used += [p["port"], p["health_port"], *[p["bootstrap_port"]] * (p["role"] == "prefill")]
        seen += sorted(gpus(p))
    used += sorted({p["port"] for p in procs if p["kind"] == "frontend"})
    assert len(used) == len(set(used)), f"ports reused: {used}"
    assert len(seen) == len(set(seen)), f"a GPU given twice: {seen}"


def test_2p_tp2_2d_tp2_on_8_gpus(model: str, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    head, procs = dry(SINGLE, "--model", model, "--engine", "sglang", "--prefill", "2",
                      "--decode", "2", "--tp", "2", "--gpus", GPUS8, "--log-dir", str(logs),
                      "--", "--mem-fraction-static", "0.8")
    check_consistent(procs)
    assert [(p["name"], p["gpus"], p["port"], p["bootstrap_port"], p["health_port"])
            for p in procs] == [
        ("prefill-0", "0,1", "7100", "7200", "7300"),
        ("prefill-1", "2,3", "7101", "7201", "7301"),
        ("decode-0", "4,5", "7102", "-", "7302"),
        ("decode-1", "6,7", "7103", "-", "7303"),
        ("frontend", "-", "8000", "-", "8000"),
    ]
    for p in procs[:4]:  # SGLang's TP is the worker's GPUs; the engine flags come last
        assert p["argv"][-4:] == ["--tp-size", "2", "--mem-fraction-static", "0.8"]
        assert flag(p["argv"], "--engine") == "sglang" and flag(p["argv"], "--device") is None
    fe = procs[4]
    want = ",".join(f"tcp://127.0.0.1:{7100 + i}" for i in range(4))
    assert flag(fe["argv"], "--workers") == want == head["addresses"]
    assert "--reuse-port" not in fe["argv"] and "--mem-fraction-static" not in fe["argv"]
    assert head["gpus"] == GPUS8 and head["engine"] == "sglang"
    assert [p["log"] for p in procs] == [f"{logs}/{p['name']}.log" for p in procs]
    assert not logs.exists()  # nothing started, nothing written


def test_1p_7d_on_8_gpus_the_reference_engine_on_its_gpu(model: str) -> None:
    _, procs = dry(SINGLE, "--model", model, "--prefill", "1", "--decode", "7", "--gpus", GPUS8,
                   "--frontends", "2", "--port", "9000")
    check_consistent(procs)
    workers = [p for p in procs if p["kind"] == "worker"]
    assert [(p["name"], p["gpus"], p["port"], p["health_port"]) for p in workers] == \
        [("prefill", "0", "7100", "7300")] + \
        [(f"decode-{i}", str(i + 1), str(7101 + i), str(7301 + i)) for i in range(7)]
    for p in workers:  # --gpus given: the reference engine runs on the GPU it was given
        assert flag(p["argv"], "--device") == "cuda" and flag(p["argv"], "--tp-size") is None
    assert [p["name"] for p in procs if p["kind"] == "frontend"] == ["frontend-0", "frontend-1"]
    for p in procs:  # two frontends share --port: SO_REUSEPORT
        assert ("--reuse-port" in p["argv"]) == (p["kind"] == "frontend")


def test_gpus_default_to_cuda_visible_devices_and_split_tp(model: str) -> None:
    _, procs = dry(None, "--model", model, "--engine", "sglang", "--prefill", "1", "--decode",
                   "1", "--prefill-tp", "1", "--decode-tp", "2",
                   env={"CUDA_VISIBLE_DEVICES": "4,5,6"})
    check_consistent(procs)
    assert [(p["gpus"], flag(p["argv"], "--tp-size")) for p in procs[:2]] == \
        [("4", "1"), ("5,6", "2")]


def test_gpus_default_to_what_nvidia_smi_lists(model: str, tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n2\\n3\\n'\n")
    smi.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}"}
    _, procs = dry(None, "--model", model, "--engine", "sglang", "--workers", "2", "--tp", "2",
                   env=env)
    assert [p["gpus"] for p in procs] == ["0,1", "2,3", "-"]


def test_cpu_hands_out_no_gpus_and_mock_alone_leaves_the_environment_as_it_is(model: str) -> None:
    _, procs = dry(SINGLE, "--model", model, "--cpu", "--engine", "mock", "--decode", "3")
    check_consistent(procs)
    for p in procs[:4]:
        assert p["gpus"] == "none" and p["env"] == {"CUDA_VISIBLE_DEVICES": ""}
        assert flag(p["argv"], "--device") is None
    _, procs = dry(None, "--model", model, "--engine", "mock", "--prefill", "1", "--decode", "1")
    assert [(p["gpus"], p["env"]) for p in procs] == [("-", {})] * 3


def test_sglang_on_cpu_needs_no_gpus(model: str) -> None:
    """`--cpu` (or `--device cpu`) plans SGLang's CPU engine: no GPUs, each worker --device cpu."""
    _, procs = dry(SINGLE, "--model", model, "--cpu", "--engine", "sglang", "--prefill", "1",
                   "--decode", "1", "--no-auth", "--", "--dtype", "float32")
    check_consistent(procs)
    for p in procs[:2]:
        assert p["gpus"] == "none" and p["env"] == {"CUDA_VISIBLE_DEVICES": ""}
        assert flag(p["argv"], "--device") == "cpu" and p["argv"][-2:] == ["--dtype", "float32"]
        assert parse(p["argv"]).config.device == "cpu"  # type: ignore[union-attr]
    _, procs = dry(None, "--model", model, "--engine", "sglang", "--device", "cpu",
                   env={"PATH": "/usr/bin:/bin"})  # no nvidia-smi needed
    assert procs[0]["gpus"] == "-" and flag(procs[0]["argv"], "--device") == "cpu"


def test_every_process_gets_the_clusters_keys(model: str, tmp_path: Path) -> None:
    head, procs = dry(None, "--model", model, "--prefill", "1", "--decode", "1", "--frontends", "2")
    assert head["auth"] == "new key pair"  # made at start, in a private directory
    assert all(flag(p["argv"], "--auth-keys") == NEW_KEYS for p in procs)
    head, procs = dry(None, "--model", model, "--no-auth")
    assert head["auth"] == "off" and all("--auth-keys" not in p["argv"] for p in procs)
    write_keys(tmp_path / "k")
    head, procs = dry(None, "--model", model, "--auth-keys", str(tmp_path / "k"))
    assert head["auth"] == str(tmp_path / "k")
    assert all(flag(p["argv"], "--auth-keys") == str(tmp_path / "k") for p in procs)


def test_the_planned_commands_are_what_each_process_parses(model: str) -> None:
    _, procs = dry(None, "--model", model, "--prefill", "1", "--decode", "1", "--no-auth",
                   "--advertise-host", "127.0.0.2", "--worker-base-port", "7100",
                   "--bootstrap-base-port", "7200", "--health-base-port", "7300",
                   "--page-size", "8", "--router-policy", "prefix", "--drain-timeout", "3")
    configs = [parse(p["argv"]).config for p in procs]
    pre, dec, fe = configs
    assert isinstance(pre, WorkerConfig) and isinstance(dec, WorkerConfig)
    assert (pre.role, pre.port, pre.bootstrap_port, pre.health_port) == ("prefill", 7100, 7200,
                                                                         7300)
    assert (dec.role, dec.port, dec.bootstrap_port, dec.health_port) == ("decode", 7101, 0, 7301)
    for w in (pre, dec):
        assert (w.advertise_host, w.page_size, w.drain_timeout_s) == ("127.0.0.2", 8, 3.0)
    assert isinstance(fe, FrontendConfig) and fe.router.policy == "prefix"
    assert fe.workers == ("tcp://127.0.0.2:7100", "tcp://127.0.0.2:7101")


def test_wildcard_hosts_advertise_loopback(model: str) -> None:
    _, procs = dry(None, "--model", model, "--host", "0.0.0.0", "--prefill", "1", "--decode", "1",
                   "--worker-base-port", "7100")
    assert [flag(p["argv"], "--advertise-host") for p in procs[:2]] == ["127.0.0.1"] * 2
    assert flag(procs[2]["argv"], "--workers") == "tcp://127.0.0.1:7100,tcp://127.0.0.1:7102"
    assert procs[2]["address"] == "http://127.0.0.1:8000"


@pytest.mark.parametrize("args, message", [
    (["--prefill", "1", "--decode", "8", "--gpus", GPUS8],
     "not enough GPUs: 1 prefill x TP1 + 8 decode x TP1 need 9, have 8"),
    (["--prefill", "2", "--decode", "2", "--tp", "3", "--gpus", GPUS8], "need 12, have 8"),
    (["--gpus", "0,0"], "GPU 0 is listed twice"),
    (["--gpus", "0,x"], "'x' is not a GPU id"),
    (["--gpus", "0,1", "--health-port-base", "7101"],
     "overlapping ports: 7101 is both prefill health and decode ZMQ"),
    (["--gpus", "0,1", "--port", "7200"],
     "overlapping ports: 7200 is both prefill bootstrap and frontend HTTP"),
    (["--gpus", "0,1", "--worker-port-base", "65535"], "decode ZMQ: port 65536 is out of range"),
    (["--gpus", "0,1", "--engine", "vllm"], "argument --engine: invalid choice: 'vllm'"),
    (["--gpus", "0,1", "--tp", "0"], "argument --tp: must be a positive integer"),
    (["--gpus", "0,1", "--bogus"], "unrecognized arguments: --bogus"),
    (["--prefill", "1", "--decode", "0"], "needs both --prefill N and --decode M"),
    (["--prefill", "0", "--decode", "0"], "the frontends need --worker-addresses"),
    (["--cpu", "--host", "0.0.0.0", "--no-auth"], "--no-auth: 0.0.0.0 is beyond loopback"),
    (["--cpu", "--engine", "sglang", "--device", "cuda"],
     "--cpu hands out no GPUs, but --device cuda needs them"),
    (["--gpus", "0,1", "--engine", "sglang", "--", "--tp-size", "2"], "remove --tp-size"),
    (["--gpus", "0,1", "--device", "cuda:1"], "--device cuda:1: each worker sees only its own"),
    (["--prefill", "0", "--decode", "0", "--workers", "dns://tandem-decode:7100"],
     "need this cluster's key pair: pass --auth-keys DIR"),
])
def test_errors_are_clear(model: str, args: list[str], message: str) -> None:
    res = script(SINGLE, "--dry-run", "--model", model, *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert res.stdout == ""


def test_no_gpus_found_is_an_error(model: str) -> None:
    path = "/usr/bin:/bin"
    if any(os.access(os.path.join(d, "nvidia-smi"), os.X_OK) for d in path.split(":")):
        pytest.skip("this machine has nvidia-smi")
    res = up("--dry-run", "--model", model, "--engine", "sglang", env={"PATH": path})
    assert res.returncode == 2 and "no GPUs found (--engine sglang needs them" in res.stderr


def test_help() -> None:
    res = script(SINGLE, "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: single_node.sh")
    assert "--worker-port-base" in res.stdout and "usage: tandem up" in res.stdout
    for text in ("--gpus LIST", "--tp N", "--prefill-tp", "--decode-tp", "--cpu", "--log-dir",
                 "--dry-run", "--advertise-host", "--health-base-port", "--no-auth"):
        assert text in res.stdout, text
    res = script(NODE, "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage:")


@pytest.fixture
def keys(tmp_path: Path) -> str:
    write_keys(tmp_path / "k")
    return str(tmp_path / "k")


def test_node_worker_roles_bind_all_and_advertise(model: str, keys: str) -> None:
    head, procs = dry(NODE, "--role", "decode", "--model", model, "--advertise-host", "10.0.0.3",
                      "--count", "2", "--tp", "2", "--gpus", "0,1,2,3", "--auth-keys", keys,
                      "--", "--x", "1")
    check_consistent(procs)
    assert [p["kind"] for p in procs] == ["worker", "worker"]
    for i, p in enumerate(procs):
        assert p["role"] == "decode" and p["gpus"] == f"{2 * i},{2 * i + 1}"
        assert flag(p["argv"], "--host") == "0.0.0.0"
        assert flag(p["argv"], "--advertise-host") == "10.0.0.3"
        assert flag(p["argv"], "--engine") == "sglang" and flag(p["argv"], "--tp-size") == "2"
        assert flag(p["argv"], "--auth-keys") == keys and p["argv"][-2:] == ["--x", "1"]
    assert head["addresses"] == "tcp://10.0.0.3:7100,tcp://10.0.0.3:7101"
    _, procs = dry(NODE, "--role", "prefill", "--model", model, "--host", "10.0.0.1", "--cpu",
                   "--engine", "mock", "--auth-keys", keys)
    assert procs[0]["bootstrap_port"] == "7200" and procs[0]["address"] == "tcp://10.0.0.1:7100"


def test_node_frontend_role(model: str, keys: str) -> None:
    workers = "dns://tandem-decode:7100,tcp://10.0.0.1:7100"
    _, procs = dry(NODE, "--role", "frontend", "--model", model, "--workers", workers,
                   "--frontends", "3", "--frontend-args", "--router-policy prefix",
                   "--auth-keys", keys)
    assert [p["name"] for p in procs] == ["frontend-0", "frontend-1", "frontend-2"]
    for p in procs:
        assert flag(p["argv"], "--workers") == workers and flag(p["argv"], "--host") == "0.0.0.0"
        assert flag(p["argv"], "--router-policy") == "prefix"
        assert flag(p["argv"], "--auth-keys") == keys and "--reuse-port" in p["argv"]


@pytest.mark.parametrize("args, message", [
    (["--role", "prefill"], "--advertise-host ADDR is required"),
    (["--role", "decode", "--advertise-host", "10.0.0.2", "--cpu", "--engine", "mock"],
     "pass --auth-keys DIR"),
    (["--role", "frontend", "--workers", "tcp://10.0.0.2:7100"], "pass --auth-keys DIR"),
    (["--role", "frontend"], "needs --workers"),
    (["--role", "cache"], "--role must be"),
    ([], "--role is required"),
    (["--role", "frontend", "--workers", "h:1", "--", "--x"],
     "engine flags after -- are for worker"),
])
def test_node_errors(model: str, args: list[str], message: str) -> None:
    res = script(NODE, "--dry-run", "--model", model, *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr

