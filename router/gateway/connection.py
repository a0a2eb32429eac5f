"""One client connection of the front door (server.py): httptools parses, inference requests are
answered in order, anything else goes to aiohttp; limits and the `Upgrade` rewrite apply here."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

import httptools

from core.errors import APIError
from router.gateway.config import GatewayConfig
from router.gateway.reply import JSON_HEADERS, LeanReply

if TYPE_CHECKING:
    from router.gateway.server import FrontServer

log = logging.getLogger(__name__)

HOT_PATHS: dict[bytes, str] = {  # the inference endpoints, served here
    p.encode(): p
    for p in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")
}
_MAX_QUEUED = 8  # pipelined requests waiting on one connection before reading pauses
_LINGER_S = 2.0  # after a refusal: how long the client may go on sending before we close


class _HandOver(Exception):
    """Raised from a parser callback: this request is aiohttp's."""


class _Request:
    __slots__ = ("path", "hot", "headers", "body", "size", "keep_alive", "chunked", "refusal")

    def __init__(self, path: str, refusal: APIError | None = None, hot: bool = True) -> None:
        self.path = path
        self.hot = hot  # an inference request, served here (else buffered for aiohttp)
        self.refusal = refusal  # not served: this error is the answer, then the connection ends
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.keep_alive = refusal is None
        self.chunked = True  # HTTP/1.1: a stream goes chunked; HTTP/1.0: raw until close


class FrontProtocol(asyncio.Protocol):
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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.last_active = self.front.now()
        self.front.connections.add(self)

    # EOF from the client closes the connection (asyncio's default): its request is cancelled

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.front.connections.discard(self)
        self._drop_receiving()
        for request in self.queue:  # forget what was received and not answered
            self.front.released_bytes += request.size
        self.queue.clear()
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
            if isinstance(cause, APIError):  # raised from a callback: answer it, then close
                self._refuse(cause)
                return
            log.exception("front server: parser callback failed")
            self._refuse(APIError(500, "internal error in the gateway"))
        except httptools.HttpParserUpgrade:
            self._without_upgrade()
        except httptools.HttpParserError as exc:
            self._refuse(APIError(400, f"malformed HTTP request: {exc}"))

    def _head_grew(self, size: int) -> None:
        """httptools holds a header until its end: its bytes are counted as they come."""
        self.head_bytes += size
        limits = self.front.limits
        if self.head_bytes > limits.max_request_line_bytes + limits.max_header_bytes:
            self._refuse(_headers_too_large(limits))

    def _without_upgrade(self) -> None:
        """llhttp stops at an `Upgrade` (h2c), before the body: the message is parsed again
        without its upgrade headers, answered over HTTP/1.1, then the connection closes."""
        head = self.head
        if head is None or not self.queue:  # it began behind another message in its chunk
            self._refuse(APIError(400, "Upgrade is not supported here", code="upgrade"))
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
        limit = self.front.limits.max_request_line_bytes
        if len(self.url) > limit:
            raise APIError(414, f"URL too long (limit {limit} bytes)", code="uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self.request or self._start_request()
        self.header_bytes += len(name) + len(value) + 4
        if self.header_bytes > self.front.limits.max_header_bytes:
            raise _headers_too_large(self.front.limits)
        key = name.decode("latin-1").lower()
        if key == "authorization" and key in request.headers:
            message = "more than one Authorization header"
            raise APIError(400, message, param="authorization", code="duplicate_header")
        request.headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        request = self.request or self._start_request()  # a request with no header at all
        self.headers_at = self.front.now()
        if request.hot and "upgrade" not in request.headers:
            self.head = None  # kept for an upgrade only: llhttp stops there (_without_upgrade)
        request.keep_alive = self.parser.should_keep_alive()
        request.chunked = self.parser.get_http_version() != "1.0"
        if request.headers.get("host") is None and request.chunked:
            raise APIError(400, "an HTTP/1.1 request needs a Host header", code="host")
        continued = request.headers.get("expect", "").lower() == "100-continue"
        if request.hot and continued and not self.reparsed:
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.reparsed = False

    def _start_request(self) -> _Request:
        """The URL is complete: an inference request begins, or one buffered for aiohttp."""
        if not self.url.startswith(b"/"):  # `*`, an absolute URL: no endpoint of ours
            raise APIError(400, "the request target must be a path", code="bad_target")
        path = HOT_PATHS.get(self.url.partition(b"?")[0])
        hot = path is not None and self.parser.get_method() == b"POST"
        self.request = _Request(path or "", hot=hot)
        return self.request

    def on_body(self, body: bytes) -> None:
        request = self.request
        assert request is not None
        if request.refusal is not None:
            return
        request.size += len(body)
        if request.hot:
            request.body.append(body)
        limit = self.front.limits.max_body_bytes
        if request.size > limit:
            message = f"request body too large (limit {limit} bytes)"
            request.refusal = APIError(413, message, code="too_large")
            request.keep_alive = False
            request.body.clear()
            self.head = None

    def on_message_complete(self) -> None:
        self.ended_in_chunk = True
        self.began = 0.0
        request, self.request = self.request, None
        assert request is not None
        if not request.hot and request.refusal is None:
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

    def _hand_over(self) -> None:
        """Give the connection to aiohttp with the bytes of the message that began."""
        if self.transport is None or self.transport.is_closing():
            return
        if self.head is None or self.task is not None or self.queue:
            # behind an inference request: its first byte is unknown, or an answer is under way
            message = "pipelined requests are only served on the inference endpoints"
            self._refuse(APIError(400, message, code="pipelining"))
            return
        self.front.connections.discard(self)
        protocol = self.front.fallback()
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        protocol.data_received(b"".join(self.head))

    def _drop_receiving(self) -> None:
        """Forget the request being received (its bytes count toward giving memory back)."""
        if self.request is not None:
            self.front.released_bytes += self.request.size
            self.request = None
        self.began = 0.0

    def _refuse(self, error: APIError) -> None:
        """Answer `error` after the requests already received, then close."""
        self.refused = True
        self._drop_receiving()
        self._enqueue(_Request("", error))

    async def _serve_queue(self) -> None:
        try:
            while self.queue and not self.lost:
                request = self.queue.popleft()
                if self.reading_paused and len(self.queue) < _MAX_QUEUED // 2:
                    self.reading_paused = False
                    assert self.transport is not None
                    self.transport.resume_reading()
                if not await self._serve_one(request):
                    if request.refusal is not None:
                        self._linger()
                    else:
                        self.close()
                    return
            if self.closing and self.began == 0.0:  # (an upgraded message may still come)
                self.close()
        finally:
            self.task = None

    async def _serve_one(self, request: _Request) -> bool:
        """Answer one request; whether the connection may serve another."""
        # a drain's `Connection: close` is decided as the head is written (reply.py)
        keep_alive = request.keep_alive and not self.closing
        reply = LeanReply(self, keep_alive, request.chunked)
        if request.refusal is not None:
            reply.whole(request.refusal.status, JSON_HEADERS, request.refusal.body())
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

    def _linger(self) -> None:
        """After a refusal: stop writing, read on (discarded) until the client closes or
        _LINGER_S pass, then close. Closing with its bytes unread would reset the connection,
        and a client still sending could lose the answer (nginx's lingering close)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()  # the client's EOF then closes it (asyncio's default)
        self.front.loop.call_later(_LINGER_S, self.close)

    @property
    def idle(self) -> bool:
        """Between requests: nothing being received, answered or waiting."""
        return self.task is None and self.began == 0.0 and not self.queue

    def check_timeouts(self, now: float, limits: GatewayConfig) -> None:
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
        self._refuse(APIError(408, message, code="timeout"))


def _headers_too_large(limits: GatewayConfig) -> APIError:
    message = f"request headers too large (limit {limits.max_header_bytes} bytes)"
    return APIError(431, message, code="headers_too_large")
