"""Every component default and its help, once: the frozen dataclasses the processes run from.

A field's `default` is the default and its `metadata` is the rest of what the `tandem` command needs
to offer it as a flag (`tandem.flags` builds the parsers from these fields; nothing else declares a
flag, a default or a help text):

- `help`: one line, what the value means (the parser appends the default);
- `flag`: the flag's spelling, when it is not `--` plus the field name with `-` for `_`;
- `type`: a converter from text (raises ValueError with a message a user can act on);
- `choices`: the values allowed, or a function returning them (read when a parser is built);
- `required`: the flag must be given;
- `cli: False`: the field is set by code (the launcher, engine passthrough), never by a flag.

The chain: `Common` (what every process takes) -> `WorkerConfig` (with the mock engine's knobs,
`MockTiming`, as a section of their own) / `FrontendConfig` (with a nested `RouterConfig`) /
`UpConfig` (`tandem up`'s own flags, with `UpGpus` as a section, in `tandem.up_config`; the worker
and frontend flags it forwards come from the two configs above). The converters from text are `tandem.converters`. The
runtime's own defaults (sockets, heartbeats, GC) are in `tandem.runtime.config`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from tandem.converters import (
    address_list, admin_token_file, api_key_file, key_dir, model_dir, non_negative_float,
    non_negative_int, port, port_or_zero, positive_float, positive_int, salt_source,
    tenant_sources,
)
from tandem.engines.sglang_cpu import DEVICE_HELP
from tandem.runtime.logs import LOG_FORMATS, LogFormat
from tandem.runtime.wire import OutputMode, Role, SamplingParams

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
HttpServer = Literal["uvicorn", "granian"]
RouterPolicy = Literal["auto", "least-loaded", "round-robin", "prefix", "kv"]

ROLES: tuple[Role, ...] = ("agg", "prefill", "decode")
OUTPUT_MODES: tuple[OutputMode, ...] = ("cumulative", "incremental")
LOG_LEVELS: tuple[LogLevel, ...] = ("DEBUG", "INFO", "WARNING", "ERROR")
HTTP_SERVERS: tuple[HttpServer, ...] = ("uvicorn", "granian")
ROUTER_POLICIES: tuple[RouterPolicy, ...] = ("auto", "least-loaded", "round-robin", "prefix",
                                             "kv")
ENGINES = ("reference", "mock", "sglang")  # what a worker can run (tandem.engines.factory builds it)
PASSTHROUGH_ENGINES = ("sglang",)  # engines whose own flags pass through `tandem worker` untouched

RETRY_AFTER_S = 1.0  # what a 503 from the router tells the client to wait


def served_name(model: str) -> str:
    """The model name clients send when none is configured: the model directory's name as given
    (`.` is the current directory's name; a symlink keeps its own name)."""
    return os.path.basename(os.path.abspath(model)) or "model"


def opt(default: Any, help: str, *, flag: str = "", type: Callable[[str], Any] | None = None,
        choices: tuple[Any, ...] | None = None,
        required: bool = False, cli: bool = True, metavar: str = "") -> Any:
    """A dataclass field carrying its flag's metadata (see the module docstring)."""
    meta: dict[str, Any] = {"help": help, "cli": cli, "required": required}
    for key, value in (("flag", flag), ("type", type), ("choices", choices), ("metavar", metavar)):
        if value:
            meta[key] = value
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed in a config")
    return field(default=default, metadata=meta)


def _wire_default(struct: type[msgspec.Struct], name: str) -> Any:
    for f in msgspec.structs.fields(struct):
        if f.name == name:
            return f.default
    raise KeyError(name)


@dataclass(frozen=True)
class Common:
    """flags every process takes"""

    model: str = opt("", "model checkpoint directory (HF layout: config.json, weights, tokenizer)",
                     type=model_dir, required=True, metavar="DIR")
    host: str = opt("127.0.0.1", "address to bind")
    log_level: LogLevel = opt("INFO", "log level of the process", choices=LOG_LEVELS)
    log_format: LogFormat = opt("text", "log line format: text, or json (one object per line)",
                                choices=LOG_FORMATS)
    drain_timeout_s: float = opt(10.0, "on SIGTERM, seconds in-flight requests get to finish "
                                 "before they are ended", flag="--drain-timeout",
                                 type=non_negative_float)
    auth_keys: str = opt("", "directory holding the cluster's CURVE key pair (`tandem keys init "
                         "DIR`), the same for every process of the cluster (default: the one "
                         "`tandem keys init` wrote to ~/.config/tandem/keys; with none there a "
                         "worker or frontend refuses to start unless --no-auth; `tandem up` makes "
                         "a new pair for its processes)", type=key_dir, metavar="DIR")
    no_auth: bool = opt(False, "run without the cluster's keys: any local process may then talk "
                        "to this process's sockets, and KV a decode worker receives is never "
                        "cached (loopback only; `tandem up` passes it to every process it starts "
                        "and makes no key pair)")


@dataclass(frozen=True)
class MockTiming:
    """mock engine only: its timing model (all 0 = runtime-overhead runs)"""

    step_delay_ms: float = opt(0.0, "a fixed delay per engine step, in ms",
                               type=non_negative_float)
    mock_prefill_us_per_token: float = opt(0.0, "prefill cost in µs per prompt token admitted in "
                                           "a step", type=non_negative_float)
    mock_decode_step_us: float = opt(0.0, "fixed cost in µs of a decode step",
                                     type=non_negative_float)
    mock_decode_us_per_seq: float = opt(0.0, "decode step cost in µs per running sequence",
                                        type=non_negative_float)
    kv_bytes_per_s: float = opt(0.0, "simulated KV transfer rate in bytes/s (0 = instant)",
                                type=non_negative_float)
    mock_d2h_bytes_per_s: float = opt(0.0, "simulated copy rate into the host tier "
                                      "(--host-kv-pages) in bytes/s, charged to the step that "
                                      "evicts (0 = instant)", type=non_negative_float)
    mock_h2d_bytes_per_s: float = opt(0.0, "simulated copy rate back from the host tier in "
                                      "bytes/s, charged to the step that loads (0 = instant)",
                                      type=non_negative_float)

    @classmethod
    def of(cls, cfg: MockTiming) -> MockTiming:
        """This section of a config that holds it (a WorkerConfig), on its own."""
        return cls(**{name: getattr(cfg, name) for name in cls.__dataclass_fields__})

    def step_cost(self, num_prompt_tokens: int, num_decoding: int) -> float:
        """Seconds a mock engine step costs: the fixed delay, the prompt tokens it admits, and,
        when it decodes, the decode step and each sequence it decodes."""
        us = self.mock_prefill_us_per_token * num_prompt_tokens
        if num_decoding:
            us += self.mock_decode_step_us + self.mock_decode_us_per_seq * num_decoding
        return self.step_delay_ms / 1e3 + us / 1e6


@dataclass(frozen=True)
class WorkerConfig(MockTiming, Common):
    """worker flags"""

    role: Role = opt("agg", "agg: prefill and decode in this worker; prefill: compute prompts' KV "
                     "and hand it to decode workers; decode: receive KV and generate", choices=ROLES)
    engine: str = opt("reference", "reference: a small Llama in torch (CPU or CUDA); mock: no "
                      "compute, deterministic tokens, for overhead and scale runs; sglang: SGLang "
                      "(its own flags pass through)", choices=ENGINES)
    port: int = opt(7100, "port of the worker's ZMQ socket (frontends connect here)", type=port)
    advertise_host: str = opt("", "address other processes reach this worker at; prefill "
                              "bootstrap and NIXL peers use it (default: the bind host)")
    bootstrap_port: int = opt(0, "prefill role: port of the KV bootstrap socket decode workers "
                              "connect to (required for --role prefill)", type=port_or_zero)
    health_port: int = opt(0, "port of the HTTP probe server (/live, /health; 0 = none)",
                           type=port_or_zero)
    name: str = opt("", "worker name in /workers (default: role-engine-port-pid)")
    page_size: int = opt(16, "tokens per KV page", type=positive_int)
    num_pages: int = opt(0, "KV pages per worker (0 = enough for --max-batch full contexts)",
                         type=non_negative_int)
    max_batch: int = opt(64, "most requests an engine runs at once; more wait in its queue",
                         type=positive_int)
    max_prefill_tokens: int = opt(0, "mock and reference engines: most prompt tokens prefilled in "
                                  "one step; a longer prompt is prefilled in chunks over several "
                                  "steps, the one in progress first (chunked prefill: vLLM's "
                                  "max-num-batched-tokens, SGLang's --chunked-prefill-size; "
                                  "0 = the engine's own: reference 4096, mock unlimited)",
                                  type=non_negative_int)
    prefix_cache: bool = opt(True, "mock and reference engines: keep computed full KV pages, "
                             "keyed by their token prefix, and reuse them for later prompts that "
                             "start the same way (--no-prefix-cache: recompute every prompt)")
    host_kv_pages: int = opt(0, "mock and reference engines: pages of a host-memory tier for "
                             "the prefix cache: cached pages evicted from the KV pool are copied "
                             "there and copied back on a hit instead of being computed again "
                             "(0 = no host tier; needs the prefix cache)",
                             type=non_negative_int)
    check_kv: bool = opt(False, "check the KV page accounting after every engine step and stop "
                         "the worker if it is broken (slow: for debugging; the test suite turns "
                         "it on with TANDEM_CHECK_KV=1)")
    device: str = opt("", DEVICE_HELP)
    threads: int = opt(0, "reference engine: torch's CPU threads for the model's math (0 = "
                       "torch's default, one per core; workers sharing a machine's cores may "
                       "each take a share)", type=non_negative_int)
    output_mode: OutputMode | Literal[""] = opt(
        "", "how the engine reports token ids: all so far (cumulative) or only the new ones "
        "(incremental) (default: the engine's own: incremental for mock and reference, "
        "cumulative for sglang, SGLang's default)", choices=OUTPUT_MODES)
    kv_transfer_timeout_s: float = opt(30.0, "PD: seconds one KV transfer may take before it "
                                       "fails", flag="--kv-transfer-timeout", type=positive_float)
    kv_room_timeout_s: float = opt(60.0, "PD, prefill side: seconds a request waits for its "
                                   "decode worker's pages", flag="--kv-room-timeout",
                                   type=positive_float)
    kv_done_timeout_s: float = opt(120.0, "PD, decode side: seconds a request waits for its KV "
                                   "(queue + prefill + write)", flag="--kv-done-timeout",
                                   type=positive_float)
    delta_window: int = opt(2, "delta messages a worker keeps in flight to each frontend; while "
                            "the frontend owes credit, a request's new tokens merge into one "
                            "waiting delta", type=positive_int)
    delta_batch: int = opt(64, "most deltas in one message to a frontend that lags, besides "
                           "first tokens; the rest wait, oldest first, merging (a frontend that "
                           "keeps up gets all in one message; 0 = no limit)",
                           type=non_negative_int)
    frontend_silent_s: float = opt(10.0, "a frontend silent this long while it owes credit gets "
                                   "its requests ended", flag="--frontend-silent-timeout",
                                   type=positive_float)
    kv_events: bool = opt(True, "publish the engine's KV cache events (BlockStored, "
                          "BlockRemoved) on a ZMQ PUB socket in the format vLLM "
                          "and SGLang use, with a replay socket; the handshake tells frontends "
                          "where (mock and reference engines with the prefix cache on; for "
                          "--engine sglang pass SGLang's own --kv-events-config)")
    kv_events_port: int = opt(0, "port of the KV events PUB socket (0 = one the OS picks as the "
                              "worker binds; the handshake says which)", type=port_or_zero)
    kv_events_replay_port: int = opt(0, "port of the KV events replay socket (0 = one the OS "
                                     "picks as the worker binds)", type=port_or_zero)
    engine_args: tuple[str, ...] = opt((), "the engine's own flags, passed through untouched",
                                       cli=False)

    def __post_init__(self) -> None:
        if self.role == "prefill" and not self.bootstrap_port:
            raise ValueError("--role prefill needs --bootstrap-port")
        if self.host_kv_pages and self.engine not in ("mock", "reference"):
            raise ValueError(f"--host-kv-pages is for the mock and reference engines; --engine "
                             f"{self.engine} has its own (SGLang: --enable-hierarchical-cache)")
        if self.host_kv_pages and not self.prefix_cache:
            raise ValueError("--host-kv-pages needs the prefix cache (drop --no-prefix-cache)")
        if self.engine_args and self.engine not in PASSTHROUGH_ENGINES:
            raise ValueError(f"unrecognized arguments: {' '.join(self.engine_args)} (only "
                             f"--engine {'/'.join(PASSTHROUGH_ENGINES)} takes engine flags; "
                             f"--engine {self.engine} takes none)")

    @property
    def reach_host(self) -> str:
        """The address other processes use to reach this worker."""
        return self.advertise_host or self.host

    @property
    def publishes_kv_events(self) -> bool:
        """tandem publishes the engine's KV events: asked for, and a tandem engine with its
        prefix cache on (SGLang publishes its own, through its --kv-events-config)."""
        return self.kv_events and self.prefix_cache and self.engine in ("mock", "reference")


@dataclass(frozen=True)
class RouterConfig:
    """router flags: placement and admission (0 = unlimited for the per-worker limits)"""

    policy: RouterPolicy = opt("auto", "how the router picks a worker within a role: "
                               "least-loaded, round-robin, prefix (the worker that last served "
                               "the longest shared prompt prefix), kv (the lowest predicted "
                               "time to first token from what each worker's KV events say it "
                               "holds and its load; see README, \"KV-aware routing\"), or auto: "
                               "kv among workers that publish KV events, least-loaded otherwise",
                               flag="--router-policy", choices=ROUTER_POLICIES)
    max_inflight_per_worker: int = opt(4096, "most requests the router keeps on one worker; more "
                                       "wait in the router's queue (0 = unlimited); while "
                                       "tenants share, the last is kept for a tenant with "
                                       "nothing in flight there",
                                       type=non_negative_int)
    max_pending_prefill_tokens_per_worker: int = opt(0, "most prompt tokens waiting for their "
                                                     "prefill on one worker (0 = unlimited)",
                                                     type=non_negative_int)
    max_queue: int = opt(4096, "most requests waiting in the router for a worker; past it "
                         "requests get 503 at once", type=non_negative_int)
    queue_timeout_s: float = opt(30.0, "seconds a request may wait in the router's queue before "
                                 "it gets 503", flag="--queue-timeout", type=positive_float)
    prefix_cache_blocks: int = opt(65_536, "prefix policy: prompt block hashes remembered (LRU), "
                                   "per role", type=positive_int)
    kv_prefill_weight: float = opt(1.0, "kv policy: weight of a worker's prefill work (its "
                                   "weighted queue plus the prompt tokens it lacks) in its cost",
                                   type=non_negative_float)
    kv_queue_weight: float = opt(0.25, "kv policy: how much of a worker's queued prefill delays "
                                 "a new request (an engine batches prefills: less than all)",
                                 type=non_negative_float)
    kv_decode_weight: float = opt(32.0, "kv policy: what one request running on a worker "
                                  "costs a new one there, in prompt tokens to compute (its share "
                                  "of every step)", type=non_negative_float)
    kv_predict_ttl_s: float = opt(2.0, "kv policy: seconds a placement counts as cached on its "
                                  "worker before that worker's events say so (siblings land "
                                  "together)", flag="--kv-predict-ttl", type=non_negative_float)
    kv_approx_ttl_s: float = opt(120.0, "kv policy: seconds a placement counts as cached on a "
                                 "worker that publishes no KV events (its approximate index)",
                                 flag="--kv-approx-ttl", type=non_negative_float)
    pd_local_prefill_tokens: int = opt(0, "PD with the kv policy: a request whose prompt the "
                                       "chosen decode worker lacks at most this many tokens of, "
                                       "and fewer than the chosen prefill worker lacks (it holds "
                                       "a previous turn's completion), is prefilled there, with "
                                       "no prefill worker (0 = never)", type=non_negative_int)
    session_ttl_s: float = opt(300.0, "kv policy: seconds a session (X-Session-ID, "
                               "X-Correlation-ID or the request's user) prefers the worker of its "
                               "last turn", flag="--session-ttl", type=non_negative_float)
    max_migrations: int = opt(2, "most times a request whose worker is lost mid-request is moved "
                              "to another worker (resumed after the tokens already sent); past "
                              "it the request fails (0 = never move)", type=non_negative_int)
    request_timeout_s: float = opt(600.0, "end-to-end deadline of a request in seconds, queue "
                                   "included: past it the request ends with an error (0 = none)",
                                   flag="--request-timeout", type=non_negative_float)


@dataclass(frozen=True)
class FrontendConfig(Common):
    """frontend flags"""

    port: int = opt(8000, "HTTP port", type=port)
    workers: tuple[str, ...] = opt((), "comma-separated worker addresses: tcp://HOST:PORT, or "
                                   "dns://NAME:PORT for every address a DNS name resolves to",
                                   type=address_list, required=True, metavar="ADDR[,ADDR...]")
    served_model_name: str = opt("", "model name clients send (default: the model directory's "
                                 "name)")
    stream_interval: int = opt(1, "send streamed tokens every N tokens (first token at once; a "
                               "request may override with `stream_interval`)", type=positive_int)
    default_max_tokens: int = opt(_wire_default(SamplingParams, "max_tokens"),
                                  "max_tokens of a request that does not set it",
                                  type=positive_int)
    http_server: HttpServer = opt("uvicorn", "HTTP server under the ASGI app: uvicorn+httptools "
                                  "(fewest CPU-µs per token) or granian's embedded server",
                                  choices=HTTP_SERVERS)
    reuse_port: bool = opt(False, "bind the HTTP port with SO_REUSEPORT, so that several frontend "
                           "processes share it (tandem up --frontends N)")
    admin_token_file: str = opt("", "a file whose first line is the admin token: a client not on "
                                "loopback reads /workers (where each worker publishes its KV "
                                "events) only with `Authorization: Bearer TOKEN` (default: none, "
                                "loopback clients only)", metavar="FILE", type=admin_token_file)
    api_key_file: str = opt("", "a file of the API keys clients must present, one per line "
                            "(vLLM's --api-key, kept out of the command line): every endpoint "
                            "but /health, /live, /metrics and /workers then answers a request "
                            "without one of them, as `Authorization: Bearer KEY` or `api-key: "
                            "KEY`, with 401 invalid_api_key, and each key is a tenant its holder "
                            "cannot multiply (default: none, the API is open)", metavar="FILE",
                            type=api_key_file)
    tenant_by: tuple[str, ...] = opt(("key", "user", "address"), "where a request's tenant (the "
                                     "client fairness is kept across) is read, first found "
                                     "wins: key (its API key), user (the body's), header:NAME, "
                                     "address (the client's IP)", type=tenant_sources,
                                     metavar="LIST")
    log_stats_interval_s: float = opt(10.0, "seconds between the one-line throughput and queue "
                                      "summaries in the log (0 = none)",
                                      flag="--log-stats-interval", type=non_negative_float)
    cache_salt_by: str = opt("none", "partition the prefix cache by tenant without the client's "
                             "help: none, user (the body's user), api-key (the Authorization "
                             "header's bearer token) or header:NAME (that header's value); a "
                             "request hits only cached prefixes of its own tenant (and of its "
                             "own cache_salt). The value is hashed, never sent or logged in "
                             "clear", type=salt_source, metavar="none|user|api-key|header:NAME")
    max_connections: int = opt(10_000, "most open HTTP connections; one past it gets 503 and is "
                               "closed at once (uvicorn)", type=positive_int)
    max_connections_per_client: int = opt(0, "most open HTTP connections from one client "
                                          "address; one past it gets 503 and is closed at once, "
                                          "so that one client cannot take them all (0 = half of "
                                          "--max-connections; behind a proxy that hides client "
                                          "addresses, set it to --max-connections) (uvicorn)",
                                          flag="--max-client-connections",
                                          type=non_negative_int)
    max_body_bytes_in_flight: int = opt(128 * 2**20, "most bytes of request bodies being "
                                        "received at once, over all connections; a body that "
                                        "would take more gets 503 with Retry-After (one larger "
                                        "than this whole budget: 413)", type=positive_int)
    max_response_logprobs: int = opt(500_000, "most token logprobs a non-streamed response may "
                                     "carry, the sum over its choices of max_tokens x (1 + top "
                                     "logprobs); a request that could carry more gets 400 (a "
                                     "stream is not capped: it is written as it is made)",
                                     type=positive_int)
    http_header_timeout_s: float = opt(10.0, "seconds a connection may take to send a request's "
                                       "head before it gets 408 and is closed (uvicorn)",
                                       flag="--http-header-timeout", type=positive_float)
    http_idle_timeout_s: float = opt(30.0, "seconds an idle keep-alive connection stays open "
                                     "(uvicorn)", flag="--http-idle-timeout", type=positive_float)
    http_body_timeout_s: float = opt(60.0, "seconds a request's body may take to arrive before "
                                     "the request gets 408", flag="--http-body-timeout",
                                     type=positive_float)
    worker_start_timeout_s: float = opt(60.0, "seconds a worker that has never answered may "
                                        "take to start before the log calls it unreachable (one "
                                        "that was up: the 3 s heartbeat deadline)",
                                        flag="--worker-start-timeout", type=positive_float)
    router: RouterConfig = opt(RouterConfig(), "router flags")


# A name other modules import; it is the field default above, not a second copy.
DRAIN_TIMEOUT_S: float = Common.drain_timeout_s
