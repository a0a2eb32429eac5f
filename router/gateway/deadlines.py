"""Request deadlines without a timer per request.

A request to a worker may take minutes (long generations), so its deadline needs no
sub-second precision: each running attempt is one dict entry, and a sweep once a second cancels
the tasks that are past due. That is a dict insert and pop on the hot path where
`asyncio.timeout` costs a timer, a context object and a task lookup every time.
"""

from __future__ import annotations

import asyncio
import contextlib


class Deadlines:
    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self._due: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, asked once: `asyncio.get_running_loop()` and a `current_task()`
        without a loop cost a getpid() system call each (CPython 3.11)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def enter(self, seconds: float) -> asyncio.Task[object]:
        """The current task must finish within `seconds` or be cancelled."""
        loop = self.loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self._due[task] = loop.time() + seconds
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep())
        return task

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
            for task, due in list(self._due.items()):
                if due <= now:
                    del self._due[task]
                    self._expired.add(task)
                    task.cancel()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
