"""Health checks: a worker answering requests is not probed; an idle one is."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from router.gateway.config import GatewayConfig, WorkerConfig
from router.gateway.fleet import Fleet
from router.index import UnifiedIndex


async def _fake_worker() -> tuple[web.AppRunner, str, list[float]]:
    probes: list[float] = []

    async def health(_request: web.Request) -> web.Response:
        probes.append(time.monotonic())
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}", probes


async def test_requests_stand_in_for_probes_and_idle_workers_are_probed():
    busy_runner, busy_url, busy_probes = await _fake_worker()
    idle_runner, idle_url, idle_probes = await _fake_worker()
    config = GatewayConfig(
        workers=[WorkerConfig(busy_url, models=["m"]), WorkerConfig(idle_url, models=["m"])],
        health_interval_s=0.05,
    )
    fleet = Fleet(config, UnifiedIndex())
    await fleet.start()
    loop_task = asyncio.get_running_loop().create_task(fleet.health_loop())
    try:
        busy = fleet.workers[busy_url.split("//")[1]]
        idle = fleet.workers[idle_url.split("//")[1]]
        assert busy.up and idle.up
        start = len(busy_probes)
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:  # a request answered every 10 ms, as the proxy marks it
            busy.answered_at = time.monotonic()
            await asyncio.sleep(0.01)
        assert len(busy_probes) == start, "a worker answering requests was probed"
        assert len(idle_probes) >= 5, "an idle worker was not probed"
        await asyncio.sleep(0.3)  # no more answers: the probes resume
        assert len(busy_probes) > start
    finally:
        loop_task.cancel()
        await fleet.close()
        await busy_runner.cleanup()
        await idle_runner.cleanup()
