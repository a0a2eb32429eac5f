"""A rollout's SIGTERM on real processes (README.md, "Graceful drain"): readiness goes false
while the gateway still serves for `--shutdown-delay`, then it stops accepting, and every
request already sent, streamed or not, over kept-alive connections or new ones, finishes whole
before the process exits 0; a drain timeout shorter than a request cuts it, and still exits."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

import aiohttp
import pytest
from aiohttp import web

from router.gateway.config import ConfigError, GatewayConfig, load_config
from router.gateway.config_flags import add_gateway_arguments, apply_flags
from router.gateway.reply import LeanReply
from router.gateway.server import FrontServer
from urc.processes import Child

DECODE = ("--decode-base-ms", "25")  # one token per 25 ms: 320 tokens take about 8 s
LONG_TOKENS = 320
SHORT_TOKENS = 12
DELAY_S = 3.0
DRAIN_S = 20.0


async def complete(session: aiohttp.ClientSession, url: str, tokens: int, stream: bool) -> dict:
    """One completion: its status, the tokens it carried, whether it ended whole, and its
    `Connection` header (a stream's tokens are its SSE events before `data: [DONE]`)."""
    body = {"model": "emulated", "prompt": "tell a long story", "max_tokens": tokens}
    if stream:
        body["stream"] = True
    async with session.post(f"{url}/v1/completions", json=body) as r:
        raw = await r.read()
        result = {"status": r.status, "connection": r.headers.get("Connection")}
    if not stream:
        answer = json.loads(raw)
        return result | {"tokens": answer["usage"]["completion_tokens"], "whole": True}
    events = [e for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    done = bool(events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
    text = [c for c in chunks if c["choices"] and c["choices"][0]["text"]]
    return result | {"tokens": len(text), "whole": done}


def served_whole(result: dict, tokens: int) -> bool:
    return result["status"] == 200 and result["whole"] and result["tokens"] == tokens


async def get(url: str) -> tuple[int, dict]:
    """A GET on a connection of its own."""
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        return r.status, await r.json()


async def refused(url: str, timeout_s: float) -> bool:
    """Whether new connections to `url` are refused within `timeout_s`."""
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection(host, int(port))
        except ConnectionRefusedError:
            return True
        writer.close()
        await asyncio.sleep(0.1)
    return False


async def exit_code(gateway: Child, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and gateway.popen.poll() is None:
        await asyncio.sleep(0.05)
    return gateway.popen.poll()


def metrics_url(gateway: Child) -> str:
    line = next(x for x in gateway.lines if x.startswith("metrics: "))
    return line.removeprefix("metrics: ").removesuffix("/metrics")


async def after_a_handover(url: str, timeout: aiohttp.ClientTimeout) -> dict:
    """A long stream on a connection aiohttp holds: a GET handed it over first."""
    connector = aiohttp.TCPConnector(limit=1)  # one connection for both
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(f"{url}/v1/models") as r:
            assert r.status == 200
        return await complete(session, url, LONG_TOKENS, True)


async def rollout(gateway: Child) -> None:
    url, metrics = gateway.url, metrics_url(gateway)
    connector = aiohttp.TCPConnector(limit=0)  # kept-alive connections, as many as asked
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # kept-alive connections first: the long requests go over ones that served before
        warm = [complete(session, url, 2, i % 2 == 0) for i in range(8)]
        assert all(r["status"] == 200 for r in await asyncio.gather(*warm))
        long = [
            asyncio.create_task(complete(session, url, LONG_TOKENS, i % 2 == 0)) for i in range(8)
        ]
        held = asyncio.create_task(after_a_handover(url, timeout))
        await asyncio.sleep(1.0)  # all sent, each a second into its answer
        assert not any(t.done() for t in long)
        gateway.popen.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        # the shutdown delay: unready but alive, and still serving, new connections included
        status, health = await get(f"{url}/health")
        assert status == 503 and health["status"] == "draining", health
        assert await get(f"{url}/health/live") == (200, {"status": "alive"})
        assert await get(f"{metrics}/health/live") == (200, {"status": "alive"})
        assert (await get(f"{metrics}/health"))[0] == 503
        # sent well within the delay (else the new connections would rightly be refused)
        assert time.monotonic() - signalled < DELAY_S - 1.0, "too slow a machine for the test"
        late = [complete(session, url, SHORT_TOKENS, i % 2 == 0) for i in range(4)]
        async with aiohttp.ClientSession(timeout=timeout) as fresh:
            late += [complete(fresh, url, SHORT_TOKENS, i % 2 == 0) for i in range(4)]
            late_results = await asyncio.gather(*late)

        # then no new connection, while the requests under way go on to their end
        assert await refused(url, DELAY_S + 5.0)
        under_way = not all(t.done() for t in long)
        assert await get(f"{metrics}/health/live") == (200, {"status": "alive"})
        long_results = await asyncio.gather(*long)
        held_result = await held

    for i, result in enumerate(late_results):
        assert served_whole(result, SHORT_TOKENS), (i, result)
        assert result["connection"] == "close", (i, result)  # the clients are told to go
    for i, result in enumerate(long_results):
        assert served_whole(result, LONG_TOKENS), (i, result)
        if i % 2:  # answered whole during the drain: told, not cut
            assert result["connection"] == "close", (i, result)
    assert served_whole(held_result, LONG_TOKENS), held_result
    assert under_way, "the requests ended before the listener closed: nothing was drained"
    assert await exit_code(gateway, DELAY_S + DRAIN_S + 5.0) == 0, gateway.lines[-20:]


def test_sigterm_under_load_cuts_no_request_streamed_or_not(start_fleet):
    gateway_args = ["--shutdown-delay", str(DELAY_S), "--drain-timeout", str(DRAIN_S)]
    gateway, _ = start_fleet(2, *DECODE, gateway_args=[*gateway_args, "--metrics-port", "0"])
    asyncio.run(rollout(gateway))


async def cut_by_the_timeout(gateway: Child) -> None:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        stream = asyncio.create_task(complete(session, gateway.url, 2000, True))  # ~50 s
        await asyncio.sleep(1.0)
        gateway.popen.send_signal(signal.SIGTERM)
        try:
            result = await stream
        except aiohttp.ClientError:
            result = {"whole": False}
    assert not result["whole"], result
    assert await exit_code(gateway, 10.0) == 0, gateway.lines[-20:]


def test_a_drain_timeout_shorter_than_a_request_cuts_it_and_exits(start_fleet):
    gateway, _ = start_fleet(1, *DECODE, gateway_args=["--drain-timeout", "1"])
    asyncio.run(cut_by_the_timeout(gateway))


def test_the_shutdown_delay_is_a_flag_zero_by_default_never_negative():
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    assert apply_flags(load_config(None), parser.parse_args([])).shutdown_delay_s == 0
    delayed = apply_flags(load_config(None), parser.parse_args(["--shutdown-delay", "5"]))
    assert delayed.shutdown_delay_s == 5
    with pytest.raises(ConfigError, match="shutdown_delay_s"):
        apply_flags(load_config(None), parser.parse_args(["--shutdown-delay", "-1"]))


async def echo(reply: LeanReply, path: str, headers: dict[str, str], body: bytes) -> None:
    reply.whole(200, [("Content-Type", "application/json")], body)


async def test_pipelined_requests_are_all_answered_before_a_drain_closes_their_connection():
    runner = web.AppRunner(web.Application(), handle_signals=False)
    await runner.setup()
    assert runner.server is not None
    front = FrontServer(echo, runner.server, GatewayConfig())
    port = await front.start("127.0.0.1", 0)
    try:
        front.draining = True
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n"
        writer.write(b"".join(head + b"%d" % i for i in range(3)))  # one write: all received
        async with asyncio.timeout(5):
            got = await reader.read(-1)  # until the gateway closes the connection
        writer.close()
    finally:
        await front.stop(1.0)
        await runner.cleanup()
    answers = got.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert [a.endswith(b"%d" % i) for i, a in enumerate(answers)] == [True] * 3, got
    assert [b"Connection: close" in a for a in answers] == [False, False, True], got
