"""The gateway's front door: a lean HTTP/1.1 server for the two inference endpoints.

`POST /v1/completions` and `POST /v1/chat/completions` are the hot path: parsed by httptools
and answered straight on the transport, with none of a general framework's per-request objects.
Everything else (health, metrics, models, admin, errors for unknown routes) is aiohttp's: a
connection whose request is not an inference request is handed to aiohttp's protocol with the
bytes received so far, and stays with aiohttp from then on (aiohttp serves the inference
endpoints too, through the same handler). A request pipelined behind another one in the same
packet cannot be handed over (its first byte is not known): it gets a JSON 400 and the
connection is closed; clients do not pipeline in practice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import httptools

from router.gateway.errors import APIError
from router.gateway.reply import Headers

log = logging.getLogger(__name__)

HOT_PATHS = {b"/v1/completions": "/v1/completions", b"/v1/chat/completions": "/v1/chat/completions"}
# (reply, path, lowercased request headers, body) -> the reply has been written
Serve = Callable[["LeanReply", str, dict[str, str], bytes], Awaitable[None]]
JSON_HEADERS = [("Content-Type", "application/json")]
_MAX_QUEUED = 8  # pipelined requests waiting on one connection before reading pauses


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


def _head(status: int, headers: Headers, extra: bytes) -> bytes:
    lines = [_STATUS_LINES.get(status) or _status_line(status)]
    lines += [f"{key}: {value}\r\n".encode("latin-1") for key, value in headers]
    lines.append(extra)
    return b"".join(lines)


class _HandOver(Exception):
    """Raised from a parser callback: this request is aiohttp's."""


class _Request:
    __slots__ = ("path", "headers", "body", "size", "keep_alive", "chunked", "too_large", "refusal")

    def __init__(self, path: str, refusal: APIError | None = None) -> None:
        self.path = path
        self.refusal = refusal  # not served: this error is the answer, then the connection ends
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.keep_alive = True
        self.chunked = True  # HTTP/1.1: a stream goes chunked; HTTP/1.0: raw until close
        self.too_large = False


class LeanReply:
    """A response written straight to the connection's transport."""

    __slots__ = ("conn", "keep_alive", "chunked", "started", "complete")

    def __init__(self, conn: FrontProtocol, keep_alive: bool, chunked: bool = True) -> None:
        self.conn = conn
        self.keep_alive = keep_alive
        self.chunked = chunked
        self.started = False
        self.complete = False  # the whole answer was written (a cut stream must close)

    def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = self.complete = True
        close = b"" if self.keep_alive else b"Connection: close\r\n"
        extra = b"Content-Length: %d\r\n%s\r\n" % (len(body), close)
        self.conn.write(_head(status, headers, extra) + body)

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        if not self.chunked:  # an HTTP/1.0 client: the stream ends when the connection does
            self.keep_alive = False
            self.conn.write(_head(status, headers, b"Connection: close\r\n\r\n"))
        else:
            close = b"" if self.keep_alive else b"Connection: close\r\n"
            extra = b"Transfer-Encoding: chunked\r\n%s\r\n" % close
            self.conn.write(_head(status, headers, extra))
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


class FrontProtocol(asyncio.Protocol):
    """One client connection (see the module's docstring)."""

    def __init__(self, front: FrontServer) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self.data = b""  # the chunk being parsed
        self.ended_in_chunk = False  # a message completed earlier in the chunk being parsed
        self.head: list[bytes] | None = None  # raw bytes since the current message began
        self.url = b""
        self.request: _Request | None = None  # the hot request being received
        self.queue: deque[_Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.reading_paused = False
        self.writable: asyncio.Future[None] | None = None  # set while the transport is full
        self.refused = False  # an error ends the connection: nothing more is parsed
        self.last_active = 0.0  # loop time of the last bytes received

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.last_active = self.front.now()
        self.front.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.front.connections.discard(self)
        self.queue.clear()
        self._wake_writer()

    def pause_writing(self) -> None:
        if self.writable is None:
            self.writable = self.front.loop.create_future()

    def resume_writing(self) -> None:
        self._wake_writer()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self.last_active = self.front.now()
        if self.head is not None:  # a message began in an earlier chunk, its head unparsed
            self.head.append(data)
        self.data = data
        self.ended_in_chunk = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _HandOver):
                self._hand_over()
                return
            log.exception("front server: parser callback failed")
            self._refuse(500, "internal error in the gateway")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        # the message's first byte is the chunk's first byte unless another one ended before it
        self.head = None if self.ended_in_chunk else [self.data]
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self.request or self._start_request()
        request.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        request = self.request or self._start_request()  # a request with no header at all
        self.head = None
        request.keep_alive = self.parser.should_keep_alive()
        request.chunked = self.parser.get_http_version() != "1.0"
        if request.headers.get("expect", "").lower() == "100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _start_request(self) -> _Request:
        """The URL is complete: an inference request begins, or the connection is aiohttp's."""
        path = HOT_PATHS.get(self.url.partition(b"?")[0])
        if path is None or self.parser.get_method() != b"POST":
            raise _HandOver  # stops the parser: data_received hands the connection over
        self.request = _Request(path)
        return self.request

    def on_body(self, body: bytes) -> None:
        request = self.request
        assert request is not None
        if request.too_large:
            return
        request.body.append(body)
        request.size += len(body)
        if request.size > self.front.max_body_bytes:
            request.too_large = True
            request.body.clear()

    def on_message_complete(self) -> None:
        self.ended_in_chunk = True
        request, self.request = self.request, None
        assert request is not None
        self._enqueue(request)

    def _enqueue(self, request: _Request) -> None:
        self.queue.append(request)
        if self.task is None:
            self.task = self.front.loop.create_task(self._serve_queue())
        elif len(self.queue) >= _MAX_QUEUED and not self.reading_paused:
            self.reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    # -- serving -----------------------------------------------------------------------------

    def _hand_over(self) -> None:
        """Give the connection to aiohttp with the bytes of the message that began."""
        if self.transport is None or self.transport.is_closing():
            return
        if self.head is None or self.task is not None or self.queue:
            # pipelined behind an inference request: its first byte is unknown, or the
            # transport is still answering
            message = "pipelined requests are only served on the inference endpoints"
            self._refuse(400, message, "pipelining")
            return
        self.front.connections.discard(self)
        protocol = self.front.fallback()
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        protocol.data_received(b"".join(self.head))

    def _refuse(self, status: int, message: str, code: str | None = None) -> None:
        """Answer `status` after the requests already received, then close."""
        self.refused = True
        self.request = None
        refusal = _Request("", APIError(status, message, code=code))
        refusal.keep_alive = False
        self._enqueue(refusal)

    async def _serve_queue(self) -> None:
        try:
            while self.queue and not self.lost:
                request = self.queue.popleft()
                if self.reading_paused and len(self.queue) < _MAX_QUEUED // 2:
                    self.reading_paused = False
                    assert self.transport is not None
                    self.transport.resume_reading()
                if not await self._serve_one(request):
                    self.close()
                    return
        finally:
            self.task = None

    async def _serve_one(self, request: _Request) -> bool:
        """Answer one request; whether the connection may serve another."""
        reply = LeanReply(self, request.keep_alive, request.chunked)
        if request.refusal is not None:
            reply.whole(request.refusal.status, JSON_HEADERS, request.refusal.body())
            return False
        if request.too_large:
            limit = self.front.max_body_bytes
            error = APIError(413, f"request body too large (limit {limit} bytes)", code="too_large")
            reply.keep_alive = False
            reply.whole(413, JSON_HEADERS, error.body())
            return False
        body = request.body[0] if len(request.body) == 1 else b"".join(request.body)
        try:
            await self.front.serve(reply, request.path, request.headers, body)
        except Exception:
            log.exception("internal error on POST %s", request.path)
            if reply.started:  # a stream was under way: the client sees it cut
                return False
            error = APIError(500, "internal error in the gateway", type="server_error")
            reply.whole(500, JSON_HEADERS, error.body())
        # a stream cut short (or raw, HTTP/1.0) ends only when the connection does
        return reply.complete and reply.keep_alive

    # -- the transport -----------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.lost and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.writable is not None and not self.lost:
            await self.writable

    def _wake_writer(self) -> None:
        if self.writable is not None:
            if not self.writable.done():
                self.writable.set_result(None)
            self.writable = None

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    @property
    def idle(self) -> bool:
        return self.task is None and self.request is None


class FrontServer:
    """The listening socket, its connections, and where to send what is not ours."""

    def __init__(
        self,
        serve: Serve,
        fallback: Callable[[], asyncio.Protocol],
        max_body_bytes: int,
        keepalive_s: float = 75.0,
    ) -> None:
        self.serve = serve
        self.fallback = fallback
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        self.connections: set[FrontProtocol] = set()
        self.server: asyncio.Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        # asyncio.get_running_loop() costs a getpid() system call (CPython 3.11): the hot
        # path asks this once
        self.loop = asyncio.get_running_loop()
        self.now = self.loop.time

    async def start(self, host: str, port: int) -> int:
        """Listen; the port it listens on (`port` 0: one the system chose)."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: FrontProtocol(self), host, port, backlog=1024
        )
        self._reaper = loop.create_task(self._close_idle())
        server: Any = self.server  # its sockets are a list on uvloop, a tuple on asyncio
        return int(server.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting; let requests under way finish (up to `grace_s`); close the rest."""
        if self.server is not None:
            self.server.close()
        if self._reaper is not None:
            self._reaper.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(not c.idle for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.close()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)

    async def _close_idle(self) -> None:
        """Close kept-alive connections silent for longer than `keepalive_s`."""
        while True:
            await asyncio.sleep(min(self.keepalive_s, 10.0))
            stale = self.now() - self.keepalive_s
            for conn in list(self.connections):
                if conn.idle and not conn.queue and conn.last_active < stale:
                    conn.close()
