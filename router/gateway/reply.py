"""How a response reaches the client, whichever server took the request: `LeanReply` writes to a
connection of the front door (server.py), `AiohttpReply` answers on one aiohttp holds. Either
has `whole`, `start`, `send` and `end` (the last two: False when the client has gone),
`started`: something reached the client, so an error can no longer be sent instead, and
`request_id`: sent as `x-request-id` on the answer, whatever it is (docs/operability.md)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING

from aiohttp import web

from core.errors import APIError
from core.logs import REQUEST_ID_HEADER

if TYPE_CHECKING:
    from router.gateway.connection import FrontProtocol

log = logging.getLogger(__name__)
Headers = list[tuple[str, str]]
JSON_HEADERS = [("Content-Type", "application/json")]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AiohttpReply:
    """`response` is what the aiohttp handler returns."""

    __slots__ = ("request", "response", "started", "request_id")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.started = False
        self.request_id = ""

    def _headers(self, headers: Headers) -> dict[str, str]:
        out = dict(headers)
        if self.request_id:
            out[REQUEST_ID_HEADER] = self.request_id
        return out

    def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = True
        self.response = web.Response(body=body, status=status, headers=self._headers(headers))

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self.response = web.StreamResponse(status=status, headers=self._headers(headers))
        await self.response.prepare(self.request)

    async def send(self, chunk: bytes) -> bool:
        assert self.response is not None
        return await _written(self.response.write(chunk))

    async def end(self) -> bool:
        assert self.response is not None
        return await _written(self.response.write_eof())


def error_response(error: APIError) -> web.Response:
    """The error as aiohttp's answer (the admin and metrics endpoints, the aiohttp front door)."""
    return web.Response(body=error.body(), status=error.status, content_type="application/json")


async def _written(write: Awaitable[None]) -> bool:
    try:
        await write
    except ConnectionResetError:
        return False
    return True


_REQUEST_ID_NAME = REQUEST_ID_HEADER.encode()


def request_id_line(request_id: str) -> bytes:
    """The `x-request-id` header line (a valid id is printable ASCII: nothing to escape)."""
    return b"%s: %s\r\n" % (_REQUEST_ID_NAME, request_id.encode())


_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}


def _head(status: int, headers: Headers, extra: bytes, request_id: str) -> bytes:
    lines = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status]
    lines += [f"{key}: {value}\r\n".encode("latin-1") for key, value in headers]
    if request_id:
        lines.append(request_id_line(request_id))
    lines.append(extra)
    return b"".join(lines)


class LeanReply:
    """A response written straight to the connection's transport."""

    __slots__ = ("conn", "keep_alive", "chunked", "started", "complete", "request_id")

    def __init__(self, conn: FrontProtocol, keep_alive: bool, chunked: bool = True) -> None:
        self.conn = conn
        self.keep_alive = keep_alive
        self.chunked = chunked
        self.started = False
        self.complete = False  # the whole answer was written (a cut stream must close)
        self.request_id = ""

    def _close(self) -> bytes:
        """The head's `Connection: close`, decided when the head is written: a drain that
        began while the request was under way still tells the client; requests pipelined
        behind this one were received, so they are answered first (the last says close)."""
        if self.keep_alive and self.conn.front.draining and not self.conn.queue:
            self.keep_alive = False
        return b"" if self.keep_alive else b"Connection: close\r\n"

    def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = self.complete = True
        extra = b"Content-Length: %d\r\n%s\r\n" % (len(body), self._close())
        self.conn.write(_head(status, headers, extra, self.request_id) + body)

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        if not self.chunked:  # an HTTP/1.0 client: the stream ends when the connection does
            self.keep_alive = False
            extra = b"Connection: close\r\n\r\n"
        else:
            extra = b"Transfer-Encoding: chunked\r\n%s\r\n" % self._close()
        self.conn.write(_head(status, headers, extra, self.request_id))
        await self.conn.drain()

    async def send(self, chunk: bytes) -> bool:
        if chunk:
            self.conn.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if self.chunked else chunk)
        await self.conn.drain()
        return not self.conn.lost

    async def end(self) -> bool:
        self.complete = True
        if self.chunked:
            self.conn.write(b"0\r\n\r\n")
        await self.conn.drain()
        return not self.conn.lost


Reply = LeanReply | AiohttpReply


def json_errors(handler: Handler) -> Handler:
    """Every error of `handler` leaves as OpenAI-style JSON with its status, never a 500 page."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return error_response(exc)
        except web.HTTPRequestEntityTooLarge as exc:
            message = f"request body too large: {exc.text}"
            return error_response(APIError(413, message, code="body_too_large"))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(APIError(exc.status, exc.reason))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            error = APIError(500, "internal error in the gateway", type="server_error")
            return error_response(error)

    return wrapped


def add_fallback_route(app: web.Application) -> None:
    """Unknown paths and wrong methods get JSON errors too (add it after every other route)."""
    known = {r.canonical for r in app.router.resources()}

    async def fallback(request: web.Request) -> web.Response:
        if request.path in known:
            message = f"{request.method} is not allowed on {request.path}"
            return error_response(APIError(405, message, code="method_not_allowed"))
        message = f"no such endpoint: {request.path}"
        return error_response(APIError(404, message, code="not_found"))

    app.router.add_route("*", "/{tail:.*}", fallback)
