"""The `tandem` command line: flags generated from the config dataclasses, their validation, engine
passthrough, what `tandem up` forwards to its children, and the local-cluster launcher's plan."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tandem.runtime.auth import write_keys
from tandem import demo, flags, launcher, up
from tandem.cli import main, parse
from tandem.config import FrontendConfig, RouterConfig, WorkerConfig, served_name
from tandem.up_config import UpConfig


@pytest.fixture
def model(tmp_path: Path) -> str:
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 500}))
    return str(d)


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


ALL_CONFIGS = (WorkerConfig, FrontendConfig, UpConfig)


@pytest.mark.parametrize("cls", ALL_CONFIGS)
def test_every_flag_has_help_that_shows_its_default(cls: type) -> None:
    for flag in flags.flags_of(cls):
        text = flags.help_text(flag)
        assert len(str(flag.meta["help"])) > 8, flag.flag
        assert "(required)" in text or "(default:" in text, (flag.flag, text)


@pytest.mark.parametrize("command", ["worker", "frontend", "up", "model", "keys"])
def test_help_of_each_command_lists_its_flags(command: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tandem {command}")
    cls = {"worker": WorkerConfig, "frontend": FrontendConfig, "up": UpConfig}.get(command)
    for flag in flags.flags_of(cls) if cls else []:
        assert flag.flag in out


def test_up_help_offers_every_forwarded_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    out = capsys.readouterr().out
    for flag in [*up.worker_flags(), *up.frontend_flags()]:
        assert flag.flag in out
    assert "forwarded to every worker" in out and "forwarded to every frontend" in out
    for per_process in ("--bootstrap-port", "--role", "--reuse-port", "--health-port"):
        assert per_process not in out


def test_defaults_come_from_the_dataclasses(model: str) -> None:
    assert parse(["worker", "--model", model]).config == WorkerConfig(model=model)
    front = parse(["frontend", "--model", model, "--workers", "tcp://127.0.0.1:7100"]).config
    assert front == FrontendConfig(model=model, workers=("tcp://127.0.0.1:7100",),
                                   served_model_name="tiny")
    assert front.router == RouterConfig()
    assert parse(["up", "--model", model]).config == UpConfig(model=model)


def test_given_flags_land_in_the_config(model: str) -> None:
    cfg = parse(["worker", "--model", model, "--role", "prefill", "--bootstrap-port", "7200",
                 "--engine", "mock", "--page-size", "8", "--max-batch", "3", "--kv-room-timeout",
                 "2.5", "--step-delay-ms", "4", "--advertise-host", "10.0.0.7",
                 "--health-port", "9100", "--drain-timeout", "3"]).config
    assert isinstance(cfg, WorkerConfig)
    assert (cfg.role, cfg.bootstrap_port, cfg.engine, cfg.page_size, cfg.max_batch,
            cfg.kv_room_timeout_s, cfg.step_delay_ms, cfg.health_port, cfg.drain_timeout_s) == \
        ("prefill", 7200, "mock", 8, 3, 2.5, 4.0, 9100, 3.0)
    assert cfg.reach_host == "10.0.0.7"
    assert WorkerConfig(host="0.0.0.0").reach_host == "0.0.0.0"
    front = parse(["frontend", "--model", model, "--workers",
                   "tcp://10.0.0.1:7100, dns://tandem-decode.ns.svc:7100", "--router-policy",
                   "prefix", "--queue-timeout", "5", "--served-model-name", "m"]).config
    assert isinstance(front, FrontendConfig)
    assert front.workers == ("tcp://10.0.0.1:7100", "dns://tandem-decode.ns.svc:7100")
    assert (front.router.policy, front.router.queue_timeout_s, front.served_model_name) == \
        ("prefix", 5.0, "m")


@pytest.mark.parametrize("argv, says", [
    (["worker", "--page-size", "0"], "argument --page-size: must be a positive integer, got 0"),
    (["worker", "--max-batch", "lots"], "argument --max-batch: 'lots' is not an integer"),
    (["worker", "--port", "70000"], "argument --port: port 70000 is out of range"),
    (["worker", "--role", "both"], "argument --role: invalid choice: 'both'"),
    (["worker", "--engine", "vllm"], "argument --engine: invalid choice: 'vllm'"),
    (["worker", "--kv-transfer-timeout", "-1"], "argument --kv-transfer-timeout: must be more"),
    (["worker", "--step-delay-ms", "nan"], "argument --step-delay-ms: 'nan' is not a finite"),
    (["worker", "--role", "prefill"], "--role prefill needs --bootstrap-port"),
    (["frontend", "--workers", " , "], "argument --workers: needs at least one address"),
    (["frontend", "--workers", "tcp://h:1", "--max-queue", "-3"], "must be 0 or more, got -3"),
    (["frontend"], "the following arguments are required: --workers"),
    (["up", "--frontends", "-1"], "argument --frontends: must be 0 or more"),
    (["up", "--cpu", "--gpus", "0"], "--cpu and --gpus: choose one"),
    (["up", "--gpus", "0,x"], "argument --gpus: 'x' is not a GPU id"),
    (["up", "--gpus", "0,1,0"], "argument --gpus: GPU 0 is listed twice"),
    (["up", "--frontends", "0"], "need this cluster's key pair: pass --auth-keys DIR"),
    (["up", "--worker-addresses", "tcp://10.0.0.1:7100"], "need this cluster's key pair"),
])
def test_bad_values_are_refused_with_a_message_naming_the_flag(
        argv: list[str], says: str, model: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of([argv[0], "--model", model, *argv[1:]], capsys)
    assert f"tandem {argv[0]}: error: " in err
    assert says in err


def test_a_missing_model_directory_says_how_to_make_one(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of(["worker", "--model", str(tmp_path / "nope")], capsys)
    assert "is not a model directory (no config.json)" in err and "tandem model init" in err


def test_unknown_flags_land_in_engine_args_for_sglang(model: str) -> None:
    cfg = parse(["worker", "--engine", "sglang", "--model", model, "--tp-size", "2",
                 "--page-size", "32", "--mem-fraction-static", "0.8", "--max", "7",
                 "--enable-mixed-chunk"]).config
    assert isinstance(cfg, WorkerConfig)
    assert cfg.page_size == 32  # tandem's own flag stays tandem's
    # Untouched and in order; `--max` is not taken as an abbreviation of tandem's --max-batch.
    assert cfg.engine_args == ("--tp-size", "2", "--mem-fraction-static", "0.8", "--max", "7",
                               "--enable-mixed-chunk")
    assert cfg.max_batch == WorkerConfig.max_batch


@pytest.mark.parametrize("command", ["worker", "up"])
def test_unknown_flags_are_an_error_for_other_engines(command: str, model: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of([command, "--model", model, "--engine", "mock", "--tp-size", "2"], capsys)
    assert f"tandem {command}: error: unrecognized arguments: --tp-size 2" in err
    assert "--engine sglang" in err


def test_frontend_refuses_unknown_flags(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of(["frontend", "--model", model, "--workers", "tcp://h:1", "--tp-size", "2"],
                   capsys)
    assert "unrecognized arguments: --tp-size 2" in err


def _non_default(flag: flags.Flag, tmp_path: Path) -> Any:
    d = flag.default
    if flag.dest == "tenant_by":
        return ("user", "header:x-team")
    if flag.dest == "host_kv_pages":  # (it needs the prefix cache, which this run turns off;
        return d  # test_up_forwards_only_what_was_given forwards it)
    if flag.dest in ("admin_token_file", "api_key_file"):  # (a file that must exist)
        (tmp_path / flag.dest).write_text("token\n")
        return str(tmp_path / flag.dest)
    choices = flag.meta.get("choices")
    if callable(choices):
        choices = choices()
    if choices:
        return next(c for c in choices if c != d)
    if isinstance(d, bool):
        return not d
    if isinstance(d, int):
        return d + 3
    if isinstance(d, float):
        return d + 1.5
    return SAMPLES.get(flag.dest, "x-" + flag.dest)


SAMPLES = {"cache_salt_by": "header:x-tenant"}  # (text fields with a format of their own)


def _config_value(cfg: Any, flag: flags.Flag) -> Any:
    for name in flag.path:
        cfg = getattr(cfg, name)
    return cfg


def test_up_forwards_every_worker_and_frontend_flag_exactly(model: str, tmp_path: Path) -> None:
    given = {f.flag: (f, _non_default(f, tmp_path))
             for f in [*up.worker_flags(), *up.frontend_flags()]}
    argv = ["up", "--model", model, "--prefill", "1", "--decode", "2", "--drain-timeout", "4.5",
            "--log-level", "DEBUG"]
    for flag, value in given.values():
        argv += flags.render(flag, value)
    cmd = parse(argv)
    assert isinstance(cmd.config, UpConfig) and cmd.forwarded is not None
    plan = up.make_plan(cmd.config, cmd.forwarded)
    assert [w.name for w in plan.workers] == ["prefill", "decode-0", "decode-1"]
    worker_flags = {f.flag for f in up.worker_flags()}
    for child in plan.children:
        cfg = parse(list(child.argv)).config
        assert cfg is not None
        assert (cfg.model, cfg.log_level, cfg.drain_timeout_s) == (model, "DEBUG", 4.5)
        for flag, value in given.values():
            if (flag.flag in worker_flags) == (child.kind == "worker"):
                assert _config_value(cfg, flag) == value, (child.name, flag.flag)
            else:
                assert flag.flag not in child.argv, (child.name, flag.flag)


def test_up_forwards_only_what_was_given(model: str, tmp_path: Path) -> None:
    cmd = parse(["up", "--model", model, "--page-size", "8", "--router-policy", "round-robin"])
    assert cmd.forwarded is not None
    assert cmd.forwarded.worker == ("--page-size", "8")
    assert cmd.forwarded.frontend == ("--router-policy", "round-robin")
    tiered = parse(["up", "--model", model, "--host-kv-pages", "64"]).forwarded
    assert tiered is not None and tiered.worker == ("--host-kv-pages", "64")
    write_keys(tmp_path / "k")
    keys = str(tmp_path / "k")
    keyed = parse(["up", "--model", model, "--auth-keys", keys, "--log-level", "DEBUG"]).forwarded
    assert keyed is not None
    assert keyed.worker == keyed.frontend == ("--log-level", "DEBUG", "--auth-keys", keys)


def test_a_missing_cluster_key_is_a_usage_error(model: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    said = error_of(["worker", "--model", model, "--auth-keys", str(tmp_path / "none")], capsys)
    assert "argument --auth-keys: no cluster key at" in said and "tandem keys init" in said


def test_up_passes_engine_flags_to_every_worker_after_its_own(model: str) -> None:
    cmd = parse(["up", "--model", model, "--engine", "sglang", "--workers", "2", "--gpus", "0,1",
                 "--mem-fraction-static", "0.8", "--", "--enable-metrics"])
    assert isinstance(cmd.config, UpConfig) and cmd.forwarded is not None
    plan = up.make_plan(cmd.config, cmd.forwarded)
    for w in plan.workers:  # (SGLang's TP from tandem up's, then the engine flags as given)
        assert w.argv[-5:] == ("--tp-size", "1", "--mem-fraction-static", "0.8", "--enable-metrics")
        cfg = parse(list(w.argv)).config
        assert isinstance(cfg, WorkerConfig) and cfg.engine_args == w.argv[-5:]
    for f in plan.frontends:
        assert "--tp-size" not in f.argv


def test_plan_ports_names_and_frontends_sharing_one_port(model: str) -> None:
    p = launcher.plan(launcher.Shape.parse("2p1d"), model, http_port=18000,
                      worker_base_port=17000, frontends=3, cluster_id="c1")
    assert [(w.name, w.ports) for w in p.workers] == [
        ("prefill-0", (17000, 17001)), ("prefill-1", (17002, 17003)), ("decode", (17004,))]
    assert p.workers[0].worker_name == "prefill-0@c1"
    assert "--bootstrap-port" in p.workers[0].argv and "--bootstrap-port" not in p.workers[2].argv
    addrs = "tcp://127.0.0.1:17000,tcp://127.0.0.1:17002,tcp://127.0.0.1:17004"
    assert [f.name for f in p.frontends] == ["frontend-0", "frontend-1", "frontend-2"]
    for f in p.frontends:
        assert f.ports == (18000,) and "--reuse-port" in f.argv
        assert f.argv[f.argv.index("--workers") + 1] == addrs
    assert p.url == "http://127.0.0.1:18000"
    single = launcher.plan(launcher.Shape.parse("agg"), model)
    assert "--reuse-port" not in single.frontends[0].argv
    with pytest.raises(ValueError):
        launcher.Shape.parse("p1d")


def test_a_port_in_use_is_found_before_anything_starts(model: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        cluster = launcher.LocalCluster(launcher.plan(launcher.Shape(agg=1), model,
                                                      http_port=busy))
        with pytest.raises(launcher.LaunchError, match=f"port {busy} on 127.0.0.1 is already in "
                                                       "use"):
            cluster.start()
        assert cluster.procs == {}


def test_a_child_that_dies_is_reported_and_can_be_restarted(model: str, tmp_path: Path) -> None:
    # A worker with a flag it refuses exits at once, as a crashed child would.
    bad = launcher.Child("w", "worker", ("worker", "--model", model, "--page-size", "0"), (), "")
    cluster = launcher.LocalCluster(launcher.Plan("127.0.0.1", (bad,), ()), log_dir=str(tmp_path))
    cluster.start()
    deadline = time.monotonic() + 30
    while not cluster.exited() and time.monotonic() < deadline:
        time.sleep(0.05)
    (dead,) = cluster.exited()
    said = launcher.describe_exit(dead)
    assert said.startswith(f"w (pid {dead.pid}) exited with code 2")
    assert "--page-size: must be a positive integer" in said
    again = cluster.restart("w")
    assert again.pid != dead.pid and cluster.procs["w"] is again
    again.popen.wait(30)
    cluster.stop()


def test_keys_init_writes_a_key_pair_once(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "keys"
    assert main(["keys", "init", str(target)]) == 0
    assert sorted(p.name for p in target.iterdir()) == ["cluster.key", "cluster.key_secret"]
    assert main(["keys", "init", str(target)]) == 1  # never overwritten without --force
    assert "tandem keys:" in capsys.readouterr().err


def test_served_name_is_the_directory_name_as_given(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "tiny"
    real.mkdir()
    link = tmp_path / "my-model"
    link.symlink_to(real)
    assert served_name(str(link)) == "my-model"
    assert served_name(str(real) + "/") == "tiny"
    monkeypatch.chdir(real)
    assert served_name(".") == "tiny"


def test_demo_output_cannot_drive_the_terminal() -> None:
    assert demo.printable("ok\x1b[2Jbell\x07\u202e\n\tend") == "ok\ufffd[2Jbell\ufffd\ufffd\n\tend"
    curl = demo.sample_curl("http://127.0.0.1:8000", "tiny")
    assert '"max_tokens": 32' in curl and '"model": "tiny"' in curl


def test_the_cli_imports_no_engine_or_http_stack() -> None:
    code = ("import sys, tandem.cli as c; c.build_parser(); "
            "print(sorted(m for m in ('torch', 'uvicorn', 'granian', 'tandem.worker', "
            "'tandem.frontend', 'tandem.engines.mock') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ}).stdout.strip()
    assert out == "[]"


def test_config_fields_are_frozen_and_every_field_is_documented() -> None:
    for cls in (*ALL_CONFIGS, RouterConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cls(), "host", "x")


def test_up_gives_its_frontends_its_ready_timeout_as_the_worker_start_timeout(model: str) -> None:
    """While up waits for its workers, the frontends do not call a starting worker unreachable."""
    cmd = parse(["up", "--model", model, "--prefill", "1", "--decode", "1",
                 "--ready-timeout", "300"])
    assert isinstance(cmd.config, UpConfig) and cmd.forwarded is not None
    for f in up.make_plan(cmd.config, cmd.forwarded).frontends:
        cfg = parse(list(f.argv)).config
        assert isinstance(cfg, FrontendConfig) and cfg.worker_start_timeout_s == 300.0
