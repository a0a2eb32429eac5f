"""The real-time shell of the emulated engine: an asyncio task steps it on the loop's clock.

The loop sleeps until the end of the step in flight (`next_step_time`), so tokens come out one
step at a time as they would from a GPU; a submission or an abort wakes it early, so a new
request joins at the next step boundary. Each HTTP handler holds a `Generation` and waits on
its `changed` event; the KV events of every step go to `publish` (the ZMQ publisher).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from backends.emulated.engine import EmulatedEngine, Request, State
from router.kv_events import KVEvent

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Generation:
    """One request in flight as its handler sees it; `changed` is set whenever it moved."""

    req: Request
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def admitted(self) -> bool:
        return self.req.state is not State.WAITING

    @property
    def done(self) -> bool:
        return self.req.state is State.FINISHED or self.req.state is State.ABORTED


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

    def submit(self, prompt: list[int], max_tokens: int, cache_salt: str | None) -> Generation:
        """Queue a generation now. ValueError when the engine could never run it."""
        rid = next(self._ids)
        req = Request(rid, prompt, max_tokens, cache_salt, arrival=self._clock())
        self.engine.submit(req)
        gen = Generation(req)
        self._live[rid] = gen
        self._wake.set()
        return gen

    def abort(self, gen: Generation) -> None:
        """Drop a generation (its client went away); a finished one is left alone."""
        if self._live.pop(gen.req.rid, None) is not None and not gen.done:
            self.engine.abort(gen.req, self._clock())
            gen.changed.set()
            self._wake.set()

    def tokens(self, gen: Generation) -> int:
        """Tokens the generation has produced so far."""
        return self.engine.generated(gen.req)

    async def admitted(self, gen: Generation) -> None:
        """Until the generation leaves the queue (its cached_tokens are known) or ends."""
        while not gen.admitted:
            gen.changed.clear()
            await gen.changed.wait()

    async def progress(self, gen: Generation) -> AsyncIterator[int]:
        """Its token count each time it grows; ends when the generation does."""
        sent = 0
        while True:
            n = self.tokens(gen)
            if n > sent:
                sent = n
                yield n
            if gen.done:
                return
            gen.changed.clear()
            await gen.changed.wait()

    async def finished(self, gen: Generation) -> None:
        while not gen.done:
            gen.changed.clear()
            await gen.changed.wait()

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
                    gen.changed.set()
            for rid in result.emitted:
                if (gen := live.get(rid)) is not None:
                    gen.changed.set()
            for req in result.finished:
                if (gen := live.pop(req.rid, None)) is not None:
                    gen.changed.set()
            wake_at = engine.next_step_time()
            timeout = None if wake_at is None else max(0.0, wake_at - self._clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
