"""A worker's load, pushed (docs/workers.md, "Load"): the document of `GET /urc/load` on a ZMQ
PUB socket whenever it changed, checked every `interval_s`, and at least once a second as a
heartbeat. Any number of gateway replicas subscribe at the cost of one encode per change; a
poll per replica would cost the worker a request each."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

HEARTBEAT_S = 1.0  # an unchanged load is sent again after this: silence means a lost feed


class LoadPublisher:
    """`document()` -> the load; `endpoint` is the address bound."""

    def __init__(
        self, document: Callable[[], dict[str, Any]], endpoint: str, interval_s: float
    ) -> None:
        self.document = document
        self.interval_s = interval_s
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 16)  # a slow subscriber misses loads, never blocks
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._encode = msgspec.json.Encoder().encode
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        last: tuple[Any, ...] = ()
        sent_at = 0.0
        while True:
            doc = self.document()
            state = tuple(v for k, v in doc.items() if k != "time")
            now = time.monotonic()
            if state != last or now - sent_at >= HEARTBEAT_S:
                with contextlib.suppress(zmq.Again):
                    self._pub.send(self._encode(doc), zmq.NOBLOCK)
                last, sent_at = state, now
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
