"""`urc epp`: the ext_proc gRPC server and gRPC health, with a `Gateway`'s fleet, index and
background tasks running behind them; HTTP only for `--metrics-port` (docs/epp.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from grpc_health.v1 import health_pb2

from router.epp.exchange import Exchange
from router.epp.h2grpc import Call, GrpcServer, Handler
from router.epp.models import ModelsAnswer
from router.epp.picker import EndpointPicker
from router.gateway.app import Gateway, add_fallback_route
from router.gateway.config import GatewayConfig
from router.gateway.serve import run_async

log = logging.getLogger(__name__)
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH = "grpc.health.v1.Health"
_NOT_FOUND = 5  # gRPC status
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class ExternalProcessor:
    """One `Process` call per HTTP request through the proxy."""

    def __init__(self, picker: EndpointPicker, max_body_bytes: int) -> None:
        self.picker = picker
        self.listing = ModelsAnswer(picker.gateway)
        self.max_body_bytes = max_body_bytes

    async def process(self, call: Call) -> None:
        exchange = Exchange(self.picker, self.listing, self.max_body_bytes)
        try:
            while (message := await call.recv()) is not None:
                for answer in await exchange.on(ext.ProcessingRequest.FromString(message)):
                    call.send(answer.SerializeToString())
        finally:  # the proxy closes the stream when the request ends, whatever its modes
            exchange.close()


class HealthChecks:
    """`grpc.health.v1.Health`: a status per service name; Watch sends it again on a change."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.changed = asyncio.Event()

    def set(self, name: str, status: int) -> None:
        if self.status.get(name) != status:
            self.status[name] = status
            self.changed.set()
            self.changed = asyncio.Event()

    async def check(self, call: Call) -> None:
        status = self.status.get(await self._service(call))
        if status is None:
            call.finish(_NOT_FOUND, "unknown service")
        else:
            call.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())

    async def watch(self, call: Call) -> None:
        service = await self._service(call)
        while True:
            changed = self.changed
            status = self.status.get(service, _UNKNOWN)
            call.send(health_pb2.HealthCheckResponse(status=status).SerializeToString())
            await changed.wait()

    @staticmethod
    async def _service(call: Call) -> str:
        return health_pb2.HealthCheckRequest.FromString(await call.recv() or b"").service

    def handlers(self) -> dict[str, Handler]:
        return {f"/{HEALTH}/Check": self.check, f"/{HEALTH}/Watch": self.watch}


async def _readiness(gateway: Gateway, checks: HealthChecks) -> None:
    """`readiness` (and the ext_proc service) serve while a worker is up; `liveness` always."""
    while True:
        up = any(w.up for w in gateway.fleet.workers.values())
        status = _SERVING if up else _NOT_SERVING
        for name in ("readiness", SERVICE):
            checks.set(name, status)
        await asyncio.sleep(min(gateway.config.health_interval_s, 1.0))


async def _metrics_site(gateway: Gateway, host: str, port: int) -> web.AppRunner:
    """`/metrics` (no key, as on the gateway's metrics port), `/health`, `/health/live`;
    prints `metrics: http://HOST:PORT/metrics` once listening."""
    app = web.Application()
    app.router.add_get("/metrics", gateway.scrape)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/health/live", gateway.live)
    add_fallback_route(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"metrics: http://{host}:{runner.addresses[0][1]}/metrics", flush=True)
    return runner


async def serve_epp(
    config: GatewayConfig, grpc_port: int, stop: asyncio.Event, max_in_flight: int = 0
) -> None:
    """Serve until `stop` is set; print `epp: HOST:PORT` once listening. `max_in_flight`:
    per endpoint, beyond which requests are shed with 429 (0: never)."""
    gateway = Gateway(config)
    await gateway._start(gateway.app)  # the fleet, health, load feed, KV events, discovery
    picker = EndpointPicker(gateway, max_in_flight)
    processor = ExternalProcessor(picker, config.max_body_bytes)
    checks = HealthChecks()
    for name in ("", "liveness"):
        checks.set(name, _SERVING)
    server = GrpcServer({f"/{SERVICE}/Process": processor.process, **checks.handlers()})
    readiness = asyncio.get_running_loop().create_task(_readiness(gateway, checks))
    metrics: web.AppRunner | None = None
    try:
        if config.metrics_port is not None:
            metrics = await _metrics_site(
                gateway, config.metrics_host or config.host, config.metrics_port
            )
        port = await server.start(config.host, grpc_port)
        print(f"epp: {config.host}:{port}", flush=True)
        await stop.wait()
        gateway.draining = True  # /health on the metrics port says so
        readiness.cancel()
        for name in ("readiness", SERVICE):  # unready first: the proxy stops sending
            checks.set(name, _NOT_SERVING)
        log.warning("shutting down: unready, draining for up to %s s", config.drain_timeout_s)
        await server.stop(config.drain_timeout_s)
    finally:
        readiness.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await readiness
        if metrics is not None:
            await metrics.cleanup()
        await gateway._stop(gateway.app)


def run_epp(config: GatewayConfig, grpc_port: int, max_in_flight: int = 0) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_epp(config, grpc_port, stop, max_in_flight)

    run_async(main())
