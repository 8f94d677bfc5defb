"""SGLang's own server as a peer on this machine: aggregated, or a prefill and a decode server
joined by SGLang's NIXL transfer behind SGLang's own router (`sglang-router`, PD mode). The engine
flags are the ones tandem's adapter gives SGLang's CPU engine (tandem.engines.sglang_cpu), so the
two systems differ only in what is around the engine. Every process binds loopback, is started in
its own session and stopped by PID (SIGTERM to its group, a deadline, then SIGKILL).

The router lives in a venv of its own, outside the repository. Made once:

    python3.11 -m venv ~/peers/sglang-router
    ~/peers/sglang-router/bin/pip install sglang-router==0.3.2
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from tandem.engines import sglang_cpu
from tandem.launcher import Proc, free_port, stop_all, wait_healthy

ENV = {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo", **sglang_cpu.CPU_ENV}


@dataclass
class SGLangCluster:
    url: str
    procs: dict[str, Proc] = field(default_factory=dict)

    def stop(self) -> None:
        stop_all(self.procs.values(), timeout=20)


def _spawn(name: str, cmd: list[str], log_dir: str, address: str) -> Proc:
    log_path = os.path.join(log_dir, f"sglang-{name}.log")
    with open(log_path, "ab") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, **ENV}, start_new_session=True)
    return Proc(name, p, address, log_path, group=True)


def _server(model: str, role: str, log_dir: str, engine_flags: list[str],
            bootstrap_port: int = 0) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "perf.peers.sglang_server", "--model-path", model,
           "--host", "127.0.0.1", "--port", str(port), *sglang_cpu.flags(role), *engine_flags]
    if role != "agg":
        cmd += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "nixl"]
    if bootstrap_port:
        cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return _spawn(role, cmd, log_dir, f"http://127.0.0.1:{port}")


def _wait_served(url: str, model: str, procs: list[Proc], timeout: float) -> None:
    """Until one token comes back through the router (it answers /health before it has
    registered its workers)."""
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    while True:
        try:
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        dead = [p.name for p in procs if not p.alive()]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"SGLang's 1P1D never served a token (exited: {dead})")
        time.sleep(1.0)


def launch(shape: str, model: str, log_dir: str, engine_flags: list[str], router_python: str,
           ready_timeout_s: float = 600.0) -> SGLangCluster:
    """SGLang serving `model`: "agg" (one server) or "1p1d" (prefill, decode and its router)."""
    os.makedirs(log_dir, exist_ok=True)
    procs: dict[str, Proc] = {}
    try:
        if shape == "agg":
            procs["agg"] = _server(model, "agg", log_dir, engine_flags)
            url = procs["agg"].address
        else:
            bootstrap = free_port()
            procs["prefill"] = _server(model, "prefill", log_dir, engine_flags, bootstrap)
            procs["decode"] = _server(model, "decode", log_dir, engine_flags)
            # The router registers its workers once, in the background, and gives up on one
            # that is not up yet: it starts after both answer.
            wait_healthy({n: p.address for n, p in procs.items()}, list(procs.values()),
                         ready_timeout_s)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            procs["router"] = _spawn("router", [
                router_python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", procs["prefill"].address, str(bootstrap),
                "--decode", procs["decode"].address, "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin"], log_dir, url)
        wait_healthy({n: p.address for n, p in procs.items()}, list(procs.values()),
                     ready_timeout_s)
        if shape != "agg":
            _wait_served(url, model, list(procs.values()), ready_timeout_s)
    except BaseException:
        stop_all(procs.values(), timeout=20)
        raise
    return SGLangCluster(url, procs)
