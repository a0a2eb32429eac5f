"""Deadlines of the gateway's attempts (docs/dispatch.md, 5): no timer per request, one sweep
for all of them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

Renew = Callable[[float], float]  # loop time now -> the next deadline


class Deadlines:
    """Deadlines without a timer per request (as `asyncio.timeout` has): each attempt is one dict
    entry, and a sweep four times a second cancels the tasks past due."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s = period_s
        self._due: dict[asyncio.Task[object], tuple[float, Renew | None]] = {}  # and its renewal
        self._expired: set[asyncio.Task[object]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, asked once (each lookup costs a getpid() call, CPython 3.11)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def enter(self, seconds: float, renew: Renew | None = None) -> asyncio.Task[object]:
        """The current task must finish within `seconds` or be cancelled; when they pass,
        `renew(now)` may give a later deadline."""
        loop = self.loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self._due[task] = (loop.time() + seconds, renew)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep())
        return task

    def rearm(self, task: asyncio.Task[object], seconds: float) -> None:
        """A new deadline `seconds` from now, with no renewal."""
        if task in self._due:
            self._due[task] = (self.loop().time() + seconds, None)

    def expire(self, task: asyncio.Task[object]) -> None:
        """Now: the task is cancelled as if its deadline had passed."""
        if self._due.pop(task, None) is not None:
            self._expired.add(task)
            task.cancel()

    def leave(self, task: asyncio.Task[object]) -> None:
        self._due.pop(task, None)
        self._expired.discard(task)

    def expired(self, task: asyncio.Task[object]) -> bool:
        """After a CancelledError: was it the deadline (then the cancel is taken back)?"""
        if task not in self._expired:
            return False
        self._expired.discard(task)
        task.uncancel()
        return True

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while self._due:
            await asyncio.sleep(self.period_s)
            now = loop.time()
            for task, (due, renew) in list(self._due.items()):
                if due > now:
                    continue
                later = renew(now) if renew is not None else now
                if later > now:
                    self._due[task] = (later, renew)
                else:
                    self.expire(task)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
