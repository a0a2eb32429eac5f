"""The gateway's front door: a lean HTTP/1.1 server for the two inference endpoints.

`POST /v1/completions` and `POST /v1/chat/completions` are the hot path: parsed by httptools
and answered straight on the transport, with none of a general framework's per-request objects.
Everything else (health, metrics, models, admin, errors for unknown routes) is aiohttp's: a
connection whose request is not an inference request is handed to aiohttp's protocol with the
bytes received so far, and stays with aiohttp from then on (aiohttp serves the inference
endpoints too, through the same handler). A request pipelined behind another one in the same
packet cannot be handed over (its first byte is not known): it gets a JSON 400 and the
connection is closed; clients do not pipeline in practice.

Every request's head is read here, whichever server answers it, under the limits an operator
sets (`Limits`): request line and header size (414, 431), one `Authorization` header (400),
time from the first byte to the end of the headers and from there to the end of the body (408).
A request for aiohttp is buffered whole here under the same limits and handed over complete.
`Upgrade` (`curl --http2` asks for h2c) is not taken: an inference request is answered over
HTTP/1.1 and the connection closed; aiohttp answers the others over HTTP/1.1. A client that
disconnects (or half-closes) has its request cancelled (the worker's too).
On `drain`, readiness is the caller's; every answer says `Connection: close`, idle connections
close, and the requests under way get until the drain timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import httptools

from router.gateway.config import Limits
from router.gateway.errors import APIError
from router.gateway.reply import Headers

log = logging.getLogger(__name__)

HOT_PATHS = {b"/v1/completions": "/v1/completions", b"/v1/chat/completions": "/v1/chat/completions"}
# (reply, path, lowercased request headers, body) -> the reply has been written
Serve = Callable[["LeanReply", str, dict[str, str], bytes], Awaitable[None]]
JSON_HEADERS = [("Content-Type", "application/json")]
_MAX_QUEUED = 8  # pipelined requests waiting on one connection before reading pauses
_TRIM_AFTER_BYTES = 8 * 2**20  # request bodies dropped between two returns of free memory


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


class _Refusal(Exception):
    """Raised from a parser callback: answer this error, then close."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class _Request:
    __slots__ = (
        "path",
        "hot",
        "headers",
        "body",
        "size",
        "keep_alive",
        "chunked",
        "too_large",
        "refusal",
    )

    def __init__(self, path: str, refusal: APIError | None = None, hot: bool = True) -> None:
        self.path = path
        self.hot = hot  # an inference request, served here (else buffered for aiohttp)
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

    def _close(self) -> bytes:
        """The head's `Connection: close`, decided when the head is written: a drain that
        began while the request was under way still tells the client."""
        if self.keep_alive and self.conn.front.draining:
            self.keep_alive = False
        return b"" if self.keep_alive else b"Connection: close\r\n"

    def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self.started = self.complete = True
        close = self._close()
        extra = b"Content-Length: %d\r\n%s\r\n" % (len(body), close)
        self.conn.write(_head(status, headers, extra) + body)

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        if not self.chunked:  # an HTTP/1.0 client: the stream ends when the connection does
            self.keep_alive = False
            self.conn.write(_head(status, headers, b"Connection: close\r\n\r\n"))
        else:
            close = self._close()
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
        self.began = 0.0  # loop time the message being received began (0: none is)
        self.headers_at = 0.0  # loop time its headers ended (0: not yet)
        self.header_bytes = 0
        self.head_bytes = 0  # raw bytes of the head so far
        self.closing = False  # answer what came, then close (after an Upgrade)
        self.reparsed = False  # the message is parsed again (its 100 Continue already sent)

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.last_active = self.front.now()
        self.front.connections.add(self)

    # EOF from the client (asyncio's default eof_received) closes the connection: a client
    # that stops sending has given up (as nginx takes it), and its request is cancelled

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.front.connections.discard(self)
        self._drop()
        self.head = None
        self._wake_writer()
        if self.task is not None:  # the client left: its request (and the worker's) stops
            self.task.cancel()

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
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        self.data = data
        self.ended_in_chunk = False
        try:
            self.parser.feed_data(data)
            if self.began and not self.headers_at:  # all of it went into an unfinished head
                self._head_grew(len(data))
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _HandOver):
                self._hand_over()
                return
            if isinstance(cause, _Refusal):
                self._refuse(cause.error.status, cause.error.message, cause.error.code)
                return
            log.exception("front server: parser callback failed")
            self._refuse(500, "internal error in the gateway")
        except httptools.HttpParserUpgrade:
            self._without_upgrade()
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    def _head_grew(self, size: int) -> None:
        """httptools holds a header until its end: its bytes are counted as they come."""
        self.head_bytes += size
        limits = self.front.limits
        if self.head_bytes > limits.max_request_line_bytes + limits.max_header_bytes:
            message = f"request headers too large (limit {limits.max_header_bytes} bytes)"
            self._refuse(431, message, "headers_too_large")

    def _without_upgrade(self) -> None:
        """llhttp stops at an `Upgrade` (h2c, from `curl --http2`), before the body: we take
        none, so the message is parsed again without its upgrade headers, answered over
        HTTP/1.1, and the connection closes after it."""
        head = self.head
        if head is None or not self.queue:  # it began behind another message in its chunk
            self._refuse(400, "Upgrade is not supported here", "upgrade")
            return
        self.queue.pop()  # the message as llhttp cut it (not yet served: the task runs later)
        raw = b"".join(head)
        end = raw.find(b"\r\n\r\n")
        lines = [
            line
            for line in raw[:end].split(b"\r\n")
            if not line.lower().startswith((b"upgrade:", b"connection:", b"http2-settings:"))
        ]
        self.closing = self.reparsed = True
        self.parser = httptools.HttpRequestParser(self)
        self.head = None
        self._feed(b"\r\n".join(lines) + b"\r\nConnection: close" + raw[end:])

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        # the message's first byte is the chunk's first byte unless another one ended before it
        self.head = None if self.ended_in_chunk else [self.data]
        self.url = b""
        self.began = self.front.now()
        self.headers_at = 0.0
        self.header_bytes = 0
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.front.limits.max_request_line_bytes:
            limit = self.front.limits.max_request_line_bytes
            raise _Refusal(
                APIError(414, f"URL too long (limit {limit} bytes)", code="uri_too_long")
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self.request or self._start_request()
        self.header_bytes += len(name) + len(value) + 4
        if self.header_bytes > self.front.limits.max_header_bytes:
            limit = self.front.limits.max_header_bytes
            message = f"request headers too large (limit {limit} bytes)"
            raise _Refusal(APIError(431, message, code="headers_too_large"))
        key = name.decode("latin-1").lower()
        if key == "authorization" and key in request.headers:
            message = "more than one Authorization header"
            raise _Refusal(APIError(400, message, param="authorization", code="duplicate_header"))
        request.headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        request = self.request or self._start_request()  # a request with no header at all
        self.headers_at = self.front.now()
        if request.hot and "upgrade" not in request.headers:
            self.head = None  # kept for an upgrade only: llhttp stops there (_without_upgrade)
        request.keep_alive = self.parser.should_keep_alive()
        request.chunked = self.parser.get_http_version() != "1.0"
        if request.headers.get("host") is None and request.chunked:
            raise _Refusal(APIError(400, "an HTTP/1.1 request needs a Host header", code="host"))
        continued = request.headers.get("expect", "").lower() == "100-continue"
        if request.hot and continued and not self.reparsed:
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.reparsed = False

    def _start_request(self) -> _Request:
        """The URL is complete: an inference request begins, or one buffered for aiohttp."""
        if not self.url.startswith(b"/"):  # `*`, an absolute URL: no endpoint of ours
            raise _Refusal(APIError(400, "the request target must be a path", code="bad_target"))
        path = HOT_PATHS.get(self.url.partition(b"?")[0])
        hot = path is not None and self.parser.get_method() == b"POST"
        self.request = _Request(path or "", hot=hot)
        return self.request

    def on_body(self, body: bytes) -> None:
        request = self.request
        assert request is not None
        if request.too_large:
            return
        request.size += len(body)
        if request.hot:
            request.body.append(body)
        if request.size > self.front.limits.max_body_bytes:
            request.too_large = True  # read to its end and dropped: then a 413, and close
            request.body.clear()
            self.head = None

    def on_message_complete(self) -> None:
        self.ended_in_chunk = True
        self.began = 0.0
        request, self.request = self.request, None
        assert request is not None
        if not request.hot and not request.too_large:
            raise _HandOver  # stops the parser: data_received hands the connection over
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

    def _drop_receiving(self) -> None:
        """Forget the request being received (the front server counts its bytes, to give the
        memory back)."""
        if self.request is not None:
            self.front.released_bytes += self.request.size
            self.request = None
        self.began = 0.0

    def _drop(self) -> None:
        """Forget every request received and not answered."""
        self._drop_receiving()
        for request in self.queue:
            self.front.released_bytes += request.size
        self.queue.clear()

    def _refuse(self, status: int, message: str, code: str | None = None) -> None:
        """Answer `status` after the requests already received, then close."""
        self.refused = True
        self._drop_receiving()
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
            if self.closing and self.began == 0.0:  # (an upgraded message may still come)
                self.close()
        finally:
            self.task = None

    async def _serve_one(self, request: _Request) -> bool:
        """Answer one request; whether the connection may serve another."""
        keep_alive = request.keep_alive and not self.front.draining and not self.closing
        reply = LeanReply(self, keep_alive, request.chunked)
        if request.refusal is not None:
            reply.whole(request.refusal.status, JSON_HEADERS, request.refusal.body())
            return False
        if request.too_large:
            limit = self.front.limits.max_body_bytes
            error = APIError(413, f"request body too large (limit {limit} bytes)", code="too_large")
            reply.keep_alive = False
            reply.whole(413, JSON_HEADERS, error.body())
            return False
        body = request.body[0] if len(request.body) == 1 else b"".join(request.body)
        self.front.released_bytes += request.size
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
        """Between requests: nothing being received, answered or waiting."""
        return self.task is None and self.began == 0.0 and not self.queue

    def check_timeouts(self, now: float, limits: Limits) -> None:
        """The reaper's look at this connection (once a second)."""
        if self.refused or self.began == 0.0:
            return
        if self.headers_at == 0.0 and now - self.began > limits.header_timeout_s:
            message = f"request headers not received within {limits.header_timeout_s} s"
        elif self.headers_at and now - self.headers_at > limits.body_timeout_s:
            message = f"request body not received within {limits.body_timeout_s} s"
        else:
            return
        self.head = None
        self._refuse(408, message, "timeout")


class FrontServer:
    """The listening socket, its connections, and where to send what is not ours."""

    def __init__(
        self, serve: Serve, fallback: Callable[[], asyncio.Protocol], limits: Limits
    ) -> None:
        self.serve = serve
        self.fallback = fallback
        self.limits = limits
        self.connections: set[FrontProtocol] = set()
        self.server: asyncio.Server | None = None
        self.draining = False
        self.released_bytes = 0  # request bodies dropped since memory was last given back
        self._trim = _malloc_trim()
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
        self._reaper = loop.create_task(self._reap())
        server: Any = self.server  # its sockets are a list on uvloop, a tuple on asyncio
        return int(server.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float = 5.0) -> None:
        """Drain: stop accepting; answer the requests under way (and any that arrive on open
        connections) with `Connection: close`, close idle connections, for up to `grace_s`;
        then close the rest."""
        self.draining = True
        if self.server is not None:
            self.server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.connections and loop.time() < deadline:
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
        """Once a second: requests past their header or body timeout get 408; kept-alive
        connections silent for longer than `keepalive_s` close."""
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


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0), or nothing where there is none."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return _no_trim

    def trim_all() -> None:
        trim(0)

    return trim_all


def _no_trim() -> None:
    pass
