"""The worker HTTP shell both our engines plug into (`urc worker --engine emulated|torch`):
OpenAI's and SGLang's APIs, `/urc/info`, `/urc/load`, `/urc/invalidate`, `/metrics`, one
KV-event stream per kv_group (docs/workers.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from backends.http.embeddings_api import EmbeddingsApi
from backends.http.load_publisher import LoadPublisher
from backends.http.lora_api import LoraApi, add_lora_flags, load_lora_modules
from backends.http.openai_api import (
    OpenAIApi,
    echo_request_id,
    error_middleware,
    json_response,
    read_json,
)
from backends.http.responses_api import ResponsesApi
from backends.http.runner import Engine, EngineRunner, Events, InvalidateRequest
from backends.http.sglang_api import SGLangApi
from backends.http.tokenize_api import TokenizeApi
from core.blocks import salt_scope
from core.errors import APIError
from core.kv_publisher import KVEventPublisher
from core.logs import FORMATS, LEVELS, configure_logging
from core.process_metrics import process_registry

log = logging.getLogger(__name__)

KV_TOPIC = ""  # vLLM's default (KVEventsConfig.topic), what its consumers expect
_ANY_HOST = ("0.0.0.0", "::", "*", "")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_LOAD = ("running", "waiting", "queued_prefill_tokens", "decoding")  # /urc/info's "load"


class Worker:
    """The worker: `await start()`, then it serves until `await stop()`; `flags` are the
    parsed `worker_parser` flags (the kv_group i publishes on --kv-*-port + i, 0: any)."""

    def __init__(self, engine: Engine, flags: argparse.Namespace) -> None:
        self.engine = engine
        self.flags = flags
        self.incarnation = uuid.uuid4().hex
        # a stream per model's kv_group; a LoRA adapter's blocks go on its base model's
        models = engine.models.values()
        self.groups = list(dict.fromkeys(m.kv_group for m in models if m.base is None))
        self.publishers: dict[str, KVEventPublisher] = {}
        self.load_publisher: LoadPublisher | None = None
        self.runner = EngineRunner(engine, self.publish)
        self.registry = process_registry()  # /metrics: the engine's and the process's
        self.registry.register(engine)  # type: ignore[arg-type]  # it has collect()
        self._web: web.AppRunner | None = None
        self.port: int = flags.port
        self.url = ""

    async def start(self) -> None:
        cfg, engine = self.flags, self.engine
        for i, group in enumerate(self.groups):
            pub_port = cfg.kv_events_port + i if cfg.kv_events_port else 0
            replay_port = cfg.kv_replay_port + i if cfg.kv_replay_port else 0
            self.publishers[group] = KVEventPublisher(
                f"tcp://{cfg.host}:{pub_port}", f"tcp://{cfg.host}:{replay_port}", topic=KV_TOPIC
            )
        self.runner.start()
        if cfg.load_publish_ms > 0:
            endpoint = f"tcp://{cfg.host}:{cfg.load_events_port}"
            self.load_publisher = LoadPublisher(
                self.load_document, endpoint, cfg.load_publish_ms / 1e3
            )
            self.load_publisher.start()
        max_body = int(cfg.max_body_mb * 1024 * 1024)  # larger bodies get 413
        app = web.Application(middlewares=[error_middleware], client_max_size=max_body)
        app.on_response_prepare.append(echo_request_id)
        OpenAIApi(self.runner, engine.models, int(time.time())).add_routes(app)
        ResponsesApi(self.runner, engine.models).add_routes(app)
        EmbeddingsApi(self.runner, engine.models).add_routes(app)
        SGLangApi(self).add_routes(app)
        TokenizeApi(engine.models).add_routes(app)
        if cfg.enable_lora:
            LoraApi(self.runner, self.publish).add_routes(app)
        app.router.add_get("/urc/info", self.info)
        app.router.add_get("/urc/load", self.load)
        app.router.add_post("/urc/invalidate", self.invalidate)
        app.router.add_get("/metrics", self.metrics)
        # a request whose client goes away is cancelled (its generation aborted)
        self._web = web.AppRunner(
            app, access_log=None, handle_signals=False, handler_cancellation=True
        )
        await self._web.setup()
        await web.TCPSite(self._web, cfg.host, cfg.port, shutdown_timeout=1.0).start()
        self.port = self._web.addresses[0][1]
        self.url = f"http://{cfg.host}:{self.port}"

    async def stop(self) -> None:
        if self.load_publisher is not None:
            await self.load_publisher.close()
        await self.runner.stop()
        if self._web is not None:
            await self._web.cleanup()
        for publisher in self.publishers.values():
            publisher.close()

    def publish(self, events: Events) -> None:
        """Each batch on its kv_group's stream; a failure is logged, never the engine's."""
        for group, batch in events.items():
            try:
                self.publishers[group].publish(batch, ts=time.time())
            except Exception:
                log.exception("publishing KV events failed")

    async def invalidate(self, request: web.Request) -> web.Response:
        asked = parse_invalidate(await read_json(request))
        done, events = await self.runner.call(lambda: self.engine.invalidate(asked))
        self.publish(events)
        return json_response(done)

    async def info(self, request: web.Request) -> web.Response:
        streams = {g: events_document(p, request) for g, p in self.publishers.items()}
        load = self.runner.load()
        doc: dict[str, Any] = {
            "engine": self.engine.name,
            "incarnation": self.incarnation,
            # an adapter's entry names no stream: its blocks ride its base's, by lora_name
            "models": [
                m.info() if m.base else {**m.info(), "kv_events": streams[m.kv_group]}
                for m in self.engine.models.values()
            ],
            "block_size": self.engine.block_size,
            **self.engine.info(),
            "capacity_tokens": load.capacity_tokens,
            "load": {k: getattr(load, k) for k in ENGINE_LOAD},
        }
        if len(self.groups) == 1:
            doc["kv_events"] = streams[self.groups[0]]
        if load.max_loras:
            doc["lora"] = {"max_loras": load.max_loras, "active": list(load.lora_active)}
        if self.load_publisher is not None:
            endpoint = reachable_endpoint(self.load_publisher.endpoint, request)
            doc["load_events"] = {"endpoint": endpoint}
        return json_response(doc)

    async def load(self, request: web.Request) -> web.Response:
        """The queue as the engine holds it (docs/workers.md, `GET /urc/load`); gateways
        subscribe to the same document (`load_events` in /urc/info) rather than poll it."""
        return json_response(self.load_document())

    def load_document(self) -> dict[str, Any]:
        """One dict, no engine call beyond `load()`."""
        load = self.runner.load()
        page = self.engine.block_size
        doc = {
            "waiting": load.waiting,
            "running": load.running,
            "queued_prefill_tokens": load.queued_prefill_tokens,
            "running_decode": load.decoding,
            "free_kv_pages": (load.capacity_tokens - load.used_tokens) // page,
            "total_kv_pages": load.capacity_tokens // page,
            "time": time.time(),
        }
        if load.max_loras:  # adapters on: their slots
            doc["lora_active"] = list(load.lora_active)
            doc["max_loras"] = load.max_loras
        return doc

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


def parse_invalidate(body: Any) -> InvalidateRequest:
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    for field in ("salt", "salt_prefix", "kv_group"):
        value = body.get(field)
        if value is not None and (not isinstance(value, str) or not value):
            raise APIError(400, f"'{field}' must be a non-empty string", param=field)
    salt, prefix = body.get("salt"), body.get("salt_prefix")
    if salt is not None and prefix is not None:
        raise APIError(400, "send 'salt' or 'salt_prefix', not both", param="salt")
    scope = None if salt is None and prefix is None else salt_scope(salt, prefix)
    return InvalidateRequest(scope, body.get("kv_group"))


def reachable_endpoint(endpoint: str | None, request: web.Request) -> str | None:
    """A bound ZMQ endpoint as a client can reach it (a wildcard host: the one it asked)."""
    if endpoint is None:
        return None
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if host.strip("[]") in _ANY_HOST:
        host = request.url.host or "127.0.0.1"
    return f"{scheme}://{host}:{port}"


def events_document(publisher: KVEventPublisher, request: web.Request) -> dict[str, str | None]:
    return {
        "endpoint": reachable_endpoint(publisher.endpoint, request),
        "replay_endpoint": reachable_endpoint(publisher.replay_endpoint, request),
        "topic": KV_TOPIC,
    }


# -- the command line ------------------------------------------------------------------------


Flag = tuple[Any, ...]  # (flag, type, default, help), then its choices if it has any


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    for flag, kind, default, help_text, *choices in flags:
        allowed = choices[0] if choices else None
        parser.add_argument(flag, type=kind, default=default, help=help_text, choices=allowed)


def worker_parser(
    engine: str, description: str, max_model_len_help: str, kv_port_note: str = ""
) -> argparse.ArgumentParser:
    """`urc worker --engine ENGINE` with the flags every worker shares; the engine adds its own."""
    parser = argparse.ArgumentParser(
        prog=f"urc worker --engine {engine}",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--engine", choices=[engine], default=engine, help="the engine")
    add_flags(
        parser,
        [
            ("--host", str, "127.0.0.1", "the address to serve on"),
            ("--port", int, 0, "HTTP port (0: any free port)"),
            ("--default-max-tokens", int, 256, "output length when a chat sets none"),
            ("--kv-events-port", int, 0, f"ZMQ PUB port for KV events (0: any){kv_port_note}"),
            ("--kv-replay-port", int, 0, f"ZMQ ROUTER port for replays (0: any){kv_port_note}"),
            ("--load-events-port", int, 0, "ZMQ PUB port of the worker's load (0: any)"),
            ("--load-publish-ms", float, 20.0, "how often a changed load is published (0: never)"),
            ("--max-body-mb", float, 32.0, "larger request bodies get 413"),
            ("--log-level", str.lower, "info", "the lowest level logged", LEVELS),
            ("--log-format", str, "text", "text or json lines (docs/operability.md)", FORMATS),
            ("--max-model-len", int, 0, max_model_len_help),
        ],
    )
    add_lora_flags(parser)
    return parser


async def serve_until_signal(worker: Worker) -> None:
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


def run_worker(
    parser: argparse.ArgumentParser,
    build: Callable[[argparse.Namespace], Engine],
    argv: Sequence[str] | None,
) -> int:
    """Parse the flags, build the engine (a ValueError is a usage error) and serve it."""
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        if args.max_model_len < 0 or args.default_max_tokens < 1 or args.max_body_mb <= 0:
            raise ValueError(
                "need --max-model-len >= 0, --default-max-tokens >= 1 and --max-body-mb > 0"
            )
        engine = build(args)
        load_lora_modules(engine, args)
    except ValueError as exc:
        parser.error(str(exc))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_until_signal(Worker(engine, args)))
    return 0
