"""Flow control's metrics (docs/metrics.md, "Flow control"): queue depth and wait per tenant and
priority, outcomes, tokens and protect hints per tenant, and each pool's saturation (1.0:
saturated; fit for an autoscaler such as KEDA). Plain numbers on the request path (FlowCounts,
router/gateway/flow.py), families at scrape time."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from router.admission import Admission, FlowSettings, Ticket, saturation
from router.gateway.fleet import Fleet
from router.gateway.metrics import Hist

if TYPE_CHECKING:
    from router.gateway.flow import FlowCounts

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
OUTCOMES = (
    "admitted_now",
    "admitted_after_wait",
    "limited",
    "shed",
    "queue_full",
    "queue_timeout",
)


class FlowMetrics(Collector):
    def __init__(
        self, admission: Admission, fleet: Fleet, settings: FlowSettings, counts: FlowCounts
    ) -> None:
        self.admission = admission
        self.fleet = fleet
        self.settings = settings
        self.counts = counts  # the request path's outcomes and tokens
        self.waits: defaultdict[tuple[str, int], Hist] = defaultdict(lambda: Hist(WAIT_BUCKETS))

    def waited(self, ticket: Ticket, seconds: float, outcome: str) -> None:
        """A queued request left the queue: let through, or timed out."""
        self.waits[ticket.tenant.name, ticket.band].observe(seconds)
        self.counts.outcome(ticket, outcome)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        doc = "Requests waiting in flow control's queues"
        depth = GaugeMetricFamily("urc_flow_queue_depth", doc, labels=["tenant", "priority"])
        depths = self.admission.queue_depths()
        for flow in list(self.admission.tenants.values()):  # an empty queue reads 0, not absent
            self.waits[flow.name, flow.priority]  # noqa: B018 (the histogram made: it reads 0 too)
        for tenant, band in list(self.waits):
            depths.setdefault((tenant, band), 0)
        for (tenant, band), count in depths.items():
            depth.add_metric([tenant, str(band)], count)
        yield depth
        doc = "Seconds requests waited in flow control's queue"
        wait = HistogramMetricFamily("urc_flow_wait_seconds", doc, labels=["tenant", "priority"])
        for (tenant, band), hist in list(self.waits.items()):
            wait.add_metric([tenant, str(band)], *hist.family_point())
        yield wait
        doc = "Requests through flow control by outcome"
        requests = CounterMetricFamily("urc_flow_requests", doc, labels=["tenant", "outcome"])
        for tenant, row in list(self.counts.outcomes.items()):
            for outcome, n in zip(OUTCOMES, row, strict=True):
                if n:  # an outcome never seen has no series
                    requests.add_metric([tenant, outcome], n)
        yield requests
        doc = "Tokens of admitted requests as the workers reported them (input, output)"
        tokens = CounterMetricFamily("urc_flow_tokens", doc, labels=["tenant", "kind"])
        for tenant, (prompt, output) in list(self.counts.tokens_used.items()):
            tokens.add_metric([tenant, "input"], prompt)
            tokens.add_metric([tenant, "output"], output)
        yield tokens
        doc = "Requests sent with the protect hint: another tenant's better rank on their worker"
        hinted = CounterMetricFamily("urc_flow_protect_hints", doc, labels=["tenant"])
        for tenant, n in list(self.counts.hinted.items()):
            hinted.add_metric([tenant], n)
        yield hinted
        doc = "The pool's least queued prefill over flow_saturation_ms (1.0: saturated)"
        gauge = GaugeMetricFamily("urc_pool_saturation", doc, labels=["kv_group"])
        s = self.settings
        groups = {g for w in self.fleet.workers.values() if w.up for g in w.models.values()}
        for group in sorted(groups):
            loads = self.fleet.loads(group)
            level = saturation(loads, s.prefill_tokens_per_s, s.saturation_ms)
            gauge.add_metric([group], level)
        yield gauge
