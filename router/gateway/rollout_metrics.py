"""A rollout in /metrics (docs/metrics.md, "Gradual rollout"): read at each scrape from the
gateway's `Canary` (router/gateway/rollout.py, compiled; a Prometheus collector is a subclass of
a Python class, so it stays source)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.rollout import ARMS
from router.rollout_stats import HIT, OK, WORSE

if TYPE_CHECKING:
    from router.gateway.rollout import Canary

_STATES = ("running", "paused", "complete", "rolled_back", "aborted")


class RolloutCollector(Collector):
    """The rollout in /metrics (docs/metrics.md), read at each scrape."""

    def __init__(self, canary: Canary) -> None:
        self.canary = canary

    def collect(self) -> Iterator[Any]:
        canary = self.canary
        rollout = canary.rollout
        doc = "Requests of each rollout arm that ended served or failed"
        requests = CounterMetricFamily("urc_rollout_requests", doc, labels=["arm", "outcome"])
        for arm, (served, failed) in zip(ARMS, canary.outcomes, strict=True):
            requests.add_metric([arm, "served"], served)
            requests.add_metric([arm, "failed"], failed)
        yield requests
        doc = "Rollout events by kind (started, advanced, complete, rolled_back, ...)"
        events = CounterMetricFamily("urc_rollout_events", doc, labels=["kind"])
        for kind, count in canary.events.items():
            events.add_metric([kind], count)
        yield events
        doc = "1 for the rollout's state (none before the first)"
        state = GaugeMetricFamily("urc_rollout_state", doc, labels=["state"])
        current = rollout.state if rollout is not None else "none"
        for name in ("none", *_STATES):
            state.add_metric([name], float(name == current))
        yield state
        doc = "The candidate's share of conversations, in percent"
        share = rollout.share if rollout is not None else 0.0
        yield GaugeMetricFamily("urc_rollout_share_percent", doc, value=share)
        doc = "The rollout's guardrails at the last evaluation: 1 ok, 0 unsure, -1 worse"
        guard = GaugeMetricFamily("urc_rollout_guardrail", doc, labels=["metric"])
        for v in rollout.verdicts if rollout is not None else ():
            guard.add_metric([v.metric], 1.0 if v.state == OK else -1.0 if v.state == WORSE else 0)
        yield guard
        doc = "Each arm's hit rate (cached / prompt tokens) in the current step"
        hits = GaugeMetricFamily("urc_rollout_hit_rate", doc, labels=["arm"])
        for arm, stats in zip(ARMS, rollout.arms if rollout is not None else (), strict=False):
            rate = stats.tokens.value(HIT)
            if not math.isnan(rate):
                hits.add_metric([arm], rate)
        yield hits
