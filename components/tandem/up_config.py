"""`tandem up`'s own flags (its defaults and help, as `tandem.config` keeps every other
component's): the cluster's shape, ports, logs and keys (`UpConfig`), and the workers' GPUs
(`UpGpus`). The worker and frontend flags `up` forwards are `tandem.config`'s."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import Common, opt
from tandem.converters import (
    address_list, gpu_list, non_negative_int, port, port_or_zero, positive_float, positive_int,
)


@dataclass(frozen=True)
class UpGpus:
    """tandem up: GPUs for the workers (each worker's CUDA_VISIBLE_DEVICES)"""

    gpus: tuple[str, ...] = opt((), "GPU ids to hand out in order, aggregated or prefill workers "
                                "first, then decode; GPUs are handed out when this is given or a "
                                "worker needs them (sglang not on cpu, --device cuda, TP above 1) "
                                "(default: $CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists)",
                                type=gpu_list, metavar="LIST")
    cpu: bool = opt(False, "hand out no GPUs: every worker gets an empty CUDA_VISIBLE_DEVICES "
                    "(mock, reference; sglang workers get --device cpu: SGLang's CPU engine)")
    tp: int = opt(1, "GPUs per worker, every role (SGLang gets it as --tp-size)", type=positive_int)
    prefill_tp: int = opt(0, "GPUs per prefill worker (0 = --tp)", type=non_negative_int)
    decode_tp: int = opt(0, "GPUs per decode worker (0 = --tp)", type=non_negative_int)

    def tp_of(self, role: str) -> int:
        return {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role, 0) or self.tp


@dataclass(frozen=True)
class UpConfig(UpGpus, Common):
    """tandem up: the cluster's shape, its ports, logs and keys"""

    workers: int = opt(1, "number of aggregated workers, when no --prefill/--decode (0 = none: "
                       "frontends for --worker-addresses only)", type=non_negative_int)
    prefill: int = opt(0, "number of prefill workers: with --decode, serve disaggregated (xPyD); "
                       "alone, one role of a cluster spread over nodes", type=non_negative_int)
    decode: int = opt(0, "number of decode workers: with --prefill, serve disaggregated (xPyD); "
                      "alone, one role of a cluster spread over nodes", type=non_negative_int)
    frontends: int = opt(1, "number of frontend processes sharing the HTTP port (SO_REUSEPORT); "
                         "0 = workers only", type=non_negative_int)
    worker_addresses: tuple[str, ...] = opt(
        (), "workers started elsewhere that the frontends also route to: tcp://HOST:PORT, or "
        "dns://NAME:PORT for every address a name resolves to", type=address_list,
        metavar="ADDR[,ADDR...]")
    port: int = opt(8000, "HTTP port of the frontend(s)", type=port)
    advertise_host: str = opt("", "address other processes reach the workers at: the frontends' "
                              "--workers, prefill bootstrap, NIXL (default: --host; 127.0.0.1 "
                              "when --host is 0.0.0.0 or ::)", metavar="ADDR")
    worker_base_port: int = opt(0, "first worker port; workers take consecutive ports, and so do "
                                "prefill bootstrap sockets unless --bootstrap-base-port "
                                "(0 = free ports)", type=port_or_zero)
    bootstrap_base_port: int = opt(0, "first prefill worker's KV bootstrap port; prefill workers "
                                   "count up from it (0 = as --worker-base-port says)",
                                   type=port_or_zero)
    health_base_port: int = opt(0, "first worker's health port (/live, /health, /metrics); "
                                "workers count up from it (0 = free ports)", type=port_or_zero)
    ready_timeout_s: float = opt(120.0, "seconds to wait for the cluster to be ready",
                                 flag="--ready-timeout", type=positive_float)
    log_dir: str = opt("", "write each process's output to DIR/NAME.log and the plan to "
                       "DIR/plan.tsv (default: none, all to this terminal)", metavar="DIR")
    dry_run: bool = opt(False, "print the plan, one tab-separated line per process (kind, name, "
                        "role, GPUs, ports, address, log, then cmd= the command), and start "
                        "nothing")
    demo: bool = opt(False, "once ready, stream one chat completion to the terminal, then keep "
                     "serving")

    def __post_init__(self) -> None:
        if self.cpu and self.gpus:
            raise ValueError("--cpu and --gpus: choose one")
        if self.no_auth and self.auth_keys:
            raise ValueError("--no-auth and --auth-keys: choose one")
        if not (self.auth_keys or self.no_auth) and (not self.frontends or self.worker_addresses):
            raise ValueError("processes started elsewhere (--frontends 0, --worker-addresses) "
                             "need this cluster's key pair: pass --auth-keys DIR, the same on "
                             "every node (`tandem keys init DIR` once), or --no-auth on loopback")
