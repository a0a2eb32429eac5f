"""LoRA adapters over HTTP, as vLLM serves them (docs/workers.md, "LoRA adapters"):
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` with vLLM's bodies, answers and
statuses, routed only under `--enable-lora` (vLLM routes them only with runtime updating on);
`--lora-modules` at start-up; the worker's adapter metrics."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from backends.http.openai_api import read_json
from backends.http.runner import Engine, EngineRunner, Events
from backends.lora_slots import LoraSlots
from core.errors import APIError


def lora_module(value: str) -> tuple[str, str]:
    """vLLM's `--lora-modules` item: `name=path`."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags (`--max-loras` is each engine's setting)."""
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    parser.add_argument(
        "--lora-modules",
        type=lora_module,
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters of the default model loaded at start-up (needs --enable-lora)",
    )


def load_lora_modules(engine: Engine, args: argparse.Namespace) -> None:
    """The `--lora-modules` of the flags; ValueError (a usage error) when one cannot load."""
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, path in args.lora_modules:
        if name in engine.models:
            raise ValueError(f"--lora-modules: the name {name!r} is taken")
        engine.load_adapter(name, path)


def _name(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'{field}' must be a non-empty string", param=field)
    return value


class LoraApi:
    """The two endpoints; `publish` sends an unload's removals on their streams."""

    def __init__(self, runner: EngineRunner, publish: Callable[[Events], None]) -> None:
        self.runner = runner
        self.engine = runner.steps
        self.publish = publish

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name, path = _name(body, "lora_name"), _name(body, "lora_path")
        if name in self.engine.models:
            message = f"The lora adapter '{name}' has already been loaded."
            raise APIError(400, message, param="lora_name")

        def load() -> None:
            try:
                self.engine.load_adapter(name, path)
            except (ValueError, OSError) as exc:
                raise APIError(400, str(exc), param="lora_path") from exc

        await self.runner.call(load)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = _name(await read_json(request), "lora_name")

        def unload() -> Events:
            model = self.engine.models.get(name)
            if model is None or model.base is None:
                message = f"The lora adapter '{name}' cannot be found."
                raise APIError(404, message, type="NotFoundError", param="lora_name")
            if self.runner.in_flight(name):
                raise APIError(400, f"The lora adapter '{name}' has requests in flight.")
            return self.engine.unload_adapter(name)

        self.publish(await self.runner.call(unload))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def lora_metrics(slots: LoraSlots, model: str) -> Iterator[Metric]:
    """The worker's adapter slots (docs/metrics.md), labelled by the base model."""
    families: list[tuple[type, str, str, int]] = [
        (CounterMetricFamily, "urc_worker_lora_loads", "LoRA adapter activations", slots.loads),
        (
            CounterMetricFamily,
            "urc_worker_lora_evictions",
            "LoRA adapters evicted from their slot",
            slots.evictions,
        ),
        (GaugeMetricFamily, "urc_worker_lora_active", "LoRA adapters in slots", len(slots.active)),
    ]
    for family, name, doc, value in families:
        metric = family(name, doc, labels=["model"])
        metric.add_metric([model], value)
        yield metric
