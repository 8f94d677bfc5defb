"""The `tandem` command: `model init`, `worker`, `frontend`, `up`. Flags are declared once, here."""

from __future__ import annotations

import argparse
import os
import sys

from tandem import config as C


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return value


def _add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router-policy", choices=C.ROUTER_POLICIES, default=C.DEFAULT_ROUTER_POLICY,
                   help="how the router picks a worker within a role: least-loaded, round-robin, "
                        "or prefix (the worker that last served the longest shared prompt "
                        f"prefix) (default: {C.DEFAULT_ROUTER_POLICY})")
    p.add_argument("--max-inflight-per-worker", type=_non_negative_int,
                   default=C.MAX_INFLIGHT_PER_WORKER,
                   help="most requests the router keeps on one worker; more wait in the router's "
                        f"queue (0 = unlimited) (default: {C.MAX_INFLIGHT_PER_WORKER})")
    p.add_argument("--max-pending-prefill-tokens-per-worker", type=_non_negative_int,
                   default=C.MAX_PENDING_PREFILL_TOKENS_PER_WORKER,
                   help="most prompt tokens waiting for their prefill on one worker (0 = "
                        f"unlimited) (default: {C.MAX_PENDING_PREFILL_TOKENS_PER_WORKER})")
    p.add_argument("--max-queue", type=_non_negative_int, default=C.MAX_QUEUE,
                   help="most requests waiting in the router for a worker; past it requests get "
                        f"503 at once (default: {C.MAX_QUEUE})")
    p.add_argument("--queue-timeout", type=_positive_float, default=C.QUEUE_TIMEOUT_S,
                   help="seconds a request may wait in the router's queue before it gets 503 "
                        f"(default: {C.QUEUE_TIMEOUT_S:g})")


def router_config(args: argparse.Namespace) -> C.RouterConfig:
    return C.RouterConfig(
        policy=args.router_policy, max_inflight_per_worker=args.max_inflight_per_worker,
        max_pending_prefill_tokens_per_worker=args.max_pending_prefill_tokens_per_worker,
        max_queue=args.max_queue, queue_timeout_s=args.queue_timeout,
    )


def router_flags(args: argparse.Namespace) -> list[str]:
    """The router flags as `tandem frontend` takes them (for `tandem up`)."""
    return ["--router-policy", args.router_policy,
            "--max-inflight-per-worker", str(args.max_inflight_per_worker),
            "--max-pending-prefill-tokens-per-worker",
            str(args.max_pending_prefill_tokens_per_worker),
            "--max-queue", str(args.max_queue), "--queue-timeout", str(args.queue_timeout)]


def _model_dir(text: str) -> str:
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a model directory (no config.json); create a tiny one with "
            f"`tandem model init {text}`"
        )
    return text


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["reference", "mock"], default="reference",
                   help="reference: a small Llama in torch (CPU or CUDA); mock: no compute, "
                        "deterministic tokens, for overhead and scale runs (default: reference)")
    p.add_argument("--page-size", type=_positive_int, default=C.DEFAULT_PAGE_SIZE,
                   help=f"tokens per KV page (default: {C.DEFAULT_PAGE_SIZE})")
    p.add_argument("--num-pages", type=_positive_int, default=None,
                   help="KV pages per worker (default: enough for --max-batch full contexts)")
    p.add_argument("--max-batch", type=_positive_int, default=64,
                   help="most requests an engine runs at once; more wait in its queue (default: 64)")
    p.add_argument("--device", default="cpu",
                   help="torch device for the reference engine: cpu, cuda, cuda:N (default: cpu)")
    p.add_argument("--output-mode", choices=["cumulative", "incremental"], default="cumulative",
                   help="how the engine reports token ids: all so far (cumulative, SGLang's "
                        "default) or only new ones (default: cumulative)")
    p.add_argument("--step-delay-ms", type=float, default=0.0,
                   help="mock engine only: a fixed delay per engine step (default: 0)")
    p.add_argument("--mock-prefill-us-per-token", type=float,
                   default=C.MOCK_PREFILL_US_PER_TOKEN,
                   help="mock engine only: prefill cost in µs per prompt token admitted in a step "
                        f"(default: {C.MOCK_PREFILL_US_PER_TOKEN:g})")
    p.add_argument("--mock-decode-step-us", type=float, default=C.MOCK_DECODE_STEP_US,
                   help="mock engine only: fixed cost in µs of a decode step "
                        f"(default: {C.MOCK_DECODE_STEP_US:g})")
    p.add_argument("--mock-decode-us-per-seq", type=float,
                   default=C.MOCK_DECODE_US_PER_SEQ,
                   help="mock engine only: decode step cost in µs per running sequence "
                        f"(default: {C.MOCK_DECODE_US_PER_SEQ:g})")
    p.add_argument("--kv-transfer-timeout", type=float, default=C.KV_TRANSFER_TIMEOUT_S,
                   help="PD: seconds one KV transfer may take before it fails "
                        f"(default: {C.KV_TRANSFER_TIMEOUT_S:.0f})")
    p.add_argument("--kv-room-timeout", type=float, default=C.KV_ROOM_TIMEOUT_S,
                   help="PD, prefill side: seconds a request waits for its decode worker's pages "
                        f"(default: {C.KV_ROOM_TIMEOUT_S:.0f})")
    p.add_argument("--kv-done-timeout", type=float, default=C.KV_DONE_TIMEOUT_S,
                   help="PD, decode side: seconds a request waits for its KV to arrive "
                        f"(default: {C.KV_DONE_TIMEOUT_S:.0f})")
    p.add_argument("--delta-window", type=_positive_int, default=C.DELTA_WINDOW,
                   help="delta messages a worker keeps in flight to each frontend; while the "
                        "frontend owes credit, a request's new tokens merge into one waiting delta "
                        f"instead of queueing between processes (default: {C.DELTA_WINDOW})")
    p.add_argument("--delta-batch", type=_non_negative_int, default=C.DELTA_BATCH,
                   help="most deltas in one message to a frontend besides first tokens; the rest "
                        "wait, oldest first, merging (0 = no limit) "
                        f"(default: {C.DELTA_BATCH})")
    p.add_argument("--kv-bytes-per-s", type=float, default=0.0,
                   help="mock engine only: simulated KV transfer rate in bytes/s (default: 0 = "
                        "instant)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="tandem: a disaggregated prefill/decode serving runtime for LLMs.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", parents=[common], help="make or inspect model checkpoints")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = msub.add_parser("init", parents=[common], help="write a tiny Llama checkpoint with seeded random weights "
                                        "and a byte-level BPE tokenizer trained on the spot")
    init.add_argument("dir", help="directory to write (created if missing)")
    init.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    init.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")

    w = sub.add_parser("worker", parents=[common], help="run one worker process serving an engine over ZMQ")
    w.add_argument("--role", choices=["agg", "prefill", "decode"], default="agg",
                   help="agg: prefill and decode in this worker; prefill: compute prompts' KV and "
                        "hand it to decode workers; decode: receive KV and generate (default: agg)")
    w.add_argument("--bootstrap-port", type=_port, default=None,
                   help="prefill role: port of the KV bootstrap socket decode workers connect to "
                        "(required for --role prefill)")
    w.add_argument("--model", type=_model_dir, required=True, help="HF checkpoint directory")
    w.add_argument("--host", default=C.DEFAULT_HOST,
                   help=f"address to bind the worker socket (default: {C.DEFAULT_HOST})")
    w.add_argument("--port", type=_port, required=True, help="port of the worker's ZMQ socket")
    w.add_argument("--name", default="", help="worker name in /workers (default: derived)")
    _add_engine_flags(w)

    f = sub.add_parser("frontend", parents=[common], help="run the OpenAI-compatible HTTP frontend")
    f.add_argument("--model", type=_model_dir, required=True,
                   help="HF checkpoint directory (tokenizer and chat template are read from it)")
    f.add_argument("--served-model-name", default="",
                   help="model name clients must send (default: the directory's name)")
    f.add_argument("--workers", required=True,
                   help="comma-separated worker addresses, e.g. tcp://127.0.0.1:7100,tcp://...")
    f.add_argument("--host", default=C.DEFAULT_HOST, help=f"HTTP bind address (default: {C.DEFAULT_HOST})")
    f.add_argument("--port", type=_port, default=C.DEFAULT_HTTP_PORT,
                   help=f"HTTP port (default: {C.DEFAULT_HTTP_PORT})")
    f.add_argument("--http-server", choices=["uvicorn", "granian"], default="uvicorn",
                   help="HTTP server under the frontend's ASGI app: uvicorn+httptools (fewest "
                        "CPU-µs per token end to end) or granian's embedded server (HTTP on a Rust "
                        "thread; lower TTFT growth at thousands of streams) (default: uvicorn)")
    f.add_argument("--stream-interval", type=_positive_int, default=1,
                   help="send streamed tokens every N tokens (first token at once; requests may "
                        "override with `stream_interval`) (default: 1)")
    _add_router_flags(f)

    u = sub.add_parser("up", parents=[common], help="start a frontend and workers on this machine (loopback), wait "
                                  "until ready, and stop them all on Ctrl-C or SIGTERM")
    u.add_argument("--model", type=_model_dir, required=True, help="HF checkpoint directory")
    u.add_argument("--workers", type=_positive_int, default=1,
                   help="number of aggregated workers, when no --prefill/--decode (default: 1)")
    u.add_argument("--prefill", type=_positive_int, default=0,
                   help="number of prefill workers: with --decode, serve disaggregated (xPyD)")
    u.add_argument("--decode", type=_positive_int, default=0,
                   help="number of decode workers: with --prefill, serve disaggregated (xPyD)")
    u.add_argument("--port", type=_port, default=C.DEFAULT_HTTP_PORT,
                   help=f"HTTP port of the frontend (default: {C.DEFAULT_HTTP_PORT})")
    u.add_argument("--worker-base-port", type=_port, default=None,
                   help="first worker port; workers take consecutive ports (default: free ports)")
    u.add_argument("--http-server", choices=["uvicorn", "granian"], default="uvicorn",
                   help="HTTP server under the frontend's ASGI app: uvicorn+httptools (fewest "
                        "CPU-µs per token end to end) or granian's embedded server (HTTP on a Rust "
                        "thread; lower TTFT growth at thousands of streams) (default: uvicorn)")
    u.add_argument("--stream-interval", type=_positive_int, default=1,
                   help="frontend's default stream interval (default: 1)")
    u.add_argument("--ready-timeout", type=float, default=120.0,
                   help="seconds to wait for /health to say ready (default: 120)")
    u.add_argument("--demo", action="store_true",
                   help="once ready, stream one chat completion to the terminal, then keep serving")
    _add_engine_flags(u)
    _add_router_flags(u)
    return parser


def worker_config(args: argparse.Namespace) -> C.WorkerConfig:
    return C.WorkerConfig(
        role=args.role, engine=args.engine, model=args.model, host=args.host, port=args.port,
        page_size=args.page_size, num_pages=args.num_pages or 0, max_batch=args.max_batch,
        device=args.device, output_mode=args.output_mode, step_delay_ms=args.step_delay_ms,
        name=args.name, bootstrap_port=args.bootstrap_port or 0,
        kv_transfer_timeout_s=args.kv_transfer_timeout, kv_room_timeout_s=args.kv_room_timeout,
        kv_done_timeout_s=args.kv_done_timeout, kv_bytes_per_s=args.kv_bytes_per_s,
        mock_prefill_us_per_token=args.mock_prefill_us_per_token,
        mock_decode_step_us=args.mock_decode_step_us,
        mock_decode_us_per_seq=args.mock_decode_us_per_seq,
        delta_window=args.delta_window, delta_batch=args.delta_batch,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tandem.runtime.lifecycle import setup_logging

    setup_logging(args.log_level)
    if args.command == "model":
        from tandem.engines.reference.checkpoint import write_tiny_model

        if os.path.exists(os.path.join(args.dir, "config.json")) and not args.force:
            print(f"{args.dir} already holds a checkpoint (use --force to overwrite)")
            return 0
        write_tiny_model(args.dir, seed=args.seed)
        print(f"wrote a tiny Llama checkpoint to {args.dir}")
        return 0
    if args.command == "worker":
        from tandem.worker.main import run_worker

        if args.role == "prefill" and not args.bootstrap_port:
            print("tandem worker: --role prefill needs --bootstrap-port", file=sys.stderr)
            return 2
        run_worker(worker_config(args))
        return 0
    if args.command == "frontend":
        from tandem.frontend.main import run_frontend

        workers = tuple(a.strip() for a in args.workers.split(",") if a.strip())
        if not workers:
            print("tandem frontend: --workers needs at least one address", file=sys.stderr)
            return 2
        run_frontend(C.FrontendConfig(
            model=args.model, served_model_name=args.served_model_name, workers=workers,
            host=args.host, port=args.port, stream_interval=args.stream_interval,
            http_server=args.http_server,
            router=router_config(args),
        ))
        return 0
    if args.command == "up":
        from tandem.up import run_up

        if bool(args.prefill) != bool(args.decode):
            print("tandem up: disaggregated serving needs both --prefill N and --decode M",
                  file=sys.stderr)
            return 2
        return run_up(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
