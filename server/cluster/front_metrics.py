"""The front's /metrics: its routing decisions plus every replica's own metrics, each sample
labelled with `replica`, as one valid Prometheus exposition (one family per name).

    gguf_prefill_router_requests_total{replica, reason}  requests routed; reason="prefix" (sent
                                                          where its prompt prefix is cached) or
                                                          "least_loaded"
    gguf_prefill_router_inflight{replica}                 requests routed and not finished
    gguf_prefill_router_cached_blocks{replica}            prompt blocks the router believes the
                                                          replica holds
    gguf_prefill_replicas                                 live replicas (the router's view)
    gguf_prefill_replica_failures_total                   requests ended with a 503 because their
                                                          replica died or could not be reached
    gguf_prefill_*{replica}                               each replica's server metrics
                                                          (server/metrics.py), e.g. queue_depth
"""

from __future__ import annotations

from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "gguf_prefill_"


def merge_replica_metrics(texts: Mapping[str, str]) -> list[Metric]:
    """{replica id: exposition text} -> families with a `replica` label on every sample."""
    families: dict[str, Metric] = {}
    for rid in sorted(texts):
        try:
            parsed = list(text_string_to_metric_families(texts[rid]))
        except ValueError:
            continue  # a replica that answered garbage is left out, not the whole page
        for fam in parsed:
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "replica": rid}, s.value, s.timestamp,
                               s.exemplar)
    return list(families.values())


def _per_replica(name: str, documentation: str, values: Mapping[str, int]) -> Metric:
    """A gauge family with one sample per replica."""
    g = GaugeMetricFamily(PREFIX + name, documentation, labels=["replica"])
    for rid, v in sorted(values.items()):
        g.add_metric([rid], v)
    return g


class FrontMetrics:
    """The front's registry: the routing view (read from the router at scrape time), its own
    failure counter, and the replicas' families of the latest scrape."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.replica_failures = Counter(
            PREFIX + "replica_failures",
            "Requests ended with a 503 because their replica died or could not be reached",
            registry=self.registry)
        self._routing: tuple[dict, dict, dict, int] = ({}, {}, {}, 0)
        self._replica_families: list[Metric] = []
        self.registry.register(self)

    def update(self, routed: Mapping[tuple[str, str], int], inflight: Mapping[str, int],
               cached: Mapping[str, int], replica_texts: Mapping[str, str]) -> None:
        self._routing = (dict(routed), dict(inflight), dict(cached), len(inflight))
        self._replica_families = merge_replica_metrics(replica_texts)

    def collect(self) -> Iterable[Metric]:  # prometheus_client collector protocol
        routed, inflight, cached, n = self._routing
        c = CounterMetricFamily(PREFIX + "router_requests",
                                "Requests routed to each replica, by reason: prefix (its prompt "
                                "prefix is cached there) or least_loaded",
                                labels=["replica", "reason"])
        for (rid, reason), v in sorted(routed.items()):
            c.add_metric([rid, reason], v)
        yield c
        yield _per_replica("router_inflight", "Requests routed to each replica and not finished",
                           inflight)
        yield _per_replica("router_cached_blocks",
                           "Prompt blocks the router believes each replica holds", cached)
        yield GaugeMetricFamily(PREFIX + "replicas", "Live engine replicas (the router's view)",
                                value=n)
        yield from self._replica_families

    def render(self) -> bytes:
        return generate_latest(self.registry)
