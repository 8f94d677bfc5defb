"""Every component default lives here, once: worker, frontend and router configs as frozen
dataclasses built from CLI flags (tandem.cli)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
DEFAULT_WORKER_PORT = 7100
DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_TOKENS = 16
DRAIN_TIMEOUT_S = 10.0  # on SIGTERM, in-flight requests get this long to finish
KV_TRANSFER_TIMEOUT_S = 30.0  # one NIXL write of a request's pages, from start to all bytes in place
KV_ROOM_TIMEOUT_S = 60.0  # prefill side: how long a request waits for its decode side's pages
KV_DONE_TIMEOUT_S = 120.0  # decode side: how long a request waits for its KV (queue+prefill+write)
# Mock engine timing model (all zero = overhead runs): a prefill costs this per prompt token
# admitted in a step; a decode step costs a fixed part plus a part per running sequence.
MOCK_PREFILL_US_PER_TOKEN = 0.0
MOCK_DECODE_STEP_US = 0.0
MOCK_DECODE_US_PER_SEQ = 0.0
# Deltas messages a worker keeps in flight per frontend; past it, a request's new tokens are merged
# into its waiting delta until the frontend gives credit back (tandem.worker.outbox).
DELTA_WINDOW = 2
# Deltas per message besides first tokens (0 = no limit): with the window, it bounds what a frontend
# holds unprocessed, so its event loop passes stay short at thousands of streams.
DELTA_BATCH = 64
FRONTEND_SILENT_S = 10.0  # a frontend silent this long while owing credit: its requests are aborted
# Router admission (DESIGN §3 "Backpressure accounting"). 0 = unlimited for the per-worker limits.
ROUTER_POLICIES = ("least-loaded", "round-robin", "prefix")
DEFAULT_ROUTER_POLICY = "least-loaded"
MAX_INFLIGHT_PER_WORKER = 4096  # requests the router keeps on one worker at once
MAX_PENDING_PREFILL_TOKENS_PER_WORKER = 0  # prompt tokens sent to a worker, first delta not back
MAX_QUEUE = 4096  # requests waiting in the router for a worker; past this: 503 at once
QUEUE_TIMEOUT_S = 30.0  # a queued request still without a worker after this long: 503
RETRY_AFTER_S = 1.0  # what a 503 from the router tells the client to wait
PREFIX_CACHE_BLOCKS = 65_536  # prefix policy: block hashes remembered (LRU), per role


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: str = "agg"
    engine: str = "reference"
    model: str = ""
    host: str = DEFAULT_HOST
    port: int = DEFAULT_WORKER_PORT
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int = 0  # 0 = engine default
    max_batch: int = 64
    device: str = "cpu"
    output_mode: str = "cumulative"
    step_delay_ms: float = 0.0  # mock engine only
    name: str = ""
    bootstrap_port: int = 0  # prefill role: the port of the KV bootstrap socket
    kv_transfer_timeout_s: float = KV_TRANSFER_TIMEOUT_S
    kv_room_timeout_s: float = KV_ROOM_TIMEOUT_S
    kv_done_timeout_s: float = KV_DONE_TIMEOUT_S
    kv_bytes_per_s: float = 0.0  # mock engine only: simulated transfer rate (0 = instant)
    mock_prefill_us_per_token: float = MOCK_PREFILL_US_PER_TOKEN  # mock engine only
    mock_decode_step_us: float = MOCK_DECODE_STEP_US  # mock engine only
    mock_decode_us_per_seq: float = MOCK_DECODE_US_PER_SEQ  # mock engine only
    delta_window: int = DELTA_WINDOW
    delta_batch: int = DELTA_BATCH
    frontend_silent_s: float = FRONTEND_SILENT_S


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = DEFAULT_ROUTER_POLICY
    max_inflight_per_worker: int = MAX_INFLIGHT_PER_WORKER
    max_pending_prefill_tokens_per_worker: int = MAX_PENDING_PREFILL_TOKENS_PER_WORKER
    max_queue: int = MAX_QUEUE
    queue_timeout_s: float = QUEUE_TIMEOUT_S
    prefix_cache_blocks: int = PREFIX_CACHE_BLOCKS


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    model: str = ""
    served_model_name: str = ""
    workers: tuple[str, ...] = ()
    host: str = DEFAULT_HOST
    port: int = DEFAULT_HTTP_PORT
    stream_interval: int = 1
    http_server: str = "uvicorn"  # or "granian"; see components/tandem/frontend/server.py
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    router: RouterConfig = RouterConfig()
