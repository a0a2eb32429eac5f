"""Prometheus metrics of the torch worker, read from the engine at scrape time.

Per served model: requests, generated tokens, and the prefix cache's queries and hits counted
in prompt tokens (hit rate = hits / queries). Per page pool: total, free, cached and in-use
pages; per kv_group: the pages its tree holds (its share of the shared pool). The engine thread
writes these numbers; a scrape reads plain ints, so one scrape may straddle a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.engine.engine import EngineLoad, TorchEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    """`load` gives a snapshot of the engine's queues (they belong to the engine's thread)."""

    def __init__(self, engine: TorchEngine, load: Callable[[], EngineLoad]) -> None:
        self.engine = engine
        self.load = load

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        per_model = (
            ("urc_worker_requests", "Requests finished", "requests"),
            ("urc_worker_generated_tokens", "Output tokens generated", "generated_tokens"),
            (
                "urc_worker_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (at admission)",
                "prompt_tokens",
            ),
            (
                "urc_worker_prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                "cached_tokens",
            ),
        )
        for name, doc, attr in per_model:
            family = CounterMetricFamily(name, doc, labels=["model"])
            for model, counters in engine.counters.items():
                family.add_metric([model], getattr(counters, attr))
            yield family

        load = self.load()
        yield GaugeMetricFamily("urc_worker_running_requests", "Requests in a batch", load.running)
        yield GaugeMetricFamily("urc_worker_waiting_requests", "Requests queued", load.waiting)

        pools = list(engine.pools.values())
        gauges = {
            "urc_worker_pool_pages": ("KV pages in the pool (page 0 excluded)", []),
            "urc_worker_pool_free_pages": ("KV pages free", []),
            "urc_worker_pool_cached_pages": ("KV pages in the radix cache", []),
            "urc_worker_pool_in_use_pages": ("KV pages held privately by requests", []),
        }
        for i, state in enumerate(pools):
            stats = state.cache.stats()
            cached = stats.evictable_tokens + stats.protected_tokens
            tokens = (stats.capacity_tokens, stats.free_tokens, cached, stats.allocated_tokens)
            values = [t // state.cache.block_size for t in tokens]
            for (_, samples), value in zip(gauges.values(), values, strict=True):
                samples.append((str(i), value))
        for name, (doc, samples) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool, value in samples:
                family.add_metric([pool], value)
            yield family
        shares = GaugeMetricFamily(
            "urc_worker_kv_group_cached_pages", "Pages in a kv_group's tree", labels=["kv_group"]
        )
        for state in pools:
            for group, tree in state.cache.trees.items():  # keys fixed at start
                shares.add_metric([group], tree.blocks)
        yield shares
        evicted = CounterMetricFamily("urc_worker_evicted_pages", "Pages evicted", labels=["pool"])
        for i, state in enumerate(pools):
            evicted.add_metric([str(i)], state.cache.evicted_blocks)
        yield evicted


class WorkerMetrics:
    """The worker's own registry (never the process-global one)."""

    def __init__(self, engine: TorchEngine, load: Callable[[], EngineLoad]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, load))

    def render(self) -> bytes:
        return generate_latest(self.registry)
