"""launch/single_node.sh and launch/node.sh planning: exact --dry-run plans and clear errors.
(Running them is tests/deploy/test_launch_run.py.)"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.deploy.manifests import REPO, flag

SINGLE = REPO / "launch" / "single_node.sh"
NODE = REPO / "launch" / "node.sh"
GPUS8 = "0,1,2,3,4,5,6,7"


def run(script: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | (env or {})
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=30, env=full)


def plan(script: Path, *args: str) -> tuple[dict[str, str], list[dict]]:
    res = run(script, "--dry-run", "--tandem", "tandem", "--log-dir", "/tmp/tl", *args)
    assert res.returncode == 0, res.stderr
    head: dict[str, str] = {}
    procs = []
    for line in res.stdout.splitlines():
        kind, *fields = line.split("\t")
        kv = dict(f.split("=", 1) for f in fields)
        if kind == "plan":
            head = kv
        else:
            assert kind in ("worker", "frontend"), line
            kv["kind"] = kind
            kv["argv"] = shlex.split(kv["cmd"])  # type: ignore[assignment]
            procs.append(kv)
    return head, procs


def gpu_set(p: dict) -> set[int]:
    return set() if p["gpus"] == "-" else {int(g) for g in p["gpus"].split(",")}


def check_consistent(procs: list[dict]) -> None:
    """Plan fields agree with the commands; GPU sets disjoint; every port distinct."""
    used: list[int] = []
    gpus: list[set[int]] = []
    for p in procs:
        argv = p["argv"]
        if p["kind"] == "worker":
            devices = p["gpus"].replace("-", "")
            assert argv[0] == "env" and argv[1] == f"CUDA_VISIBLE_DEVICES={devices}"
            assert argv[2:4] == ["tandem", "worker"] and flag(argv, "--role") == p["role"]
            assert flag(argv, "--port") == p["port"]
            assert flag(argv, "--health-port") == p["health_port"]
            assert flag(argv, "--bootstrap-port") == (None if p["bootstrap_port"] == "-"
                                                     else p["bootstrap_port"])
            assert (p["bootstrap_port"] != "-") == (p["role"] == "prefill")
            used += [int(p["port"]), int(p["health_port"])]
            used += [int(p["bootstrap_port"])] if p["bootstrap_port"] != "-" else []
            gpus.append(gpu_set(p))
        else:
            assert argv[:2] == ["tandem", "frontend"] and flag(argv, "--port") == p["port"]
    frontend_ports = {p["port"] for p in procs if p["kind"] == "frontend"}
    assert len(frontend_ports) <= 1  # frontends share one port (SO_REUSEPORT)
    used += [int(x) for x in frontend_ports]
    assert len(used) == len(set(used)), f"ports reused: {sorted(used)}"
    flat = [g for s in gpus for g in s]
    assert len(flat) == len(set(flat)), f"a GPU given twice: {gpus}"


def test_2p_tp2_2d_tp2_on_8_gpus() -> None:
    head, procs = plan(SINGLE, "--model", "/m", "--engine", "sglang", "--prefill", "2",
                       "--decode", "2", "--tp", "2", "--gpus", GPUS8,
                       "--", "--mem-fraction-static", "0.8")
    check_consistent(procs)
    got = [(p["name"], p["gpus"], p["port"], p["bootstrap_port"], p["health_port"]) for p in procs]
    assert got == [
        ("prefill-0", "0,1", "7100", "7200", "7300"),
        ("prefill-1", "2,3", "7101", "7201", "7301"),
        ("decode-0", "4,5", "7102", "-", "7302"),
        ("decode-1", "6,7", "7103", "-", "7303"),
        ("frontend-0", "-", "8000", "-", "8000"),
    ]
    workers = [p for p in procs if p["kind"] == "worker"]
    for p in workers:
        assert flag(p["argv"], "--tp-size") == "2" and flag(p["argv"], "--engine") == "sglang"
        assert p["argv"][-2:] == ["--mem-fraction-static", "0.8"]
        assert flag(p["argv"], "--device") is None and flag(p["argv"], "--drain-timeout") == "10"
    (fe,) = [p for p in procs if p["kind"] == "frontend"]
    want = ",".join(f"tcp://127.0.0.1:{7100 + i}" for i in range(4))
    assert flag(fe["argv"], "--workers") == want == head["workers"]
    assert "--reuse-port" not in fe["argv"]  # one frontend
    assert head["gpus"] == GPUS8 and head["prefill_tp"] == head["decode_tp"] == "2"
    assert [p["log"] for p in procs] == [f"/tmp/tl/{p['name']}.log" for p in procs]


def test_1p_7d_on_8_gpus() -> None:
    _, procs = plan(SINGLE, "--model", "/m", "--prefill", "1", "--decode", "7", "--gpus", GPUS8,
                    "--frontends", "2", "--port", "9000")
    check_consistent(procs)
    workers = [p for p in procs if p["kind"] == "worker"]
    assert [(p["name"], p["gpus"], p["port"], p["health_port"]) for p in workers] == \
        [("prefill-0", "0", "7100", "7300")] + \
        [(f"decode-{i}", str(i + 1), str(7101 + i), str(7301 + i)) for i in range(7)]
    assert workers[0]["bootstrap_port"] == "7200"
    assert set().union(*(gpu_set(p) for p in workers)) == set(range(8))
    assert [p["name"] for p in procs if p["kind"] == "frontend"] == ["frontend-0", "frontend-1"]
    for p in workers:  # the reference engine runs on the GPU it was given
        assert flag(p["argv"], "--device") == "cuda" and flag(p["argv"], "--tp-size") is None
        assert "--auth-keys" not in p["argv"]  # loopback only: no keys needed
    for p in procs:  # two frontends share --port: SO_REUSEPORT
        assert ("--reuse-port" in p["argv"]) == (p["kind"] == "frontend")


def test_gpus_default_to_cuda_visible_devices_and_split_tp() -> None:
    res = run(SINGLE, "--dry-run", "--model", "/m", "--prefill", "1", "--decode", "1",
              "--prefill-tp", "1", "--decode-tp", "2", "--tandem", "tandem",
              env={"CUDA_VISIBLE_DEVICES": "4,5,6"})
    assert res.returncode == 0, res.stderr
    assert "gpus=4\t" in res.stdout and "gpus=5,6\t" in res.stdout


def test_cpu_mode_assigns_no_gpus() -> None:
    _, procs = plan(SINGLE, "--model", "/m", "--cpu", "--engine", "mock", "--decode", "3")
    check_consistent(procs)
    for p in procs:
        if p["kind"] == "worker":
            assert p["gpus"] == "-" and p["argv"][1] == "CUDA_VISIBLE_DEVICES="
            assert flag(p["argv"], "--device") is None


@pytest.mark.parametrize("args, message", [
    (["--prefill", "1", "--decode", "8", "--gpus", GPUS8],
     "not enough GPUs: 1 prefill x TP1 + 8 decode x TP1 need 9, have 8"),
    (["--prefill", "2", "--decode", "2", "--tp", "3", "--gpus", GPUS8], "need 12, have 8"),
    (["--gpus", "0,0"], "GPU 0 is listed twice"),
    (["--gpus", "0,x"], "'x' is not a GPU id"),
    (["--gpus", "0,1", "--health-port-base", "7101"],
     "overlapping ports: 7101 is both prefill-0 health and decode-0 ZMQ"),
    (["--gpus", "0,1", "--port", "7200"],
     "overlapping ports: 7200 is both prefill-0 bootstrap and frontend HTTP"),
    (["--gpus", "0,1", "--worker-port-base", "65535"], "decode-0 ZMQ: port 65536 is out of range"),
    (["--gpus", "0,1", "--engine", "vllm"], "--engine must be"),
    (["--gpus", "0,1", "--tp", "0"], "--tp must be >= 1"),
    (["--gpus", "0,1", "--bogus"], "unknown option '--bogus'"),
    (["--prefill", "0", "--decode", "0"], "need --workers"),
    (["--cpu", "--host", "0.0.0.0"], "workers bound to 0.0.0.0 (beyond loopback) need --auth-keys"),
    (["--prefill", "0", "--decode", "0", "--workers", "tcp://127.0.0.1:1,dns://tandem-decode:7100"],
     "frontends reaching workers beyond loopback (tandem-decode) need --auth-keys"),
])
def test_errors_are_clear(args: list[str], message: str) -> None:
    res = run(SINGLE, "--dry-run", "--model", "/m", *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert res.stdout == ""


def test_no_gpus_found_is_an_error() -> None:
    res = run(SINGLE, "--dry-run", "--model", "/m", env={"PATH": "/usr/bin:/bin"})
    if res.returncode == 0:
        pytest.skip("this machine has nvidia-smi and GPUs")
    assert res.returncode == 2 and "no GPUs found" in res.stderr


def test_help() -> None:
    for script in (SINGLE, NODE):
        res = run(script, "--help")
        assert res.returncode == 0 and res.stdout.startswith("usage:")


def test_node_worker_roles_bind_all_and_advertise() -> None:
    head, procs = plan(NODE, "--role", "decode", "--model", "/m", "--advertise-host", "10.0.0.3",
                       "--count", "2", "--tp", "2", "--gpus", "0,1,2,3", "--auth-keys", "/k",
                       "--", "--x", "1")
    check_consistent(procs)
    assert [p["kind"] for p in procs] == ["worker", "worker"]
    for i, p in enumerate(procs):
        assert p["role"] == "decode" and p["gpus"] == f"{2 * i},{2 * i + 1}"
        assert flag(p["argv"], "--host") == "0.0.0.0"
        assert flag(p["argv"], "--advertise-host") == "10.0.0.3"
        assert flag(p["argv"], "--engine") == "sglang" and flag(p["argv"], "--tp-size") == "2"
        assert flag(p["argv"], "--auth-keys") == "/k" and p["argv"][-2:] == ["--x", "1"]
    assert head["workers"] == "tcp://10.0.0.3:7100,tcp://10.0.0.3:7101"
    _, procs = plan(NODE, "--role", "prefill", "--model", "/m", "--host", "10.0.0.1", "--cpu",
                    "--auth-keys", "/k")
    assert procs[0]["bootstrap_port"] == "7200"
    assert flag(procs[0]["argv"], "--advertise-host") == "10.0.0.1"


def test_node_frontend_role() -> None:
    workers = "dns://tandem-decode:7100,tcp://10.0.0.1:7100"
    _, procs = plan(NODE, "--role", "frontend", "--model", "/m", "--workers", workers,
                    "--frontends", "3", "--frontend-args", "--router-policy prefix",
                    "--auth-keys", "/k")
    assert [p["name"] for p in procs] == ["frontend-0", "frontend-1", "frontend-2"]
    for p in procs:
        assert flag(p["argv"], "--workers") == workers and flag(p["argv"], "--host") == "0.0.0.0"
        assert flag(p["argv"], "--router-policy") == "prefix"
        assert flag(p["argv"], "--auth-keys") == "/k" and "--reuse-port" in p["argv"]


@pytest.mark.parametrize("args, message", [
    (["--role", "prefill"], "--advertise-host ADDR is required"),
    (["--role", "decode", "--advertise-host", "10.0.0.2", "--cpu"], "need --auth-keys DIR"),
    (["--role", "frontend", "--workers", "tcp://10.0.0.2:7100"], "need --auth-keys DIR"),
    (["--role", "frontend"], "needs --workers"),
    (["--role", "cache"], "--role must be"),
    ([], "--role is required"),
    (["--role", "frontend", "--workers", "h:1", "--", "--x"],
     "engine flags after -- are for worker"),
])
def test_node_errors(args: list[str], message: str) -> None:
    res = run(NODE, "--dry-run", "--model", "/m", *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
