"""A worker's Prometheus metrics, read from its engine's `collect` at scrape time (never the
process-global registry, so nothing is counted twice)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Samples = Iterable[tuple[str, float]]  # (label value, value)


class _Collector(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


def render(collect: Callable[[], Iterable[Metric]]) -> bytes:
    """The text exposition of the families `collect` yields now."""
    return generate_latest(_Collector(collect))


def counter(name: str, doc: str, label: str, samples: Samples) -> Metric:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in samples:
        family.add_metric([key], value)
    return family


def gauge(name: str, doc: str, label: str, samples: Samples) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in samples:
        family.add_metric([key], value)
    return family
