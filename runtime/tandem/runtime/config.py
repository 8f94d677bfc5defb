"""The runtime's own defaults: socket limits, heartbeats, GC. Component knobs (workers, frontend,
router, mock timing) and their flags live in tandem.config."""

from __future__ import annotations

# How long a starting frontend waits for its workers' handshakes before it serves (a worker that
# answers later is used from then on).
STARTUP_WAIT_S = 5.0
HEARTBEAT_INTERVAL_S = 0.5  # the frontend asks every worker for its load this often
HEARTBEAT_DEADLINE_S = 3.0  # no answer for this long: the worker is down, its requests fail
LOAD_QUERY_TIMEOUT_S = 1.0
# CPython's cyclic GC thresholds for frontend and workers (default 700, 10, 10): see
# lifecycle.tune_gc.
GC_THRESHOLDS = (50_000, 20, 100)
ZMQ_HWM = 100_000  # messages; deltas are batched per step so this is generous
