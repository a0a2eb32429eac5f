"""A gateway process's life (README.md, "Graceful drain"): serve the `Gateway` on the front
server and aiohttp, print where, drain on the first stop signal, exit on the second."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from router.gateway.app import Gateway, add_fallback_route
from router.gateway.config import GatewayConfig
from router.gateway.server import FrontServer
from router.gateway.siblings import Siblings

log = logging.getLogger(__name__)


async def serve_gateway(
    config: GatewayConfig,
    stop: asyncio.Event,
    config_path: str | None = None,
    siblings: Siblings | None = None,
    ready_fd: int | None = None,
) -> None:
    """Serve until `stop` is set, then shut down as README.md's "Graceful drain" says: unready
    but serving for `shutdown_delay_s`, then no longer accepting while the requests under way
    get `drain_timeout_s`. Once listening: print `gateway: URL`, or as one of --processes
    (`siblings`), write a byte to `ready_fd` (the parent prints it)."""
    gateway = Gateway(config, siblings)
    if config_path:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, gateway.reload, config_path)
    runner = web.AppRunner(
        gateway.app,
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,
        shutdown_timeout=config.drain_timeout_s,
        max_line_size=config.max_request_line_bytes,
        max_field_size=config.max_header_bytes,
    )
    await runner.setup()
    held = runner.server  # where connections go that aiohttp serves (server.py)
    assert held is not None
    front = FrontServer(gateway.serve, held, config)
    metrics_runner: web.AppRunner | None = None
    try:
        reuse = siblings is not None  # the processes share the port (supervisor.py)
        port = await front.start(config.host, config.port, reuse_port=reuse)
        if siblings is not None:
            await siblings.start(runner)
        if config.metrics_port is not None:  # /metrics with no key, and /health
            metrics_runner = await _serve_metrics(gateway, config.metrics_port, reuse)
        # what startup made lives as long as the process: frozen, collections under load skip it
        gc.collect()
        gc.freeze()
        if ready_fd is None:
            print(f"gateway: http://{config.host}:{port}", flush=True)
        else:
            os.write(ready_fd, b"1")
        await stop.wait()
        # readiness false, answers say `Connection: close`, but new connections are still
        # served until the load balancer has seen /health fail and stopped sending
        gateway.draining = front.draining = True
        delay = config.shutdown_delay_s
        log.warning("shutting down: unready, still serving for %s s, then draining", delay)
        await asyncio.sleep(delay)
        log.warning("draining: up to %s s for the requests under way", config.drain_timeout_s)
    finally:
        await _drain(front, held, config.drain_timeout_s)
        await runner.cleanup()  # the app's cleanup: the fleet's connections close only now
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        if siblings is not None:
            await siblings.close()


async def _serve_metrics(gateway: Gateway, port: int, reuse: bool) -> web.AppRunner:
    """`--metrics-port`: /metrics with no key, and the health endpoints, on a port of their own
    (`reuse`: shared by the processes of --processes N, which print nothing)."""
    app = web.Application()
    routes = [web.get("/metrics", gateway.scrape), web.get("/health", gateway.health)]
    routes.append(web.get("/health/live", gateway.live))
    app.add_routes(routes)
    add_fallback_route(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host = gateway.config.metrics_host or gateway.config.host
    await web.TCPSite(runner, host, port, reuse_port=reuse).start()
    if not reuse:
        print(f"metrics: http://{host}:{runner.addresses[0][1]}/metrics", flush=True)
    return runner


async def _drain(front: FrontServer, held: web.Server, grace_s: float) -> None:
    """Stop accepting, then wait up to `grace_s` for the requests under way on either server
    (the front door's connections, and those handed to aiohttp), streams included."""
    held.pre_shutdown()  # aiohttp: idle connections close now, busy ones after their answer
    await asyncio.gather(front.stop(grace_s), held.shutdown(grace_s))


def run_gateway(
    config: GatewayConfig,
    config_path: str | None = None,
    siblings: Siblings | None = None,
    ready_fd: int | None = None,
) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _on_stop_signal, stop)
        await serve_gateway(config, stop, config_path, siblings, ready_fd)

    run_async(main())


def _on_stop_signal(stop: asyncio.Event) -> None:
    """The first SIGTERM or SIGINT shuts down gracefully; a second one exits at once."""
    if stop.is_set():
        log.warning("second stop signal: exiting without waiting for the drain")
        logging.shutdown()
        os._exit(1)
    stop.set()


def run_async(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed (it is a dependency on Linux and macOS)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
