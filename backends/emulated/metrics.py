"""Prometheus metrics of the emulated worker, read from the engine at scrape time.

A collector on the worker's own CollectorRegistry: nothing is counted twice, and the values of
one scrape come from one moment of the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.emulated.engine import EmulatedEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    def __init__(self, engine: EmulatedEngine, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        stats = engine.cache.stats()
        load = engine.load()
        labels = ["model"]
        value = [self.model]

        def counter(name: str, doc: str, v: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(value, v)
            return family

        def gauge(name: str, doc: str, v: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(value, v)
            return family

        yield counter("urc_worker_requests", "Requests finished", engine.finished_requests)
        yield counter("urc_worker_prompt_tokens", "Prompt tokens admitted", engine.prompt_tokens)
        yield counter(
            "urc_worker_cached_tokens", "Prompt tokens found in the KV cache", engine.cached_tokens
        )
        yield counter(
            "urc_worker_generated_tokens", "Output tokens generated", engine.generated_tokens
        )
        yield counter("urc_worker_evicted_blocks", "KV blocks evicted", stats.evicted_blocks)
        yield counter("urc_worker_stored_blocks", "KV blocks cached", stats.stored_blocks)
        yield gauge("urc_worker_running_requests", "Requests in the batch", load.running)
        yield gauge("urc_worker_waiting_requests", "Requests in the queue", load.waiting)
        yield gauge(
            "urc_worker_queued_prefill_tokens",
            "Prompt tokens waiting to be prefilled",
            load.queued_prefill_tokens,
        )
        yield gauge(
            "urc_worker_cache_usage",
            "Fraction of the KV pool in use (cached or held by requests)",
            stats.capacity_tokens
            and (stats.capacity_tokens - stats.free_tokens) / stats.capacity_tokens,
        )
        yield gauge("urc_worker_cached_blocks", "KV blocks in the cache", stats.cached_blocks)


class WorkerMetrics:
    """The worker's own registry (never the process-global one)."""

    def __init__(self, engine: EmulatedEngine, model: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model))

    def render(self) -> bytes:
        return generate_latest(self.registry)
