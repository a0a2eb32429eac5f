"""Health checks: a worker answering requests is not probed; an idle one is."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

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


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


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
        busy.answered_at = math.inf  # answering all along (the proxy stamps each success)
        seen_busy, seen_idle = len(busy_probes), len(idle_probes)
        assert await _until(lambda: len(idle_probes) >= seen_idle + 3), "idle worker not probed"
        assert len(busy_probes) == seen_busy, "a worker answering requests was probed"
        busy.answered_at = 0.0  # no answer lately: the probes resume
        assert await _until(lambda: len(busy_probes) > seen_busy)
    finally:
        loop_task.cancel()
        await fleet.close()
        await busy_runner.cleanup()
        await idle_runner.cleanup()
