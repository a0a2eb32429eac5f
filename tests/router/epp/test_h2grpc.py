"""router/epp/h2grpc.py against grpcio's client (another HTTP/2 and gRPC implementation) on
127.0.0.1: streams in order, messages larger than a frame and than the default windows, many
calls on one connection, unknown methods, failing handlers, cancelled calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from router.epp.h2grpc import Call, GrpcServer

RAW = {"request_serializer": None, "response_deserializer": None}  # bytes as they are


class Echo:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

    async def chat(self, call: Call) -> None:
        while (message := await call.recv()) is not None:
            call.send(message[::-1])

    async def fail(self, call: Call) -> None:
        await call.recv()
        raise ValueError("no such thing")

    async def hang(self, call: Call) -> None:
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture
async def served() -> AsyncIterator[tuple[Echo, grpc.aio.Channel]]:
    echo = Echo()
    handlers = {"/t.E/Chat": echo.chat, "/t.E/Fail": echo.fail, "/t.E/Hang": echo.hang}
    server = GrpcServer(handlers)
    port = await server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield echo, channel
    await channel.close()
    await server.stop(1.0)


async def test_streams_large_messages_and_many_calls(served: tuple[Echo, grpc.aio.Channel]) -> None:
    _, channel = served
    chat = channel.stream_stream("/t.E/Chat", **RAW)
    big = bytes(range(256)) * 8192  # 2 MiB: many frames, past every default window
    messages = [b"one", big, b"", b"three"]
    call = chat(iter(messages))
    got = [m async for m in call]
    assert got == [m[::-1] for m in messages]
    assert await call.code() == grpc.StatusCode.OK

    async def one(i: int) -> list[bytes]:
        return [m async for m in chat(iter([str(i).encode(), b"x" * 70_000]))]

    answers = await asyncio.gather(*(one(i) for i in range(64)))  # one connection, 64 streams
    assert answers == [[str(i).encode()[::-1], b"x" * 70_000] for i in range(64)]


async def test_unknown_method_and_failing_handler(served: tuple[Echo, grpc.aio.Channel]) -> None:
    _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await channel.unary_unary("/t.E/Nope", **RAW)(b"")
    assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await channel.unary_unary("/t.E/Fail", **RAW)(b"?")
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "no such thing" in (failed.value.details() or "")
    assert [m async for m in channel.stream_stream("/t.E/Chat", **RAW)(iter([b"ok"]))] == [b"ko"]


async def test_a_cancelled_call_cancels_its_handler(served: tuple[Echo, grpc.aio.Channel]) -> None:
    echo, channel = served
    call = channel.stream_stream("/t.E/Hang", **RAW)(iter([b"x"]))
    await asyncio.wait_for(echo.started.wait(), 5)
    call.cancel()  # RST_STREAM
    await asyncio.wait_for(echo.cancelled.wait(), 5)
