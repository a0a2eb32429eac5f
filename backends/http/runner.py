"""The bridge between an engine and the event loop: it steps the engine (inline, or on a thread
when a step blocks), so only one thread at a time touches it (docs/workers.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

from backends.http.engine import Engine, Events
from backends.http.generation import Generation, WorkerLoad

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        self._snapshot = steps.loads()

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
        return self.loads()[0]

    def loads(self) -> tuple[WorkerLoad, NamedTuple]:
        return self._snapshot if self._stepping.locked() else self.steps.loads()

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
                self._snapshot = steps.loads()
            pending, self._pending = self._pending, []
            for submit, gen in pending:
                if submit:
                    self._submit(gen, raise_=False)
                else:
                    self.abort(gen)
