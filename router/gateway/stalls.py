"""What holds a gateway's event loop up, as metrics (docs/metrics.md): the cyclic garbage
collector's pauses by generation, and the loop's lag (how late a 100 ms timer fires). A lag
that the pauses do not explain is CPU the process did not get: on a busy host, the scheduler's
(issue 34's tail at concurrency 32 was that, not the collector)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from router.gateway.metrics import Hist

_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
PERIOD_S = 0.1  # the lag's timer: ten wake-ups a second, nothing per request


class Stalls(Collector):
    """`start()` hooks the collector and watches the loop; `stop()` undoes both."""

    def __init__(self) -> None:
        self.pauses = [Hist(_BUCKETS) for _ in range(3)]  # by generation
        self.lag = Hist(_BUCKETS)
        self._began = 0.0
        self._task: asyncio.Task[None] | None = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses[info["generation"]].observe(time.perf_counter() - self._began)

    async def _watch(self) -> None:
        while True:  # perf_counter: uvloop's loop.time() counts whole milliseconds
            due = time.perf_counter() + PERIOD_S
            await asyncio.sleep(PERIOD_S)
            self.lag.observe(max(0.0, time.perf_counter() - due))

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()

    def collect(self) -> Iterator[Any]:
        doc = "Pauses of the cyclic garbage collector, by generation"
        pauses = HistogramMetricFamily("urc_gc_pause_seconds", doc, labels=["generation"])
        for generation, hist in enumerate(self.pauses):
            pauses.add_metric([str(generation)], *hist.family_point())
        yield pauses
        doc = f"How late the event loop ran a {PERIOD_S} s timer (its lag)"
        lag = HistogramMetricFamily("urc_event_loop_lag_seconds", doc, labels=[])
        lag.add_metric([], *self.lag.family_point())
        yield lag
