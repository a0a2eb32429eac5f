"""Loading LoRA adapters on demand (docs/adapters.md): before a request for an adapter goes to
a worker that has not loaded it, the gateway loads it there with vLLM's
`POST /v1/load_lora_adapter` (one load per (worker, adapter) at a time; the others wait for it),
first unloading the worker's least recently used adapter with no request in flight when its
slots are full; and its metrics (loads, unloads, failures, slot use per worker)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.adapters import Adapters
from router.gateway.fleet import Fleet, Model, Worker

log = logging.getLogger(__name__)
LOAD_PATH = "/v1/load_lora_adapter"  # vLLM's (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); ours too
UNLOAD_PATH = "/v1/unload_lora_adapter"


class AdapterLoader(Collector):
    """The gateway's adapter loads; `ready` before each attempt of an adapter's request."""

    def __init__(self, fleet: Fleet, timeout_s: float = 60.0) -> None:
        self.fleet = fleet
        self.adapters: Adapters = fleet.adapters
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._loading: dict[tuple[str, str], asyncio.Future[str | None]] = {}
        self.loads: Counter[str] = Counter()  # per worker
        self.unloads: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()

    async def ready(self, worker: Worker, model: Model) -> str | None:
        """None once `model`'s adapter is loaded on `worker` (loaded now if need be); else why
        it cannot be (the request tries its next worker)."""
        if model.adapter in self.adapters.worker(worker.name).loaded:
            return None
        if not model.lora_path:
            return "is not loaded there and has no lora_path to load it from"
        key = (worker.name, model.adapter)
        pending = self._loading.get(key)
        if pending is None:
            pending = self._loading[key] = asyncio.ensure_future(self._load(worker, model))
            pending.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(pending)  # a waiter that leaves does not cancel the load

    async def _load(self, worker: Worker, model: Model) -> str | None:
        state = self.adapters.worker(worker.name)
        while len(state.loaded) >= state.max_loras:  # make room: its slot limit
            victim = state.lru(state.loaded, model.adapter)
            if victim is None or state.in_flight.get(victim):
                break  # every one is busy: the worker may still take it (else it says so)
            status, _ = await self._post(worker, UNLOAD_PATH, {"lora_name": victim})
            if status not in (200, 404):
                break
            self.adapters.unloaded(worker.name, victim)
            self.unloads[worker.name] += 1
            log.info("adapter %s unloaded from %s (its slots were full)", victim, worker.name)
        body = {"lora_name": model.adapter, "lora_path": model.lora_path}
        status, text = await self._post(worker, LOAD_PATH, body)
        if status == 200 or (status == 400 and "already" in text.lower()):
            self.adapters.registered(worker.name, model.adapter, time.monotonic())
            self.loads[worker.name] += 1
            log.info("adapter %s loaded on %s", model.adapter, worker.name)
            return None
        self.failures[worker.name] += 1
        why = f"failed to load there ({status or 'unreachable'}: {text[:200]})"
        log.warning("adapter %s %s: %s", model.adapter, worker.name, why)
        return why

    async def _post(self, worker: Worker, path: str, body: dict[str, Any]) -> tuple[int, str]:
        """The worker's status and text (0: it could not be reached)."""
        session = self.fleet.session
        assert session is not None
        try:
            async with session.post(worker.url + path, json=body, timeout=self.timeout) as resp:
                return resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientError) as exc:
            return 0, str(exc) or exc.__class__.__name__

    def collect(self) -> Iterator[Any]:
        loads = CounterMetricFamily(
            "urc_adapter_loads", "LoRA adapters the gateway loaded, per worker", labels=["worker"]
        )
        unloads = CounterMetricFamily(
            "urc_adapter_unloads",
            "LoRA adapters the gateway unloaded to make room, per worker",
            labels=["worker"],
        )
        failures = CounterMetricFamily(
            "urc_adapter_load_failures", "failed LoRA adapter loads, per worker", labels=["worker"]
        )
        slots = GaugeMetricFamily(
            "urc_adapter_slots",
            "a worker's LoRA adapters: loaded, active (in slots) and its slot count (max)",
            labels=["worker", "state"],
        )
        for name in self.fleet.workers:
            loads.add_metric([name], self.loads[name])
            unloads.add_metric([name], self.unloads[name])
            failures.add_metric([name], self.failures[name])
            state = self.adapters.workers.get(name)
            if state is not None:
                slots.add_metric([name, "loaded"], len(state.loaded))
                slots.add_metric([name, "active"], len(state.active))
                slots.add_metric([name, "max"], state.max_loras)
        yield from (loads, unloads, failures, slots)
