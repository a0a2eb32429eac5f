"""The gateway's lean upstream client against a raw HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from router.gateway.config import GatewayConfig, WorkerConfig
from router.gateway.fleet import Fleet
from router.gateway.upstream import UpstreamError, UpstreamPool
from router.index import UnifiedIndex

RESPONSES = {
    b"/length": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Test: a\r\n\r\nhello",
    b"/chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n3\r\nabc\r\n0\r\n\r\n"
    ),
    b"/close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    b"/garbage": b"\x00\x01 this is not http\r\n\r\n",
    b"/hangup": b"",
}


async def serve(connections: list[int]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                path = head.split(b" ")[1]
                writer.write(RESPONSES[path])
                await writer.drain()
                if path in (b"/close", b"/garbage", b"/hangup"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_bodies_headers_and_keep_alive():
    connections: list[int] = []
    server = await serve(connections)
    pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        r = await pool.post("/length", b"{}")
        assert (r.status, r.header("x-test"), await r.read()) == (200, "a", b"hello")
        r.release()
        r = await pool.post("/chunked", b"{}")
        assert await r.read() == b"data: abc"  # de-chunked: the framing is hop-by-hop
        r.release()
        assert len(connections) == 1  # both went over one kept-alive connection
        r = await pool.post("/close", b"{}")
        assert await r.read() == b"until the end"  # a body that ends with the connection
        r.release()
    finally:
        pool.close()
        server.close()


async def test_a_stale_kept_alive_connection_is_retried_once():
    connections: list[int] = []
    server = await serve(connections)
    pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        r = await pool.post("/length", b"{}")
        await r.read()
        r.release()
        # the idle connection dies as the next request goes out on it (a worker restart):
        # closed, and the pool has not heard of it yet
        pool._idle[0].transport.close()
        r = await pool.post("/length", b"{}")
        assert await r.read() == b"hello" and len(connections) == 2
        r.release()
    finally:
        pool.close()
        server.close()


async def test_failures_are_upstream_errors():
    connections: list[int] = []
    server = await serve(connections)
    pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        for path in ("/garbage", "/hangup"):
            with pytest.raises(UpstreamError):
                await pool.post(path, b"{}")
    finally:
        pool.close()
        server.close()
    with pytest.raises(UpstreamError):
        await UpstreamPool("127.0.0.1", 1).post("/length", b"{}")


async def test_the_connect_timeout_is_the_gateways():
    """A worker whose accept queue is full never completes the handshake: the hop gives up
    after the gateway's --connect-timeout, and the fleet hands its pools that setting."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepted: the kernel drops SYNs once the queue is full
    port = listener.getsockname()[1]
    fillers = [socket.socket() for _ in range(3)]
    try:
        for filler in fillers:
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
        with pytest.raises(UpstreamError, match="no connection within 0.3 s"):
            await UpstreamPool("127.0.0.1", port, connect_timeout_s=0.3).post("/x", b"{}")
        config = GatewayConfig(connect_timeout_s=0.3, workers=[WorkerConfig("http://127.0.0.1:1")])
        fleet = Fleet(config, UnifiedIndex())
        await fleet.start()  # the worker is down (nothing listens): its pool is made all the same
        try:
            assert [w.pool.connect_timeout_s for w in fleet.workers.values()] == [0.3]
        finally:
            await fleet.close()
    finally:
        for sock in (listener, *fillers):
            sock.close()


async def test_a_retired_pool_finishes_the_exchange_under_way_then_closes_it():
    connections: list[int] = []
    server = await serve(connections)
    pool = UpstreamPool("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        idle = await pool.post("/length", b"{}")
        await idle.read()
        idle.release()
        busy = await pool.post("/chunked", b"{}")  # the idle connection, in use again
        spare = await pool.post("/length", b"{}")  # a second one
        await spare.read()
        spare.release()
        pool.close(retire=True)  # its worker left the fleet: the spare closes now
        assert spare.transport is not None and spare.transport.is_closing()
        assert await busy.read() == b"data: abc"  # what it began, it finishes
        busy.release()
        assert busy.transport is not None and busy.transport.is_closing()
        assert pool._take_idle() is None
    finally:
        server.close()
