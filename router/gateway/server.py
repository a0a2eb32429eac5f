"""The gateway's front door (README.md, "Limits, timeouts and failure handling"): the inference
endpoints (connection.py HOT_PATHS) are parsed by httptools and answered straight on the
transport, any other request is handed with its connection to aiohttp; every head is read here
under the limits."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from router.gateway.config import GatewayConfig
from router.gateway.connection import FrontProtocol
from router.gateway.reply import LeanReply

# (reply, path, lowercased request headers, body) -> the reply has been written
Serve = Callable[[LeanReply, str, dict[str, str], bytes], Awaitable[None]]
_TRIM_AFTER_BYTES = 8 * 2**20  # request bodies dropped between two returns of free memory


class FrontServer:
    """The listening socket, its connections, and where to send what is not ours."""

    def __init__(
        self, serve: Serve, fallback: Callable[[], asyncio.Protocol], limits: GatewayConfig
    ) -> None:
        self.serve = serve
        self.fallback = fallback
        self.limits = limits
        self.connections: set[FrontProtocol] = set()
        self.server: asyncio.Server | None = None
        self.draining = False  # every answer says `Connection: close` (SIGTERM, app.py)
        self.released_bytes = 0  # request bodies dropped since memory was last given back
        self._trim = _malloc_trim()
        self._reaper: asyncio.Task[None] | None = None
        # asked once: asyncio.get_running_loop() costs a getpid() system call (CPython 3.11)
        self.loop = asyncio.get_running_loop()
        self.now = self.loop.time

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen; the port it listens on (`port` 0: one the system chose). `reuse_port`: the
        processes of --processes N each listen on the same port (SO_REUSEPORT)."""
        protocol = partial(FrontProtocol, self)
        self.server = await self.loop.create_server(
            protocol, host, port, backlog=1024, reuse_port=reuse_port
        )
        self._reaper = self.loop.create_task(self._reap())
        server: Any = self.server  # its sockets are a list on uvloop, a tuple on asyncio
        return int(server.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float = 5.0) -> None:
        """Drain (README.md, "Graceful drain"): stop accepting, close each connection once it
        is idle, for up to `grace_s`; then close what is left. A connection is idle between
        requests only: never while a request is being received, waits or is answered."""
        self.draining = True
        if self.server is not None:
            self.server.close()
        deadline = self.now() + grace_s
        while self.connections and self.now() < deadline:
            # idle now: closed at once (a client sending on it at this instant sees it close
            # unanswered, as with any server's keep-alive timeout); busy: after its answer,
            # which says `Connection: close`, or as soon as it goes idle
            for conn in list(self.connections):
                if conn.idle:
                    conn.close()
            await asyncio.sleep(0.05)
        if self._reaper is not None:
            self._reaper.cancel()
        for conn in list(self.connections):
            conn.close()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)

    async def _reap(self) -> None:
        """Once a second: 408 past the header or body timeout, idle connections closed."""
        limits = self.limits
        while True:
            await asyncio.sleep(1.0)
            now = self.now()
            stale = now - limits.keepalive_s
            for conn in list(self.connections):
                if conn.idle:
                    if conn.last_active < stale:
                        conn.close()
                else:
                    conn.check_timeouts(now, limits)
            if self.released_bytes > _TRIM_AFTER_BYTES:
                # glibc keeps the heap that large bodies came through (its mmap threshold
                # grows after each big free): hand the free pages back to the system
                self.released_bytes = 0
                self._trim()


def _malloc_trim() -> Callable[[], object]:
    """glibc's malloc_trim(0), or nothing where there is none."""
    try:
        return partial(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim, 0)
    except (OSError, AttributeError):
        return lambda: None
