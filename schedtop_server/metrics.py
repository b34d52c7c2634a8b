"""Prometheus metrics under vLLM's names, types, labels and buckets, so that a Grafana
dashboard built for vLLM works against `schedtop serve` unchanged.

Every metric carries vLLM's labels `model_name` and `engine` ("0": one engine). Each server
has its own registry: two servers in one process (tests) do not share counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from engine.records import FINISH_REASONS

if TYPE_CHECKING:
    from engine.metrics import StepObservations
    from engine.stats import EngineStats

# vLLM does the same: no `*_created` series beside every counter and histogram.
disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that histogram_quantile() reads the same.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
LABELS = ("model_name", "engine")


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's request-size buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(float(m * scale))
        scale *= 10


class ServeMetrics:
    """The server's metrics; the engine thread updates them, /metrics reads them."""

    def __init__(self, model_name: str, max_model_len: int, prefix_caching: bool) -> None:
        self.registry = CollectorRegistry()
        self.prefix_caching = prefix_caching
        labels = (model_name, "0")
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=r, buckets=buckets).labels(*labels)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=r,
        )
        self.success = {
            reason: success.labels(*labels, reason) for reason in FINISH_REASONS.values()
        }
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Time per output token per request in seconds.",
            ITL_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        sizes = token_buckets(max_model_len)
        self.request_prompt = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", sizes
        )
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", sizes
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Number of tokens per engine step.",
            (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
        )
        # schedtop's own: what vLLM has no name for.
        self.unauthenticated = counter(
            "schedtop:unauthenticated_requests",
            "Requests refused for a missing or wrong API key (counted, not recorded one by one).",
        )
        self.recording = gauge(
            "schedtop:recording",
            "1 while the flight recorder records; 0 once it has stopped (/health says why).",
        )
        self.rotation_failures = gauge(
            "schedtop:recording_rotation_failures",
            "Failed segment creations so far (each retried); rotation holds the disk bound.",
        )
        self.draining = gauge(
            "schedtop:draining", "1 once a shutdown has begun: new requests get a 503."
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_recording(self, recording: bool, rotation_failures: int) -> None:
        """The flight recorder's state (read when /metrics is scraped)."""
        self.recording.set(1 if recording else 0)
        self.rotation_failures.set(rotation_failures)

    # -- from the engine thread ------------------------------------------------------------

    def observe_state(self, state: EngineStats) -> None:
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        self.kv_usage.set(state.kv_usage)

    def observe_step(self, obs: StepObservations, state: EngineStats, num_tokens: int) -> None:
        """After a step: what it added to the run's fold (engine.metrics.LiveMetrics, the
        one definition of every latency, as `stats` reads it from the trace), the
        engine's load after it and the tokens it scheduled."""
        self.observe_state(state)
        self.preemptions.inc(obs.preemptions)
        self.iteration_tokens.observe(num_tokens)
        if self.prefix_caching:
            self.prefix_queries.inc(obs.prefix_query_tokens)
            self.prefix_hits.inc(obs.prefix_hit_tokens)
        self.prompt_tokens.inc(obs.prompt_tokens)  # vLLM counts a prompt at its first token
        self.generation_tokens.inc(obs.generation_tokens)
        for x in obs.ttft:
            self.ttft.observe(x)
        for x in obs.itl:
            self.itl.observe(x)
        for life, t in obs.finished:
            if not life.finished_ok:  # an error: vLLM observes no latency for it
                continue
            for hist, value in (
                (self.e2e, t.e2e),
                (self.queue, t.queue),
                (self.tpot, t.tpot),
                (self.prefill, t.prefill),
                (self.decode, t.decode),
            ):
                if value is not None:
                    hist.observe(value)
            if t.prefill is not None and t.decode is not None:
                self.inference.observe(t.prefill + t.decode)
            self.request_prompt.observe(life.num_prompt_tokens)
            self.request_generation.observe(life.num_samples)

    def observe_finish(self, reason: str) -> None:
        """A response ended, for the reason the server gave its client (a stop string is
        "stop" though the engine aborted the request)."""
        self.success[reason if reason in self.success else "error"].inc()
