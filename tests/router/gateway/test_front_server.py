"""The lean front server (router/gateway/server.py) over real sockets on 127.0.0.1: inference
requests served by it, everything else handed to aiohttp, edge cases of HTTP/1.1 answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from router.gateway.config import GatewayConfig
from router.gateway.reply import LeanReply
from router.gateway.server import FrontServer

JSON = [("Content-Type", "application/json")]


async def fake_serve(reply: LeanReply, path: str, headers: dict[str, str], body: bytes) -> None:
    """Echo what arrived; `"stream": true` answers three SSE chunks."""
    request = json.loads(body)
    echo = {"path": path, "auth": headers.get("authorization"), "n": request.get("n")}
    if request.get("stream"):
        await reply.start(200, [("Content-Type", "text/event-stream")])
        for i in range(3):
            assert await reply.send(f"data: {i}\n\n".encode())
        assert await reply.end()
        return
    reply.whole(200, [*JSON, ("x-urc-route", "lean")], json.dumps(echo).encode())


@pytest.fixture
async def front() -> AsyncIterator[int]:
    app = web.Application()

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def aiohttp_completions(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"path": request.path, "via": "aiohttp", "len": len(body)})

    app.add_routes([web.get("/health", health), web.post("/v1/completions", aiohttp_completions)])
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    assert runner.server is not None
    server = FrontServer(fake_serve, runner.server, GatewayConfig(max_body_bytes=1 << 16))
    port = await server.start("127.0.0.1", 0)
    try:
        yield port
    finally:
        await server.stop(grace_s=1.0)
        await runner.cleanup()


async def exchange(port: int, raw: bytes, until: bytes = b"", timeout: float = 5.0) -> bytes:
    """Send raw bytes; read until `until` has been seen (or the server closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    got = b""
    try:
        async with asyncio.timeout(timeout):
            while not until or until not in got:
                data = await reader.read(65536)
                if not data:
                    break
                got += data
    finally:
        writer.close()
    return got


def post(body: dict, extra: bytes = b"", path: bytes = b"/v1/completions") -> bytes:
    raw = json.dumps(body).encode()
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n%s" % (len(raw), extra, raw)
    )


async def test_inference_requests_are_served_lean_with_keep_alive(front: int) -> None:
    async with aiohttp.ClientSession() as session:
        for n in range(3):  # one connection, kept alive
            async with session.post(
                f"http://127.0.0.1:{front}/v1/chat/completions?x=1",
                json={"n": n},
                headers={"Authorization": "Bearer k"},
            ) as response:
                assert response.status == 200
                assert response.headers["x-urc-route"] == "lean"
                assert await response.json() == {
                    "path": "/v1/chat/completions",
                    "auth": "Bearer k",
                    "n": n,
                }
        async with session.post(
            f"http://127.0.0.1:{front}/v1/completions", json={"stream": True}
        ) as response:
            assert response.headers["Transfer-Encoding"] == "chunked"
            assert await response.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_other_requests_hand_the_connection_to_aiohttp(front: int) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        base = f"http://127.0.0.1:{front}"
        async with session.post(f"{base}/v1/completions", json={"n": 1}) as response:
            assert response.headers["x-urc-route"] == "lean"
        async with session.get(f"{base}/health") as response:  # same connection: handed over
            assert await response.json() == {"status": "ok"}
        async with session.post(f"{base}/v1/completions", json={"n": 2}) as response:
            assert (await response.json())["via"] == "aiohttp"  # aiohttp keeps the connection
        async with session.get(f"{base}/v1/completions") as response:  # not POST: not ours
            assert response.status == 405


async def test_pipelined_inference_requests_are_answered_in_order(front: int) -> None:
    got = await exchange(front, post({"n": 1}) + post({"n": 2}) + post({"n": 3}), b'"n": 3}')
    assert got.count(b"HTTP/1.1 200 OK") == 3
    assert got.index(b'"n": 1') < got.index(b'"n": 2') < got.index(b'"n": 3')


async def test_a_pipelined_request_that_is_not_ours_gets_a_json_error(front: int) -> None:
    got = await exchange(front, post({"n": 1}) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK")
    assert b"HTTP/1.1 400 Bad Request" in got and b"pipelin" in got


async def test_malformed_http_gets_a_json_400(front: int) -> None:
    got = await exchange(front, b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


async def test_too_large_a_body_gets_413_and_the_connection_closes(front: int) -> None:
    got = await exchange(front, post({"pad": "x" * 70_000}))
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head
    assert json.loads(body)["error"]["code"] == "too_large"


async def test_chunked_request_bodies_and_expect_continue(front: int) -> None:
    raw = json.dumps({"n": 7}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Expect: 100-continue\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(raw), raw)
    )
    got = await exchange(front, request, b'"n": 7}')
    assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")


async def test_connection_close_is_honoured(front: int) -> None:
    got = await exchange(front, post({"n": 1}, b"Connection: close\r\n"))
    assert b"Connection: close" in got and got.endswith(b'"n": 1}')


async def test_an_http10_stream_is_raw_and_ends_with_the_connection(front: int) -> None:
    raw = json.dumps({"stream": True}).encode()
    request = b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)
    got = await exchange(front, request)
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head and b"Connection: close" in head
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
