"""The frontend's own Prometheus series (names in the style of vLLM, under `tandem_`), registered in
the process's one Registry (tandem.runtime.metrics). The response loop (tandem.frontend.respond)
records the per-request series in one place for every kind of response; the HTTP app records
requests by endpoint and status."""

from __future__ import annotations

from tandem.runtime.metrics import ITL_BUCKETS, TTFT_BUCKETS, Registry


class FrontendMetrics:
    def __init__(self, registry: Registry) -> None:
        r = self.registry = registry
        self.requests = r.counter("tandem_http_requests_total",
                                  "HTTP requests by endpoint and status.", ("endpoint", "status"))
        self.in_flight = r.gauge("tandem_requests_in_flight",
                                 "Generation requests being served now.")
        self.prompt_tokens = r.counter("tandem_prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = r.counter("tandem_generation_tokens_total",
                                           "Completion tokens received from workers.")
        self.stream_chunks = r.counter(
            "tandem_stream_chunks_total",
            "Streamed SSE chunks that carry text. generation_tokens_total over this is tokens "
            "per chunk: above 1 when stream_interval asks for it or when the frontend lags and "
            "merges the deltas that are already waiting (inter-token latency then grows).")
        self.finished = r.counter("tandem_request_success_total",
                                  "Generation requests finished, by finish reason.",
                                  ("finished_reason",))
        self.errors = r.counter("tandem_request_errors_total",
                                "Generation requests that failed, by error type.", ("type",))
        self.ttft = r.histogram("tandem_time_to_first_token_seconds",
                                "From request arrival to the first delta.", buckets=TTFT_BUCKETS)
        self.itl = r.histogram("tandem_inter_token_latency_seconds",
                               "Time between consecutive deltas of a request.",
                               buckets=ITL_BUCKETS)
        self.e2e = r.histogram("tandem_e2e_request_latency_seconds",
                               "From request arrival to the end of the response.")
