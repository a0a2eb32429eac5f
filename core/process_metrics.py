"""The Prometheus registry every urc process exports (the gateway, the epp, our workers): the
process, platform and GC collectors on it, and no `_created` series (docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)


def process_registry() -> CollectorRegistry:
    """A fresh registry with `process_*` and `python_*`; never the process-global one."""
    # process-wide: a Counter or Histogram made anywhere in the process exports no `_created`
    disable_created_metrics()
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
