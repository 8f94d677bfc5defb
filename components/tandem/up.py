"""`tandem up`: a whole cluster on this machine, through the shared launcher (`tandem.launcher`).

`up` declares only its own flags (`UpConfig`: the shape, the HTTP port, ...). Every worker and
frontend flag is generated from `WorkerConfig`/`FrontendConfig` too, but left out of the namespace
unless given, and what was given is forwarded as argv to every worker / frontend (`forwarded`):
nothing is declared twice, and a new worker flag reaches `up`'s children with no code here. Flags
`up` sets per process itself (role, ports, names, worker addresses) are not offered.

Then: plan the processes, check every port is free (before anything says "serving"), start them in
their own sessions (Ctrl-C reaches only us), show progress while workers come up, print the URL and
a sample `curl`, optionally stream a demo answer, and supervise as an orchestrator would
(`LocalCluster.supervise`): a worker or frontend that dies is reported and started again on its
port, at most RESTARTS times per RESTART_WINDOW_S, while the rest of the cluster keeps serving; one
that keeps dying is reported with its exit status and the cluster stops.
Ctrl-C or SIGTERM stops every child (SIGTERM, the drain deadline, then SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
import unicodedata
import urllib.request
from dataclasses import dataclass
from types import FrameType

from tandem import flags, launcher
from tandem.config import (
    PASSTHROUGH_ENGINES, Common, FrontendConfig, UpConfig, WorkerConfig, served_name,
)

COMMON = tuple(f.path[0] for f in flags.flags_of(Common))  # up's own, forwarded to every child
PER_WORKER = ("role", "port", "bootstrap_port", "name", "advertise_host", "health_port")
PER_FRONTEND = ("port", "workers", "reuse_port", "worker_start_timeout_s")
DEMO_MAX_TOKENS = 48
RESTARTS, RESTART_WINDOW_S = 5, 60.0  # a child restarted more often than this stops the cluster


def worker_flags() -> list[flags.Flag]:
    return flags.flags_of(WorkerConfig, exclude=(*COMMON, *PER_WORKER))


def frontend_flags() -> list[flags.Flag]:
    return flags.flags_of(FrontendConfig, exclude=(*COMMON, *PER_FRONTEND))


def add_up_flags(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, flags.flags_of(UpConfig))
    flags.add_flags(parser, worker_flags(), forwarded=True,
                    title=lambda c: f"{(c.__doc__ or '').strip()} (forwarded to every worker)")
    flags.add_flags(parser, frontend_flags(), forwarded=True,
                    title=lambda c: f"{(c.__doc__ or '').strip()} (forwarded to every frontend)")


@dataclass(frozen=True)
class Forwarded:
    """What `up` passes on: argv appended to every worker's and every frontend's command line."""

    worker: tuple[str, ...]
    frontend: tuple[str, ...]
    engine: str
    served_model_name: str


def forwarded(ns: argparse.Namespace, engine_args: tuple[str, ...] = ()) -> Forwarded:
    """The children's flags from `up`'s parsed namespace; `engine_args` (flags tandem does not
    know) go to every worker after its own, for an engine that takes them (ValueError otherwise)."""
    engine = str(getattr(ns, "engine", WorkerConfig.engine))
    if engine_args and engine not in PASSTHROUGH_ENGINES:
        raise ValueError(f"unrecognized arguments: {' '.join(engine_args)} (only --engine "
                         f"{'/'.join(PASSTHROUGH_ENGINES)} takes engine flags)")
    common = [tok for f in flags.flags_of(Common, exclude=("model", "host"))
              if getattr(ns, f.dest) != f.default for tok in flags.render(f, getattr(ns, f.dest))]
    worker = [*common, *flags.render_given(worker_flags(), ns), *engine_args]
    frontend = [*common, *flags.render_given(frontend_flags(), ns)]
    name = str(getattr(ns, "served_model_name", "") or served_name(ns.model))
    return Forwarded(tuple(worker), tuple(frontend), engine, name)


def make_plan(cfg: UpConfig, fwd: Forwarded) -> launcher.Plan:
    shape = launcher.Shape(prefill=cfg.prefill, decode=cfg.decode) if cfg.prefill else \
        launcher.Shape(agg=cfg.workers)
    return launcher.plan(shape, cfg.model, host=cfg.host, http_port=cfg.port,
                         worker_base_port=cfg.worker_base_port, frontends=cfg.frontends,
                         worker_args=fwd.worker, frontend_args=(
                             *fwd.frontend,  # while up waits for its workers, starting is no alarm
                             "--worker-start-timeout", f"{cfg.ready_timeout_s:g}"))


def printable(text: str) -> str:
    """`text` with control and format characters (escape sequences, bells, bidi overrides) shown
    as U+FFFD: a model's raw output must not drive the terminal. Newlines and tabs stay."""
    return "".join(c if c in "\n\t" or unicodedata.category(c)[0] != "C" else "\ufffd"
                   for c in text)


def sample_curl(url: str, model: str) -> str:
    body = json.dumps({"model": model, "max_tokens": 32, "stream": True,
                       "messages": [{"role": "user", "content": "Hello!"}]})
    return (f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}")


def stream_demo(url: str, model: str) -> None:
    body = json.dumps({
        "model": model, "stream": True, "max_tokens": DEMO_MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
    }).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    print("\n--- streaming a chat completion (random weights: the text is gibberish) ---")
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                print(f"\n[error] {printable(str(chunk['error'].get('message')))}")
                continue
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                print(printable(text), end="", flush=True)
    print("\n--- done ---\n", flush=True)


class _Stop(Exception):
    pass


def _raise_stop(sig: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(sig).name)


def _progress(p: launcher.Progress) -> None:
    if not p.frontend_up:
        print(f"tandem up: [{p.elapsed_s:5.1f}s] waiting for the frontend", flush=True)
        return
    names = ", ".join(n.split("@")[0] for n in p.workers_up) or "none yet"
    print(f"tandem up: [{p.elapsed_s:5.1f}s] workers up {len(p.workers_up)}/"
          f"{len(p.workers_expected)}: {names}", flush=True)


def run_up(cfg: UpConfig, fwd: Forwarded) -> int:
    try:
        plan = make_plan(cfg, fwd)
    except ValueError as e:
        print(f"tandem up: {e}", file=sys.stderr)
        return 2
    cluster = launcher.LocalCluster(plan, own_session=True)
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    shape = f"{len(plan.workers)} worker{'s' if len(plan.workers) > 1 else ''}"
    try:
        cluster.start()
        print(f"tandem up: started {shape} and {len(plan.frontends)} frontend"
              f"{'s' if len(plan.frontends) > 1 else ''} ({fwd.engine} engine)", flush=True)
        cluster.wait_ready(cfg.ready_timeout_s, on_progress=_progress)
        print(f"\ntandem is serving {fwd.served_model_name} at {plan.url}  "
              f"({', '.join(w.name for w in plan.workers)}; {fwd.engine} engine)")
        print("  " + sample_curl(plan.url, fwd.served_model_name))
        print("Press Ctrl-C to stop.", flush=True)
        if cfg.demo:
            stream_demo(plan.url, fwd.served_model_name)
        policy = launcher.RestartPolicy(RESTARTS, RESTART_WINDOW_S)
        while True:
            try:
                for line in cluster.supervise(policy):
                    print(f"tandem up: {line}", file=sys.stderr, flush=True)
            except launcher.LaunchError as e:
                print(f"tandem up: {e}; stopping the cluster", file=sys.stderr)
                return 1
            time.sleep(0.2)
    except launcher.LaunchError as e:
        print(f"tandem up: {e}", file=sys.stderr)
        return 1
    except _Stop:
        return 0
    finally:
        for s in old:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        if cluster.procs:
            print("tandem up: stopping", flush=True)
            cluster.stop(timeout=cfg.drain_timeout_s + 5)
        for s, handler in old.items():
            signal.signal(s, handler)
