"""What every worker process shares: its serving flags, its listening socket, and serving
until a signal."""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Protocol

from aiohttp import web


class Served(Protocol):
    url: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def add_serving_arguments(parser: argparse.ArgumentParser, kv_port_note: str = "") -> None:
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    parser.add_argument(
        "--default-max-tokens", type=int, default=256, help="output length when a chat sets none"
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        default=0,
        help=f"ZMQ PUB port for KV events (0: any){kv_port_note}",
    )
    parser.add_argument(
        "--kv-replay-port",
        type=int,
        default=0,
        help=f"ZMQ ROUTER port for replays (0: any){kv_port_note}",
    )
    parser.add_argument(
        "--max-body-mb", type=float, default=32.0, help="larger request bodies get 413"
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level")


async def listen(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app` on `host:port` (port 0: any free one); its runner and the port it got.
    A request whose client goes away is cancelled (its generation aborted)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port, shutdown_timeout=1.0).start()
    return runner, runner.addresses[0][1]


async def serve_until_signal(worker: Served) -> None:
    """Start `worker`, announce `ready: URL` (what `urc cluster` and the tests wait for), and
    serve until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await worker.start()
        print(f"ready: {worker.url}", flush=True)
        await stop.wait()
    finally:
        await worker.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
