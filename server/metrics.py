"""Prometheus collectors on a private registry (one per app, so tests and several apps in one
process never collide with the global default registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "gguf_prefill_"

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0)
_STEP_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.03,
                 0.05, 0.1, 0.25, 1.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_TPS_BUCKETS = (10, 30, 100, 300, 1000, 3000, 10000, 30000, 100000, 300000, 1000000)


class Metrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = PREFIX
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.prefill_seconds = Counter(p + "prefill_seconds", "Seconds spent in prefill",
                                       registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated (decoded)",
                                        registry=r)
        self.prompt_tokens_per_second = Gauge(
            p + "prompt_tokens_per_second", "Prefill throughput of the latest request",
            registry=r)
        self.prompt_throughput = Histogram(
            p + "prompt_throughput_tokens_per_second", "Prefill throughput per request",
            buckets=_TPS_BUCKETS, registry=r)
        self.prefill_duration = Histogram(
            p + "prefill_duration_seconds", "Prefill wall time per request",
            buckets=_SECONDS_BUCKETS, registry=r)
        self.time_to_first_token = Histogram(
            p + "time_to_first_token_seconds",
            "From request accepted to first generated token (includes queue wait)",
            buckets=_SECONDS_BUCKETS, registry=r)
        self.requests = Counter(
            p + "requests",
            "HTTP requests by route and what the client got: the status when the response was "
            "sent in full, 499 when the client left before it was complete, the error code for "
            "a stream that ended with an error event, 500 for a crash",
            ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a KV slot",
                                 registry=r)
        self.requests_processing = Gauge(p + "requests_processing",
                                         "Requests the engine is running now (in KV slots)",
                                         registry=r)
        self.kv_cache_usage = Gauge(p + "kv_cache_usage_ratio",
                                    "Share of the KV cache's positions held by running sequences",
                                    registry=r)
        self.batch_tokens = Histogram(p + "batch_tokens", "Tokens per engine step",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.batch_sequences = Histogram(p + "batch_sequences", "Sequences per engine step",
                                         buckets=_TOKEN_BUCKETS, registry=r)
        self.step_seconds = Histogram(
            p + "step_seconds",
            "Engine steps: part=wall (plan, forward, delivery), device (the forward's kernels), "
            "interval (between the ends of consecutive busy steps: the worker loop's period)",
            ["part"], buckets=_STEP_BUCKETS, registry=r)
        self.prefix_cache_hits = Counter(p + "prefix_cache_hits",
                                         "Requests that reused cached prompt tokens", registry=r)
        self.prefix_cache_tokens = Counter(p + "prefix_cache_tokens",
                                           "Prompt tokens reused from the prefix cache", registry=r)
        self._prefix_seen = (0, 0)
        self.cancelled = Counter(p + "requests_cancelled", "Jobs cancelled (client gone, shutdown)",
                                 registry=r)
        self.model_loaded = Gauge(p + "model_loaded", "1 once the model is ready", registry=r)

    def observe_prefill(self, n_tokens: int, seconds: float) -> None:
        self.prompt_tokens.inc(n_tokens)
        self.prefill_seconds.inc(seconds)
        self.prefill_duration.observe(seconds)
        if seconds > 0:
            tps = n_tokens / seconds
            self.prompt_tokens_per_second.set(tps)
            self.prompt_throughput.observe(tps)

    def set_prefix(self, hits: int, tokens: int) -> None:
        """Advance the prefix-cache counters to the scheduler's running totals."""
        h0, t0 = self._prefix_seen
        if hits > h0:
            self.prefix_cache_hits.inc(hits - h0)
        if tokens > t0:
            self.prefix_cache_tokens.inc(tokens - t0)
        self._prefix_seen = (max(h0, hits), max(t0, tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)
