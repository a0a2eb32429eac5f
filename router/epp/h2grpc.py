"""A small gRPC server over cleartext HTTP/2 (prior knowledge, as Envoy's gRPC client connects):
the frames urc epp needs and nothing more, written on the transport as they come. grpcio's
asyncio server spent ~95 % of urc epp's CPU per request (docs/epp.md, "Cost, measured").

HTTP/2 (RFC 9113) as a server: the preface, SETTINGS (acknowledged), PING (answered),
WINDOW_UPDATE (our send windows), RST_STREAM (the call is cancelled), GOAWAY, HEADERS and
CONTINUATION (HPACK-decoded, for the path), DATA (gRPC's length-prefixed messages). Receive
windows are opened wide once and topped up in large steps. gRPC: no compression (none is
offered), status in trailers; a handler gets a `Call` and awaits `recv()`, calls `send()`."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable

from hpack import Decoder, HPACKError

from router.epp.h2_frames import (
    ACK,
    BIG_WINDOW,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW,
    MAX_FRAME,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    RESPONSE_HEADERS,
    RST_STREAM,
    SETTINGS,
    UINT32,
    WINDOW_UPDATE,
    frame,
    trailers,
)

log = logging.getLogger(__name__)

_TOP_UP = 2**30  # the connection's receive window is topped up after this many bytes
_CANCEL_STATUS, UNIMPLEMENTED, INTERNAL = 1, 12, 13  # gRPC status codes


class Call:
    """One gRPC call: the request messages as they arrive, the answers as they are sent."""

    def __init__(self, conn: Connection, stream: int, path: str) -> None:
        self.conn = conn
        self.stream = stream
        self.path = path
        self.received: deque[bytes] = deque()
        self.partial = bytearray()  # a message whose bytes have not all arrived
        self.half_closed = False  # the client sent END_STREAM
        self.finished = False  # our trailers went (or the stream was reset)
        self.headers_sent = False
        self.window = conn.peer_window  # what we may send on this stream
        self.pending = bytearray()  # DATA waiting for a window
        self.trailers: bytes | None = None  # to send once `pending` is out
        self._wake: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    async def recv(self) -> bytes | None:
        """The next request message, or None once the client has sent its last one."""
        while not self.received:
            if self.half_closed or self.finished:
                return None
            self._wake = self.conn.loop.create_future()
            await self._wake
        return self.received.popleft()

    def send(self, message: bytes) -> None:
        """Queue one response message (sent at once while the windows allow)."""
        if self.finished:
            return
        if not self.headers_sent:
            self.headers_sent = True
            self.conn.write(frame(HEADERS, END_HEADERS, self.stream, RESPONSE_HEADERS))
        self.pending += b"\x00" + UINT32.pack(len(message)) + message
        self.conn.flush(self)

    def finish(self, status: int = 0, message: str | None = None) -> None:
        """The trailers (after any queued DATA): the call is over on our side."""
        if self.finished:
            return
        self.finished = True
        block = trailers(status, message)
        if not self.headers_sent:  # trailers-only: the status line rides with them
            block = RESPONSE_HEADERS + block
        self.trailers = block
        self.conn.flush(self)

    def arrived(self, data: bytes, end: bool) -> None:
        if data:
            self.partial += data
            while len(self.partial) >= 5:
                size = UINT32.unpack_from(self.partial, 1)[0]
                if len(self.partial) < 5 + size:
                    break
                self.received.append(bytes(self.partial[5 : 5 + size]))
                del self.partial[: 5 + size]
        self.half_closed = self.half_closed or end
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def reset(self) -> None:
        """The client cancelled the call: its handler is cancelled, nothing more is sent."""
        self.finished = True
        self.pending.clear()
        self.trailers = None
        if self.task is not None:
            self.task.cancel()
        self.arrived(b"", True)


Handler = Callable[[Call], Awaitable[None]]


class Connection(asyncio.Protocol):
    """One HTTP/2 connection from the proxy; each stream a `Call` run by its handler."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface = False
        self.decoder = Decoder()
        self.paths: dict[bytes, str] = {}  # header blocks that leave the table as it is
        self.calls: dict[int, Call] = {}
        self.last_stream = 0
        self.peer_window = 65535  # SETTINGS_INITIAL_WINDOW_SIZE of new streams, the peer's
        self.max_frame = 16384  # the peer's SETTINGS_MAX_FRAME_SIZE
        self.window = 65535  # what we may send on the connection
        self.received = 0  # bytes of DATA since the last top-up of the peer's window
        self.block: tuple[int, int, bytearray] | None = None  # (stream, flags, fragment)
        self.out: list[bytes] = []  # frames written this loop iteration, sent together

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        settings = struct.pack(">HIHI", INITIAL_WINDOW, BIG_WINDOW, MAX_FRAME, 16384)
        update = UINT32.pack(BIG_WINDOW - 65535)
        self.write(frame(SETTINGS, 0, 0, settings) + frame(WINDOW_UPDATE, 0, 0, update))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            call.reset()
        self.calls.clear()
        self.transport = None

    def write(self, data: bytes) -> None:
        """Sent once the calls this iteration woke have run: one system call for all their
        frames (a send per frame was a third of urc epp's CPU at concurrency 32)."""
        if not self.out:
            self.loop.call_soon(self._send)
        self.out.append(data)

    def _send(self) -> None:
        if self.out and self.transport is not None:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.preface:
            if len(self.buffer) < len(PREFACE):
                return
            if not self.buffer.startswith(PREFACE):
                return self._fail("not an HTTP/2 client")
            del self.buffer[: len(PREFACE)]
            self.preface = True
        buffer, at = self.buffer, 0
        while len(buffer) - at >= 9:
            size = int.from_bytes(buffer[at : at + 3], "big")
            if len(buffer) - at < 9 + size:
                break
            kind, flags = buffer[at + 3], buffer[at + 4]
            stream = UINT32.unpack_from(buffer, at + 5)[0] & 0x7FFFFFFF
            payload = bytes(buffer[at + 9 : at + 9 + size])
            at += 9 + size
            try:
                self._on_frame(kind, flags, stream, payload)
            except (HPACKError, ValueError, IndexError, struct.error) as exc:
                return self._fail(f"bad frame: {exc!r}")
            if self.transport is None:
                return
        del buffer[:at]

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == DATA:
            self._data(flags, stream, payload)
        elif kind in (HEADERS, CONTINUATION):
            self._headers(kind, flags, stream, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream, UINT32.unpack(payload)[0] & 0x7FFFFFFF)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if (call := self.calls.pop(stream, None)) is not None:
                call.reset()
        elif kind == GOAWAY:
            self.server.closing_connections.add(self)
        # PRIORITY and unknown frames are ignored (RFC 9113, 4.1)

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        self.received += len(payload)
        if self.received >= _TOP_UP:  # the connection's window; each stream's is 2 GiB
            self.write(frame(WINDOW_UPDATE, 0, 0, UINT32.pack(self.received)))
            self.received = 0
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        if (call := self.calls.get(stream)) is not None:
            call.arrived(payload, bool(flags & END_STREAM))
            self._forget(call)

    def _headers(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == HEADERS:
            if flags & PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            self.block = (stream, flags, bytearray(payload))
        elif self.block is not None and self.block[0] == stream:
            self.block[2].extend(payload)
        else:
            raise ValueError("CONTINUATION without HEADERS")
        if not flags & END_HEADERS:
            return
        stream, first_flags, fragment = self.block  # type: ignore[misc]
        self.block = None
        path = self._path(bytes(fragment))  # every block: the HPACK table must follow
        if (call := self.calls.get(stream)) is not None:  # the client's trailers
            call.arrived(b"", True)
            self._forget(call)
        elif stream > self.last_stream:
            self.last_stream = stream
            self._start(stream, path, bool(first_flags & END_STREAM))

    def _path(self, block: bytes) -> str:
        """The block's `:path`. Envoy sends the same block for every call, its path a Huffman
        literal: a block that left the HPACK table as it was decodes the same while the table
        stays so, and is decoded once (HPACK decoding was ~12 % of urc epp's CPU)."""
        if (path := self.paths.get(block)) is not None:
            return path
        entries = self.decoder.header_table.dynamic_entries
        newest, size = entries[0] if entries else None, len(entries)
        headers = self.decoder.decode(block)
        path = next((v for k, v in headers if k == ":path"), "")
        changed = (entries[0] if entries else None) is not newest or len(entries) != size
        if changed or len(self.paths) >= 64:  # an insertion (or eviction) moves every index
            self.paths.clear()
        if not changed:
            self.paths[block] = path
        return path

    def _start(self, stream: int, path: str, ended: bool) -> None:
        call = Call(self, stream, path)
        self.calls[stream] = call
        call.half_closed = ended
        handler = self.server.handlers.get(path)
        if handler is None or self.server.closing:
            call.finish(UNIMPLEMENTED, f"unknown method {path}")
            return
        call.task = self.loop.create_task(self.server.run(handler, call))

    def _settings(self, payload: bytes) -> None:
        for at in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HI", payload, at)
            if key == INITIAL_WINDOW:  # applies to the open streams too (RFC 9113, 6.9.2)
                for call in self.calls.values():
                    call.window += value - self.peer_window
                self.peer_window = value
            elif key == MAX_FRAME:
                self.max_frame = value
        self.write(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, stream: int, increment: int) -> None:
        if stream == 0:
            self.window += increment
            self._flush_all()
        elif (call := self.calls.get(stream)) is not None:
            call.window += increment
            self.flush(call)

    def _flush_all(self) -> None:
        for call in list(self.calls.values()):
            if call.pending or call.trailers is not None:
                self.flush(call)

    def flush(self, call: Call) -> None:
        """Send what the windows allow of the call's DATA, then its trailers."""
        out = []
        pending = call.pending
        while pending:
            size = min(len(pending), self.window, call.window, self.max_frame)
            if size <= 0:
                break
            out.append(frame(DATA, 0, call.stream, bytes(pending[:size])))
            del pending[:size]
            self.window -= size
            call.window -= size
        if not pending and call.trailers is not None:
            out.append(frame(HEADERS, END_HEADERS | END_STREAM, call.stream, call.trailers))
            call.trailers = None
        if out:
            self.write(b"".join(out))
        self._forget(call)

    def _forget(self, call: Call) -> None:
        """A call both sides have ended leaves the table (its handler may still run)."""
        if call.half_closed and call.finished and call.trailers is None and not call.pending:
            self.calls.pop(call.stream, None)
            if not self.calls and self in self.server.closing_connections:
                self.close()

    def goaway(self) -> None:
        """No new streams: the ones under way finish (RFC 9113, 6.8)."""
        self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, NO_ERROR)))

    def close(self) -> None:
        if self.transport is not None:
            self._send()
            self.transport.close()

    def _fail(self, why: str) -> None:
        log.warning("ext_proc connection closed: %s", why)
        self.write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, PROTOCOL_ERROR)))
        self.close()


class GrpcServer:
    """`handlers`: the method paths (`/package.Service/Method`) and what runs each call."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.loop = asyncio.get_running_loop()
        self.connections: set[Connection] = set()
        self.closing_connections: set[Connection] = set()
        self.closing = False
        self.server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; the port (`port` 0: one the system chose)."""
        self.server = await self.loop.create_server(lambda: Connection(self), host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def run(self, handler: Handler, call: Call) -> None:
        try:
            await handler(call)
        except asyncio.CancelledError:
            call.finish(_CANCEL_STATUS)
        except Exception as exc:  # the call fails, the server goes on
            log.exception("gRPC %s failed", call.path)
            call.finish(INTERNAL, f"{type(exc).__name__}: {exc}")
        else:
            call.finish()

    def open_calls(self) -> int:
        return sum(len(conn.calls) for conn in self.connections)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; GOAWAY; up to `grace_s` for the calls under way; then close."""
        self.closing = True
        if self.server is not None:
            self.server.close()
        for conn in self.connections:
            conn.goaway()
        deadline = self.loop.time() + grace_s
        while self.open_calls() and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.close()
