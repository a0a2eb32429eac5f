"""How a response reaches the client, whichever server took the request (server.py's front door
or aiohttp): `whole` for a complete answer, `start` / `send` / `end` for a stream.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

Headers = list[tuple[str, str]]


class Reply(Protocol):
    started: bool  # something reached the client: an error can no longer be sent instead

    def whole(self, status: int, headers: Headers, body: bytes) -> None: ...

    async def start(self, status: int, headers: Headers) -> None: ...

    async def send(self, chunk: bytes) -> bool:
        """Write a chunk of the stream; False when the client has gone."""
        ...

    async def end(self) -> bool:
        """Close the stream; False when the client has gone."""
        ...


class AiohttpReply:
    """The same interface over an aiohttp request; `response` is what the handler returns."""

    __slots__ = ("request", "response", "started")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.started = False

    def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = True
        self.response = web.Response(body=body, status=status, headers=dict(headers))

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        response = web.StreamResponse(status=status)
        for key, value in headers:
            response.headers[key] = value
        self.response = response
        await response.prepare(self.request)

    async def send(self, chunk: bytes) -> bool:
        assert self.response is not None
        try:
            await self.response.write(chunk)
        except ConnectionResetError:
            return False
        return True

    async def end(self) -> bool:
        assert self.response is not None
        try:
            await self.response.write_eof()
        except ConnectionResetError:
            return False
        return True
