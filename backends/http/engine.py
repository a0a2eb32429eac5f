"""What an engine gives the worker shell (worker.py) and its runner (runner.py): the whole
contract between our HTTP layer and an engine, stated once.

Every method runs on the event loop's thread, between steps, except `step` of a blocking
engine, which runs on a thread of its own while the loop reads only what `collect` and `info`
read (plain numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.http.generation import Generation, ServedModel, WorkerLoad
from core.kv_events import KVEvent

Events = dict[str, list[KVEvent]]  # kv_group -> a batch for its stream, in order
Samples = Iterable[tuple[str, float]]  # (label value, value) of a metric with one label


class InvalidateRequest(NamedTuple):
    """`POST /urc/invalidate` (docs/workers.md)."""

    scope: Callable[[str], bool] | None  # a test on salts; None: every block
    kv_group: str | None  # None: every group


class Engine(Protocol):
    """Requests are the engine's own records (with a `rid`); `advance` moves the generations a
    step touched, wakes them and drops the finished ones from `live`."""

    name: str  # /urc/info's "engine"
    version: str  # /get_server_info's "version"
    models: dict[str, ServedModel]  # served name -> model, the default first
    block_size: int  # tokens per KV block (page)
    blocking: bool  # a step blocks the thread it runs on (a forward pass)
    model_info: dict[str, Any]  # its fields of /get_model_info

    def request(self, gen: Generation) -> Any: ...  # ValueError (to the client): can never run
    def submit(self, req: Any) -> None: ...  # queue it; ValueError when it can never run
    def abort(self, req: Any) -> None: ...  # drop it (it is in flight)
    def due_in(self) -> float | None: ...  # seconds until a step is due; None: idle
    def step(self) -> Any: ...  # one step; its result goes to `advance`
    def advance(self, result: Any, live: dict[Any, Generation]) -> Events: ...  # its KV events
    def loads(self) -> tuple[WorkerLoad, NamedTuple]: ...  # the HTTP layer's load, the engine's
    # drop a scope of the cache: the answer, and the unpublished events (stores, then removals)
    def invalidate(self, asked: InvalidateRequest) -> tuple[dict[str, int], Events]: ...
    def info(self) -> dict[str, Any]: ...  # its own fields of /urc/info
    def settings(self) -> dict[str, Any]: ...  # its part of /get_server_info (SGLang's names)
    # its Prometheus metrics, read at scrape time (never the process-global registry)
    def collect(self) -> Iterator[Metric]: ...


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
