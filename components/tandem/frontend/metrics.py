"""The frontend's own Prometheus series, registered in the process's one Registry
(tandem.runtime.metrics, exposed through prometheus_client). Names follow vLLM's (`num_requests_*`,
`time_to_first_token_seconds`, `inter_token_latency_seconds`, `e2e_request_latency_seconds`,
`request_{queue,prefill,decode}_time_seconds`, `prompt_tokens_total`, `generation_tokens_total`,
`kv_cache_usage_perc`, `request_success_total`) under `tandem_`, each with a `model_name` label.

The response loop (tandem.frontend.respond) records the per-request series in one place for every
kind of response; the HTTP app records requests by endpoint and status. Every labelled child the
hot path touches is looked up once, here. Inter-token latency is per token: a delta carrying k
tokens counts k gaps of (time since the previous delta) / k.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.runtime.metrics import ITL_BUCKETS, TTFT_BUCKETS, Registry, Samples


class FrontendMetrics:
    def __init__(self, registry: Registry, model_name: str = "") -> None:
        r = self.registry = registry
        m = (model_name,)
        self.model_name = model_name
        self.requests = r.counter("tandem_http_requests_total",
                                  "HTTP requests by endpoint and status.", ("endpoint", "status"))
        self.prompt_tokens = r.counter("tandem_prompt_tokens_total", "Prompt tokens processed.",
                                       ("model_name",)).labels(*m)
        self.generation_tokens = r.counter("tandem_generation_tokens_total",
                                           "Completion tokens received from workers.",
                                           ("model_name",)).labels(*m)
        self.stream_chunks = r.counter(
            "tandem_stream_chunks_total",
            "Streamed SSE chunks that carry text. generation_tokens_total over this is tokens "
            "per chunk: above 1 when stream_interval asks for it or when the frontend lags and "
            "merges the deltas that are already waiting (inter-token latency then grows).",
            ("model_name",)).labels(*m)
        self._finished = r.counter("tandem_request_success_total",
                                   "Generation requests finished, by finish reason.",
                                   ("model_name", "finished_reason"))
        self._errors = r.counter("tandem_request_errors_total",
                                 "Generation requests that failed, by error type.",
                                 ("model_name", "type"))
        self.kv_transfer_failures = r.counter(
            "tandem_kv_transfer_failures_total",
            "Requests failed by their KV handoff (prefill to decode).", ("model_name",)).labels(*m)
        self.ttft = r.histogram("tandem_time_to_first_token_seconds",
                                "From request arrival to the first token.", ("model_name",),
                                buckets=TTFT_BUCKETS).labels(*m)
        self.itl = r.histogram("tandem_inter_token_latency_seconds",
                               "Time between consecutive output tokens of a request (per token).",
                               ("model_name",), buckets=ITL_BUCKETS).labels(*m)
        self.e2e = r.histogram("tandem_e2e_request_latency_seconds",
                               "From request arrival to the end of the response.",
                               ("model_name",)).labels(*m)
        self.queue_time = r.histogram("tandem_request_queue_time_seconds",
                                      "From request arrival to its placement on the worker(s).",
                                      ("model_name",), buckets=TTFT_BUCKETS).labels(*m)
        self.prefill_time = r.histogram("tandem_request_prefill_time_seconds",
                                        "From placement to the first token (prefill, and the KV "
                                        "handoff when disaggregated).", ("model_name",),
                                        buckets=TTFT_BUCKETS).labels(*m)
        self.decode_time = r.histogram("tandem_request_decode_time_seconds",
                                       "From the first token to the last.",
                                       ("model_name",)).labels(*m)

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def error(self, type_: str) -> None:
        self._errors.labels(self.model_name, type_).inc()

    def load_gauges(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """`tandem_num_requests_running` and `_waiting`, read at scrape time."""
        m = (self.model_name,)
        self.registry.callback("tandem_num_requests_running",
                               "Generation requests placed on workers and not finished.",
                               lambda: [(m, running())], ("model_name",))
        self.registry.callback("tandem_num_requests_waiting",
                               "Generation requests waiting in the router for a worker.",
                               lambda: [(m, waiting())], ("model_name",))

    def kv_usage(self, samples: Callable[[], Samples]) -> None:
        """`tandem_kv_cache_usage_perc{worker}`: `samples()` yields ((worker,), fraction)."""
        m = self.model_name
        self.registry.callback("tandem_kv_cache_usage_perc",
                               "Fraction of the worker's KV pages in use (its last load "
                               "report; 1 = full).",
                               lambda: [((m, *w), v) for w, v in samples()],
                               ("model_name", "worker"))
