"""`tandem up`: a whole cluster on this machine. Starts N workers and a frontend on loopback as child
processes (each in its own session so Ctrl-C reaches only us), waits until /health says ready,
prints the URL and a sample curl, and on Ctrl-C/SIGTERM stops every child: SIGTERM, a deadline to
drain, then SIGKILL. If a child dies, everything is stopped and the exit code says so."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tandem.cli import router_flags

STOP_TIMEOUT_S = 15.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--engine", args.engine, "--page-size", str(args.page_size),
             "--max-batch", str(args.max_batch), "--device", args.device,
             "--output-mode", args.output_mode, "--step-delay-ms", str(args.step_delay_ms)]
    if args.num_pages:
        flags += ["--num-pages", str(args.num_pages)]
    flags += ["--kv-transfer-timeout", str(args.kv_transfer_timeout),
              "--kv-room-timeout", str(args.kv_room_timeout),
              "--kv-done-timeout", str(args.kv_done_timeout),
              "--kv-bytes-per-s", str(args.kv_bytes_per_s),
              "--mock-prefill-us-per-token", str(args.mock_prefill_us_per_token),
              "--mock-decode-step-us", str(args.mock_decode_step_us),
              "--mock-decode-us-per-seq", str(args.mock_decode_us_per_seq),
              "--delta-window", str(args.delta_window),
              "--delta-batch", str(args.delta_batch)]
    return flags


class Cluster:
    def __init__(self) -> None:
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(self, name: str, argv: list[str]) -> None:
        cmd = [sys.executable, "-m", "tandem.cli", *argv]
        self.children.append((name, subprocess.Popen(cmd, start_new_session=True)))

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.children if p.poll() is not None]

    def stop(self) -> None:
        for _, p in self.children:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, p in self.children:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"tandem up: {name} did not stop in time; killing it", file=sys.stderr)
                p.kill()
                p.wait(5)


def wait_ready(url: str, cluster: Cluster, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.dead():
            return False
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


def stream_demo(url: str, model: str) -> None:
    body = json.dumps({
        "model": model, "stream": True, "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
    }).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    print("\n--- streaming a chat completion ---")
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                print(f"\n[error] {chunk['error']['message']}")
                continue
            for choice in chunk.get("choices", []):
                print(choice.get("delta", {}).get("content") or "", end="", flush=True)
    print("\n--- done ---\n")


def run_up(args: argparse.Namespace) -> int:
    import os

    host = "127.0.0.1"
    model_name = os.path.basename(os.path.normpath(args.model))
    cluster = Cluster()
    stopping = False

    def on_signal(sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    base = args.worker_base_port
    roles = (["prefill"] * args.prefill + ["decode"] * args.decode) if args.prefill else \
        ["agg"] * args.workers
    addrs = []
    ports = iter(range(base, base + 2 * len(roles))) if base else None
    for i, role in enumerate(roles):
        port = next(ports) if ports else free_port(host)
        addrs.append(f"tcp://{host}:{port}")
        extra = []
        if role == "prefill":
            extra = ["--bootstrap-port", str(next(ports) if ports else free_port(host))]
        cluster.spawn(f"{role} worker {i}", ["worker", "--role", role, "--model", args.model,
                                             "--host", host, "--port", str(port), *extra,
                                             *_engine_flags(args)])
    cluster.spawn("frontend", ["frontend", "--model", args.model, "--workers", ",".join(addrs),
                               "--host", host, "--port", str(args.port),
                               "--stream-interval", str(args.stream_interval),
                               "--http-server", args.http_server,
                               *router_flags(args)])
    url = f"http://{host}:{args.port}"
    try:
        if not wait_ready(url, cluster, args.ready_timeout):
            dead = ", ".join(f"{n} exited with {rc}" for n, rc in cluster.dead())
            print(f"tandem up: the cluster did not become ready ({dead or 'timed out'})",
                  file=sys.stderr)
            return 1
        shape = f"{args.prefill}P{args.decode}D" if args.prefill else \
            f"{args.workers} aggregated worker{'s' if args.workers > 1 else ''}"
        print(f"\ntandem is serving {model_name} at {url}  ({shape}, {args.engine} engine)")
        print(f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{model_name}\", \"stream\": true, \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'")
        print("Press Ctrl-C to stop.", flush=True)
        if args.demo and not stopping:
            stream_demo(url, model_name)
        while not stopping:
            dead = cluster.dead()
            if dead:
                print(f"tandem up: {dead[0][0]} exited with {dead[0][1]}; stopping",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        print("tandem up: stopping", flush=True)
        cluster.stop()
