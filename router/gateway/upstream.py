"""A lean HTTP/1.1 client for the hop to the workers: pooled keep-alive connections, the request
written in one call, the response parsed by httptools as it arrives (a fraction of aiohttp's
ClientSession per request)."""

from __future__ import annotations

import asyncio
from collections import deque
from functools import partial

import httptools

_MAX_IDLE = 256  # idle connections kept per worker


class UpstreamError(Exception):
    """The worker could not be reached, or broke the exchange."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker, and the response being received on it."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._loop = asyncio.get_running_loop()  # made by create_connection, on its loop
        self._pool = pool
        self.released = True  # not handed out by `post`
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self._wake: asyncio.Future[None] | None = None
        self._paused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.headers_done = False
        self.chunks: deque[bytes] = deque()
        self.complete = False
        self.keep_alive = True
        self.delimited = False  # a Content-Length or chunked body: its end is in the stream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.lost = True
            assert self.transport is not None
            self.transport.close()
        if len(self.chunks) > 64 and not self._paused and self.transport is not None:
            self._paused = True  # the client downstream is slower than the worker
            self.transport.pause_reading()
        self._notify()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.headers_done and not self.complete and not self.delimited:
            self.complete = True  # an HTTP/1.0-style body: it ends when the connection does
            self.keep_alive = False
        self._notify()

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1")
        self.headers.append((key, value.decode("latin-1")))
        if key.lower() in ("content-length", "transfer-encoding"):
            self.delimited = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def wait(self) -> None:
        """Until more has arrived (or the connection is gone)."""
        self._wake = self._loop.create_future()
        await self._wake
        self._wake = None

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    async def next_chunk(self) -> bytes | None:
        """The body that arrived since the last call, once there is some; None at its end."""
        while True:
            if self.chunks:
                return self.take()
            if self.complete:
                return None
            if self.lost:
                raise UpstreamError("the worker closed the connection mid-response")
            await self.wait()

    async def read(self) -> bytes:
        if self.complete:  # small answers are usually whole by now
            return self.take()
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Back to the pool when the exchange completed cleanly; closed otherwise (once)."""
        if not self.released:
            self.released = True
            self._pool.give_back(self)


# what `post` returns: the connection, with the status and headers in, the body as it comes
UpstreamResponse = _Connection


class UpstreamPool:
    def __init__(
        self, host: str, port: int, tls: bool = False, connect_timeout_s: float = 2.0
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.connect_timeout_s = connect_timeout_s  # the gateway's --connect-timeout
        self._idle: list[_Connection] = []
        self.retired = False  # its worker left the fleet: connections close as exchanges end
        self._head = f"Host: {host}:{port}\r\nContent-Type: application/json\r\n".encode()

    async def _connect(self) -> _Connection:
        connect = asyncio.get_running_loop().create_connection(
            partial(_Connection, self), self.host, self.port, ssl=self.tls or None
        )
        try:
            _, conn = await asyncio.wait_for(connect, self.connect_timeout_s)
        except TimeoutError:
            raise UpstreamError(f"no connection within {self.connect_timeout_s} s") from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect: {exc}") from None
        return conn

    def give_back(self, conn: _Connection) -> None:
        clean = conn.complete and conn.keep_alive and not conn.lost and not conn.chunks
        if clean and not self.retired and len(self._idle) < _MAX_IDLE:
            conn._reset()
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    async def post(self, path: str, body: bytes, headers: bytes = b"") -> UpstreamResponse:
        """Send (`headers`: more header lines, each ending CRLF); return once the status line
        and headers are in. A pooled connection the worker closed before answering is retried
        once on a fresh one (nothing was processed)."""
        head = b"POST %b HTTP/1.1\r\n%b%bContent-Length: %d\r\n\r\n"
        request = head % (path.encode(), self._head, headers, len(body)) + body
        for fresh in (False, True):
            conn = self._take_idle() if not fresh else None
            if conn is None:
                fresh = True
                conn = await self._connect()
            assert conn.transport is not None
            conn.transport.write(request)
            try:
                while not conn.headers_done and not conn.lost:
                    await conn.wait()
            except BaseException:  # cancelled (the client left, a deadline): the worker stops
                conn.transport.close()
                raise
            if conn.headers_done:
                conn.released = False
                return conn
            if conn.transport is not None:
                conn.transport.close()
            if fresh:  # a fresh connection failed: the worker is the problem
                raise UpstreamError("the worker closed the connection before answering")
            self.close()  # one kept-alive connection went stale: the others likely did too
        raise AssertionError("unreachable")

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost:
                return conn
        return None

    def close(self, retire: bool = False) -> None:
        """Close the idle connections; `retire`: those in use close too, once their exchange
        ends (a worker that left: what it began, it finishes)."""
        self.retired = self.retired or retire
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
