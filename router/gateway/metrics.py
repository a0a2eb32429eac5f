"""Prometheus metrics of the gateway: the request path bumps plain numbers (no locks, no label
lookups), rendered with the index's, event streams' and workers' state at scrape time."""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from core.process_metrics import process_registry
from router.gateway.fleet import Fleet
from router.gateway.routing import RoutingModes
from router.index import UnifiedIndex

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
# a rough per-block cost of the index (bench/index_bench.py measures it)
INDEX_BYTES_PER_BLOCK = 100


class Hist:
    """A histogram: bucket counts and a sum, turned cumulative only when scraped."""

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def family_point(self) -> tuple[list[tuple[str, float]], float]:
        cumulative, total = [], 0
        for bound, count in zip((*self.buckets, math.inf), self.counts, strict=True):
            total += count
            cumulative.append(("+Inf" if bound == math.inf else repr(bound), total))
        return cumulative, self.sum


@dataclass(slots=True, eq=False)
class Series:
    ttft: Hist = field(default_factory=partial(Hist, _LATENCY_BUCKETS))
    latency: Hist = field(default_factory=partial(Hist, _LATENCY_BUCKETS))
    prompt_tokens: float = 0.0
    predicted: float = 0.0
    host_predicted: float = 0.0  # of `predicted`, in the worker's host tier
    actual: float = 0.0
    error: float = 0.0

    def prediction(
        self, prompt_tokens: int, predicted: int, cached: int | None, host: int = 0
    ) -> None:
        """One answered request: the cached tokens the index predicted (`host` of them in the
        host tier), and (when the worker reported them) those it had."""
        self.prompt_tokens += prompt_tokens
        self.predicted += predicted
        self.host_predicted += host
        if cached is not None:
            self.actual += cached
            self.error += abs(predicted - cached)


class GatewayMetrics(Collector):
    def __init__(
        self, fleet: Fleet, index: UnifiedIndex, modes: RoutingModes, policy_name: str
    ) -> None:
        self.registry = process_registry()
        self.fleet = fleet
        self.index = index
        self.modes = modes
        self.policy_name = policy_name
        self.decision = Hist(_DECISION_BUCKETS)
        # plain numbers the request path bumps without a lock (one event loop owns them)
        self.series: defaultdict[tuple[str, str], Series] = defaultdict(Series)  # (model, worker)
        self.statuses: defaultdict[tuple[str, str, int], float] = defaultdict(float)
        self.reasons: defaultdict[str, float] = defaultdict(float)
        self.failovers: defaultdict[str, float] = defaultdict(float)  # by worker
        self.rejected: defaultdict[str, float] = defaultdict(float)  # by reason, before routing
        registry = self.registry
        info = Gauge("urc_policy_info", "The live routing policy", ["policy"], registry=registry)
        info.labels(policy_name).set(1)
        self.registry.register(self)

    def collect(self) -> Iterator[Any]:
        yield from self._requests()
        yield from self._fleet()
        yield from self._modes()

    def _requests(self) -> Iterator[Any]:
        doc = "Requests by model, worker and status"
        requests = CounterMetricFamily("urc_requests", doc, labels=["model", "worker", "status"])
        for (model, worker, status), count in list(self.statuses.items()):
            requests.add_metric([model, worker, str(status)], count)
        yield requests
        per_worker = [
            ("urc_ttft_seconds", "Time to first byte from the worker", "ttft"),
            ("urc_request_latency_seconds", "End-to-end latency", "latency"),
        ]
        series = list(self.series.items())
        for name, doc, attr in per_worker:
            family = HistogramMetricFamily(name, doc, labels=["model", "worker"])
            for (model, worker), s in series:
                family.add_metric([model, worker], *getattr(s, attr).family_point())
            yield family
        predicted_doc = "Cached tokens the index predicted on the chosen worker (both tiers)"
        host_doc = "Of the predicted cached tokens, those in the worker's host tier"
        counters = [
            ("urc_prompt_tokens", "Prompt tokens routed", "prompt_tokens"),
            ("urc_predicted_cached_tokens", predicted_doc, "predicted"),
            ("urc_predicted_host_cached_tokens", host_doc, "host_predicted"),
            ("urc_actual_cached_tokens", "Cached tokens the worker reported (usage)", "actual"),
            ("urc_prediction_abs_error_tokens", "|predicted - actual| cached tokens", "error"),
        ]
        for name, doc, attr in counters:
            family = CounterMetricFamily(name, doc, labels=["worker", "model"])
            for (model, worker), s in series:
                family.add_metric([worker, model], getattr(s, attr))
            yield family
        doc = "Tokenize + keys + match + policy"
        decision = HistogramMetricFamily("urc_decision_seconds", doc, labels=[])
        decision.add_metric([], *self.decision.family_point())
        yield decision
        doc = "Routing decisions by reason"
        reasons = CounterMetricFamily("urc_route_reasons", doc, labels=["policy", "reason"])
        for reason, count in list(self.reasons.items()):
            reasons.add_metric([self.policy_name, reason], count)
        yield reasons
        doc = "Requests retried on another worker before the first byte"
        failovers = CounterMetricFamily("urc_failovers", doc, labels=["worker"])
        for worker, count in list(self.failovers.items()):
            failovers.add_metric([worker], count)
        yield failovers
        doc = "Requests refused before routing (max_concurrent_requests: over the in-flight limit)"
        rejected = CounterMetricFamily("urc_rejected_requests", doc, labels=["reason"])
        for reason, count in {"max_concurrent_requests": 0.0, **self.rejected}.items():
            rejected.add_metric([reason], count)
        yield rejected

    def _fleet(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.index.stats()
        yield GaugeMetricFamily("urc_index_blocks", "Blocks in the unified index", stats.blocks)
        yield GaugeMetricFamily("urc_index_runs", "Radix nodes (runs of blocks)", stats.runs)
        doc = "(block, worker) residencies"
        yield GaugeMetricFamily("urc_index_residencies", doc, stats.residencies)
        doc = "Residencies marked at dispatch, not yet confirmed by the worker's KV events"
        yield GaugeMetricFamily("urc_index_pending_residencies", doc, stats.pending)
        memory = stats.blocks * INDEX_BYTES_PER_BLOCK
        yield GaugeMetricFamily("urc_index_memory_bytes", "Estimated memory of the index", memory)
        doc = "Blocks dropped by the memory budget"
        yield CounterMetricFamily("urc_index_evicted_blocks", doc, stats.evicted)
        gauge = partial(GaugeMetricFamily, labels=["worker"])
        counter = partial(CounterMetricFamily, labels=["worker"])
        healthy = gauge("urc_worker_healthy", "1 if the worker is up")
        exact = gauge("urc_worker_exact", "1 if residency comes from KV events")
        in_flight = gauge("urc_worker_in_flight", "Requests in flight")
        doc = "Uncached prompt tokens routed, not yet prefilled"
        queued = gauge("urc_worker_queued_prefill_tokens", doc)
        held = gauge("urc_worker_cached_blocks", "Blocks held")
        host_held = gauge("urc_worker_host_cached_blocks", "Blocks held in its host tier")
        lag = gauge("urc_kv_event_lag_seconds", "Now minus the newest event's timestamp")
        batches = counter("urc_kv_event_batches", "Event batches applied to the index")
        gaps = counter("urc_kv_event_gaps", "Sequence gaps seen")
        resets = counter("urc_kv_event_resyncs", "Resyncs (gaps not replayable, restarts)")
        replays = counter("urc_kv_event_replays", "Replays asked of the worker")
        failed = counter("urc_kv_event_replay_failures", "Replays that could not close a gap")
        now = time.time()
        for w in self.fleet.workers.values():
            name = [w.name]
            healthy.add_metric(name, float(w.up))
            exact.add_metric(name, float(w.mode == "exact"))
            in_flight.add_metric(name, w.load.in_flight)
            queued.add_metric(name, w.load.queued_prefill_tokens)
            held.add_metric(name, w.blocks_held(self.index))
            host_held.add_metric(name, w.blocks_held(self.index, host=True))
            mirrors = [s.mirror.stats() for s in w.streams if s.mirror is not None]
            if mirrors:
                newest = max((m.last_event_ts or 0.0) for m in mirrors)
                if newest:
                    lag.add_metric(name, max(0.0, now - newest))
                batches.add_metric(name, sum(m.applied_batches for m in mirrors))
                gaps.add_metric(name, sum(m.gaps for m in mirrors))
                resets.add_metric(name, sum(m.resets + m.restarts for m in mirrors))
            subscribers = [s.subscriber for s in w.streams if s.subscriber is not None]
            if subscribers:
                replays.add_metric(name, sum(s.replays for s in subscribers))
                failed.add_metric(name, sum(s.replay_failures for s in subscribers))
        yield from (healthy, exact, in_flight, queued, held, host_held, lag, batches, gaps, resets)
        yield from (replays, failed)

    def _modes(self) -> Iterator[Any]:
        modes = self.modes
        doc = "1 while routing falls back to least load"
        yield GaugeMetricFamily("urc_routing_degraded", doc, float(modes.degraded))
        doc = "The policy routing now"
        active = GaugeMetricFamily("urc_routing_policy", doc, labels=["policy"])
        active.add_metric([modes.active().name], 1.0)
        yield active
        hit_doc = "Cached tokens its choices would have found"
        ttft_doc = "Sum of the TTFT predicted at its choices"
        disagreed_doc = "Requests where it chose another worker than the live policy"
        fields = [
            ("urc_shadow_requests", "Requests a shadow policy saw", "requests"),
            ("urc_shadow_prompt_tokens", "Prompt tokens a shadow policy saw", "prompt_tokens"),
            ("urc_shadow_predicted_hit_tokens", hit_doc, "predicted_hit_tokens"),
            ("urc_shadow_predicted_ttft_seconds", ttft_doc, "predicted_ttft_s"),
            ("urc_shadow_disagreements", disagreed_doc, "disagreements"),
        ]
        for name, doc, attr in fields:
            family = CounterMetricFamily(name, doc, labels=["policy"])
            for policy, stats in modes.shadow.stats.items():
                family.add_metric([policy], float(getattr(stats, attr)))
            yield family
