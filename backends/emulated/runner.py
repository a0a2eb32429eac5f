"""The real-time shell of the emulated engine: an asyncio task steps it on the loop's clock,
behind the HTTP layer's Backend contract (backends/http/generation.py).

The loop sleeps until the end of the step in flight (`next_step_time`), so tokens come out one
step at a time as they would from a GPU; a submission or an abort wakes it early, so a new
request joins at the next step boundary. After each step the generations it moved are updated
(output, cached tokens, finish) and woken; the KV events of every step go to `publish`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request, output_bytes
from backends.http.generation import Generation, WorkerLoad
from core.kv_events import KVEvent

log = logging.getLogger(__name__)


class EngineRunner:
    """Drives `engine` in real time on the running event loop: `start()`, then `submit`."""

    def __init__(
        self,
        engine: EmulatedEngine,
        publish: Callable[[list[KVEvent]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.publish = publish
        self._live: dict[int, Generation] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._clock = asyncio.get_running_loop().time

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drive(), name="emulated-engine")

    async def stop(self) -> None:
        """Abort what is in flight and stop stepping."""
        for gen in list(self._live.values()):
            self.abort(gen)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- Backend -------------------------------------------------------------------------------

    def submit(self, gen: Generation) -> None:
        """Queue a generation now (sampling is ignored: the output is the engine's filler).
        ValueError when the engine could never run it."""
        rid = next(self._ids)
        req = Request(
            rid, gen.prompt, gen.sampling.max_tokens, gen.cache_salt, arrival=self._clock()
        )
        req.public_blocks = gen.public_tokens // self.engine.config.block_size
        self.engine.submit(req)
        gen.handle = req
        self._live[rid] = gen
        self._wake.set()

    def abort(self, gen: Generation) -> None:
        """Drop a generation (its client went away); a finished one is left alone."""
        req: Request | None = gen.handle
        if req is not None and self._live.pop(req.rid, None) is not None and not gen.done:
            self.engine.abort(req, self._clock())
            gen.aborted = True
            gen.changed.set()
            self._wake.set()

    def load(self) -> WorkerLoad:
        load = self.engine.load()
        stats = self.engine.cache.stats()
        used = stats.capacity_tokens - stats.free_tokens
        return WorkerLoad(load.running, load.waiting, used, stats.capacity_tokens)

    # -- stepping ------------------------------------------------------------------------------

    def _catch_up(self, gen: Generation, n: int) -> None:
        have = len(gen.output)
        if n > have:
            gen.output.extend(output_bytes(have, n))

    async def _drive(self) -> None:
        engine = self.engine
        live = self._live
        while True:
            try:
                result = engine.step(self._clock())
            except Exception:  # a bug: keep serving what can be served, and say so
                log.exception("emulated engine step failed")
                await asyncio.sleep(0.1)
                continue
            if result.events and self.publish is not None:
                try:
                    self.publish(result.events)
                except Exception:
                    log.exception("publishing KV events failed")
            for req in result.admitted:
                if (gen := live.get(req.rid)) is not None:
                    gen.cached_tokens = req.cached_tokens
                    gen.admitted = True
                    gen.changed.set()
            for rid in result.emitted:
                if (gen := live.get(rid)) is not None:
                    self._catch_up(gen, engine.generated(gen.handle))
                    gen.changed.set()
            for req in result.finished:
                if (gen := live.pop(req.rid, None)) is not None:
                    self._catch_up(gen, req.generated)
                    # a limit the client set is hit ("length"); without one the answer just
                    # ends ("stop"), as a model's would
                    natural = gen.chat and not gen.sampling.limit_set
                    gen.finish_reason = "stop" if natural else "length"
                    gen.changed.set()
            wake_at = engine.next_step_time()
            timeout = None if wake_at is None else max(0.0, wake_at - self._clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
