"""`tandem up`: a whole cluster on this machine, through the shared launcher (`tandem.launcher`).

`up` declares only its own flags (`UpConfig`: the shape, ports, GPUs, logs, keys). Every worker and
frontend flag is generated from `WorkerConfig`/`FrontendConfig` too, but left out of the namespace
unless given, and what was given is forwarded as argv to every worker / frontend (`forwarded`):
nothing is declared twice, and a new worker flag reaches `up`'s children with no code here. Flags
`up` sets per process itself (role, ports, names, worker addresses) are not offered.

Then: plan the processes (`make_plan`: tandem.plans for the shape and the ports, tandem.gpus for
each worker's GPUs), print the plan and stop there with `--dry-run`, or: make the cluster's CURVE
key pair in a private temporary directory unless `--auth-keys` or `--no-auth` (every child gets
it; removed on exit), check every port is free (before anything says "serving"), start the
processes in their own sessions (Ctrl-C reaches only us; output to the terminal or one log per
process in `--log-dir`), show progress while workers come up, print the URL and a sample `curl`
(with no frontend: the worker addresses to give frontends elsewhere), optionally stream a demo
answer (tandem.demo), and supervise as an orchestrator would (`LocalCluster.supervise`): a worker
or frontend that dies is reported and started again on its ports, at most RESTARTS times per
RESTART_WINDOW_S, while the rest of the cluster keeps serving; one that keeps dying is reported
with its exit status and the cluster stops. Ctrl-C or SIGTERM stops every child (frontends first;
SIGTERM, the drain deadline + 5 s, then SIGKILL to its process group).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from tandem import demo, flags, gpus, launcher
from tandem.config import PASSTHROUGH_ENGINES, Common, FrontendConfig, WorkerConfig, served_name
from tandem.up_config import UpConfig

COMMON = tuple(f.path[0] for f in flags.flags_of(Common))  # up's own, forwarded to every child
PER_WORKER = ("role", "port", "bootstrap_port", "name", "advertise_host", "health_port",
              "kv_events_port", "kv_events_replay_port")
PER_FRONTEND = ("port", "workers", "reuse_port", "worker_start_timeout_s")
NEW_KEYS = "<new key pair>"  # where --dry-run shows the key pair up would make
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
    """What `up` passes on: argv for every worker's and every frontend's command line."""

    worker: tuple[str, ...]  # tandem's worker flags
    frontend: tuple[str, ...]
    engine: str
    served_model_name: str
    device: str = ""  # --device as given ("" = not given)
    engine_args: tuple[str, ...] = ()  # the engine's own flags, last on every worker's line


def forwarded(ns: argparse.Namespace, engine_args: tuple[str, ...] = ()) -> Forwarded:
    """The children's flags from `up`'s parsed namespace; `engine_args` (flags tandem does not
    know) go to every worker after its own, for an engine that takes them (ValueError otherwise)."""
    engine = str(getattr(ns, "engine", WorkerConfig.engine))
    if engine_args and engine not in PASSTHROUGH_ENGINES:
        raise ValueError(f"unrecognized arguments: {' '.join(engine_args)} (only --engine "
                         f"{'/'.join(PASSTHROUGH_ENGINES)} takes engine flags)")
    common = [tok for f in flags.flags_of(Common, exclude=("model", "host"))
              if getattr(ns, f.dest) != f.default for tok in flags.render(f, getattr(ns, f.dest))]
    worker = [*common, *flags.render_given(worker_flags(), ns)]
    frontend = [*common, *flags.render_given(frontend_flags(), ns)]
    name = str(getattr(ns, "served_model_name", "") or served_name(ns.model))
    return Forwarded(tuple(worker), tuple(frontend), engine, name,
                     str(getattr(ns, "device", "")), engine_args)


def make_plan(cfg: UpConfig, fwd: Forwarded, keys: str = "",
              found_gpus: Callable[[], tuple[str, ...]] = gpus.visible) -> launcher.Plan:
    """The cluster `cfg` asks for, each worker with its GPUs (tandem.gpus); `keys`: the key pair
    directory up made for it ("" = none made). ValueError says what cannot be done."""
    if cfg.no_auth:
        from tandem.runtime.auth import host_of, is_loopback

        for host in (cfg.host, *map(host_of, cfg.worker_addresses)):
            if not is_loopback(host):
                raise ValueError(f"--no-auth: {host} is beyond loopback, where every process "
                                 "needs the cluster's keys (drop --no-auth, or pass --auth-keys "
                                 "DIR)")
    shape = launcher.Shape(prefill=cfg.prefill, decode=cfg.decode) \
        if cfg.prefill or cfg.decode else launcher.Shape(agg=cfg.workers)
    auth = ("--auth-keys", keys) if keys else ()
    p = launcher.plan(shape, cfg.model, host=cfg.host, advertise_host=cfg.advertise_host,
                      http_port=cfg.port, worker_base_port=cfg.worker_base_port,
                      bootstrap_base_port=cfg.bootstrap_base_port,
                      health_base_port=cfg.health_base_port, frontends=cfg.frontends,
                      worker_args=(*fwd.worker, *auth), elsewhere=cfg.worker_addresses,
                      frontend_args=(*fwd.frontend, *auth,  # while up waits, starting is no alarm
                                     "--worker-start-timeout", f"{cfg.ready_timeout_s:g}"))
    return gpus.with_gpus(p, cfg, engine=fwd.engine, device=fwd.device,
                          engine_args=fwd.engine_args, found=found_gpus)


def describe(p: launcher.Plan, cfg: UpConfig, fwd: Forwarded, auth: str) -> str:
    """The plan as `--dry-run` prints it (and DIR/plan.tsv holds): a `plan` line, then one line
    per process, tab-separated key=value fields, the command (`cmd=`) last."""
    def line(kind: str, fields: dict[str, object]) -> str:
        return "\t".join([kind, *(f"{k}={v}" for k, v in fields.items())])

    used = [g for w in p.workers for g in w.gpus or ()]
    out = [line("plan", {
        "workers": len(p.workers), "frontends": len(p.frontends), "engine": fwd.engine,
        "gpus": ",".join(used) or "-", "http_port": p.frontends[0].ports[0] if p.frontends else "-",
        "auth": auth, "log_dir": cfg.log_dir or "-", "addresses": ",".join(p.worker_addresses)})]
    for c in p.children:
        cmd = [*(f"{k}={v}" for k, v in c.env), *launcher.command(c.argv)]
        out.append(line(c.kind, {
            "name": c.name, "role": c.role,
            "gpus": "-" if c.gpus is None else ",".join(c.gpus) or "none",
            "port": c.ports[0], "bootstrap_port": c.bootstrap_port or "-",
            "health_port": c.health_port or "-", "address": c.address,
            "log": os.path.join(cfg.log_dir, f"{c.name}.log") if cfg.log_dir else "-",
            "cmd": shlex.join(cmd)}))
    return "\n".join(out)


class _Stop(Exception):
    pass


def _raise_stop(sig: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(sig).name)


def _progress(p: launcher.Progress) -> None:
    if p.via_frontend and not p.frontend_up:
        print(f"tandem up: [{p.elapsed_s:5.1f}s] waiting for the frontend", flush=True)
        return
    names = ", ".join(n.split("@")[0] for n in p.workers_up) or "none yet"
    print(f"tandem up: [{p.elapsed_s:5.1f}s] workers up {len(p.workers_up)}/"
          f"{len(p.workers_expected)}: {names}", flush=True)


def new_keys() -> str:
    """A new cluster key pair in a new private directory (mode 0700); its path."""
    from tandem.runtime.auth import write_keys

    where = tempfile.mkdtemp(prefix="tandem-keys-")
    write_keys(where)
    return where


def run_up(cfg: UpConfig, fwd: Forwarded) -> int:
    made = not (cfg.auth_keys or cfg.no_auth)  # up makes the cluster's key pair (removed on exit)
    keys = ""
    try:
        try:
            keys = new_keys() if made and not cfg.dry_run else ""
            plan = make_plan(cfg, fwd, NEW_KEYS if made and cfg.dry_run else keys)
        except ValueError as e:
            print(f"tandem up: {e}", file=sys.stderr)
            return 2
        text = describe(plan, cfg, fwd, "off" if cfg.no_auth else cfg.auth_keys or "new key pair")
        if cfg.dry_run:
            print(text)
            return 0
        return serve(cfg, fwd, plan, text)
    finally:
        if keys:
            shutil.rmtree(keys, ignore_errors=True)


def serve(cfg: UpConfig, fwd: Forwarded, plan: launcher.Plan, described: str) -> int:
    """Start the plan's processes, wait until ready, supervise until a signal (module docstring)."""
    cluster = launcher.LocalCluster(plan, log_dir=cfg.log_dir, own_session=True)
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    shape = f"{len(plan.workers)} worker{'s' if len(plan.workers) != 1 else ''}"
    try:
        cluster.start()
        print(f"tandem up: started {shape} and {len(plan.frontends)} frontend"
              f"{'s' if len(plan.frontends) != 1 else ''} ({fwd.engine} engine)", flush=True)
        for c in plan.children:
            p = cluster.procs[c.name]
            print(f"tandem up:   {c.name} (pid {p.pid})" + (f", GPUs {','.join(c.gpus)}"
                  if c.gpus else "") + (f", log {p.log_path}" if p.log_path else ""), flush=True)
        if cfg.log_dir:
            with open(os.path.join(cfg.log_dir, "plan.tsv"), "w") as f:
                f.write(described + "\n")
        cluster.wait_ready(cfg.ready_timeout_s, on_progress=_progress)
        if plan.frontends:
            print(f"\ntandem is serving {fwd.served_model_name} at {plan.url}  "
                  f"({', '.join(w.name for w in plan.workers) or 'no local workers'}; "
                  f"{fwd.engine} engine)")
            print("  " + demo.sample_curl(plan.url, fwd.served_model_name))
        else:
            print(f"\ntandem up: {shape} ready; give the frontends --workers "
                  f"{','.join(plan.worker_addresses)}")
        print("Press Ctrl-C to stop.", flush=True)
        if cfg.demo and plan.frontends:
            demo.stream_demo(plan.url, fwd.served_model_name)
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
