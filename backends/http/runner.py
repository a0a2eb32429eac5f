"""What an engine gives the worker shell, the whole contract between our HTTP layer and an
engine stated once (`Engine`), and the runner, the bridge between an engine and the event loop:
it steps the engine (inline, or on a thread when a step blocks), so only one thread at a time
touches it. Every engine method runs on the loop's thread, between steps, except `step` of a
blocking engine, while the loop reads only what `collect` and `info` read (docs/workers.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.http.generation import Generation, ServedModel, WorkerLoad
from core.kv_events import KVEvent

log = logging.getLogger(__name__)

T = TypeVar("T")
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
    def load(self) -> WorkerLoad: ...  # its load as the HTTP layer reports it
    # drop a scope of the cache: the answer, and the unpublished events (stores, then removals)
    def invalidate(self, asked: InvalidateRequest) -> tuple[dict[str, int], Events]: ...
    # unit-norm embeddings of token-id prompts of `model`, one step's worth of work at most
    def embed(self, model: ServedModel, prompts: list[list[int]]) -> list[list[float]]: ...
    # LoRA adapters (docs/workers.md, "LoRA adapters"), called between steps: register one of
    # the default model (ValueError: the name is taken, the files are unreadable) and serve it
    # under `models`; forget one (KeyError: no such adapter), with its cache's removals
    def load_adapter(self, name: str, path: str) -> ServedModel: ...
    def unload_adapter(self, name: str) -> Events: ...
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


class EngineRunner:
    """`start()` on the loop, then hand it generations (`submit`, `abort`); `await stop()` at the
    end."""

    def __init__(self, steps: Engine, publish: Callable[[Events], None]) -> None:
        self.steps = steps
        self.publish = publish
        self.name = f"{steps.name}-engine"
        self._live: dict[Any, Generation] = {}
        self._pending: list[tuple[bool, Generation]] = []  # (submit?, gen) during a step
        self._stepping = asyncio.Lock()  # held while a step runs
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._thread = (
            ThreadPoolExecutor(1, thread_name_prefix=self.name) if steps.blocking else None
        )
        self._snapshot = steps.load()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drive(), name=self.name)

    async def stop(self) -> None:
        """Abort what is in flight and stop stepping (after the step that runs, if any)."""
        if self._task is not None:
            self._stopping = True
            self._wake.set()
            await self._task
            self._task = None
        for gen in list(self._live.values()):
            self.abort(gen)
        if self._thread is not None:
            self._thread.shutdown()

    async def call(self, fn: Callable[[], T]) -> T:
        """`fn()` between steps (operator calls: invalidation)."""
        async with self._stepping:
            return fn()

    async def embed(self, model: ServedModel, prompts: list[list[int]]) -> list[list[float]]:
        """The engine's embeddings of `prompts`, between steps (on the step thread when a step
        blocks: it is a forward pass); submissions made meanwhile reach the engine after."""
        try:
            async with self._stepping:
                if self._thread is None:
                    return self.steps.embed(model, prompts)
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._thread, self.steps.embed, model, prompts)
        finally:
            self._flush()

    # -- the handlers' side ------------------------------------------------------------------------

    def submit(self, gen: Generation) -> None:
        """ValueError when the engine could never run it."""
        gen.handle = self.steps.request(gen)
        if self._stepping.locked():
            self._pending.append((True, gen))
        else:
            self._submit(gen, raise_=True)
        self._wake.set()

    def abort(self, gen: Generation) -> None:
        if gen.done or gen.handle is None:
            return
        if self._stepping.locked():
            self._pending.append((False, gen))
        elif self._live.pop(gen.handle.rid, None) is not None:
            self.steps.abort(gen.handle)
            gen.aborted = True
            gen.changed.set()
        self._wake.set()

    def load(self) -> WorkerLoad:
        return self._snapshot if self._stepping.locked() else self.steps.load()

    def in_flight(self, model: str) -> bool:
        """Whether a generation for `model` is queued or running (or about to reach the
        engine); between steps, in a `call`, nothing else can submit one meanwhile."""
        gens = [*self._live.values(), *(gen for _, gen in self._pending)]
        return any(gen.model.name == model for gen in gens)

    # -- stepping ------------------------------------------------------------------------------

    def _submit(self, gen: Generation, raise_: bool) -> None:
        try:
            self.steps.submit(gen.handle)
        except ValueError:
            if raise_:
                raise
            gen.aborted = True
            gen.changed.set()
            return
        self._live[gen.handle.rid] = gen

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        steps = self.steps
        while not self._stopping:
            due = steps.due_in()
            if due is None or due > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), due)
                if self._stopping:
                    break
            async with self._stepping:
                try:
                    if self._thread is None:
                        result = steps.step()
                    else:
                        result = await loop.run_in_executor(self._thread, steps.step)
                    self.publish(steps.advance(result, self._live))
                except Exception:  # a bug: fail what is in flight, keep serving new requests
                    log.exception("%s step failed", self.name)
                    self._pending += [(False, gen) for gen in self._live.values()]
                self._snapshot = steps.load()
            self._flush()

    def _flush(self) -> None:
        """What handlers asked while the engine was busy, in order."""
        pending, self._pending = self._pending, []
        for submit, gen in pending:
            if submit:
                self._submit(gen, raise_=False)
            else:
                self.abort(gen)
