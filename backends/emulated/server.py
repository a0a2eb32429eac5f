"""`urc worker --engine emulated`: the emulated GPU worker's HTTP server.

A thin aiohttp shell around EmulatedEngine (engine.py), stepped in real time by EngineRunner:
OpenAI's API and SGLang's native API (backends/http/, shared with the torch worker),
`/metrics`, and the discovery document the gateway reads, `GET /urc/info`:

    {"engine": "emulated", "incarnation": <uuid hex per process>, "block_size": 16,
     "models": [{"name", "kv_group", "fingerprint", "tokenizer": "byte", "max_model_len"}],
     "kv_events": {"endpoint": "tcp://127.0.0.1:P", "replay_endpoint": "tcp://127.0.0.1:R",
                   "topic": "kv"},
     "capacity_tokens": N, "load": {"running", "waiting", "queued_prefill_tokens"}}

The KV events of every step go out on a ZMQ publisher (core/kv_publisher.py, map encoding so
that `cache_salt` travels), block hashes being our own block keys. The process prints
`ready: http://HOST:PORT` once it serves, and exits cleanly on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from backends.cache.scopes import invalidate
from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from backends.emulated.metrics import CONTENT_TYPE, WorkerMetrics
from backends.emulated.model import ENGINE, served_model
from backends.emulated.runner import EngineRunner
from backends.http.cli import add_serving_arguments, listen, serve_until_signal
from backends.http.errors import error_middleware, json_response, read_json
from backends.http.invalidate import parse_invalidate
from backends.http.kv_events_doc import KV_TOPIC, events_document
from backends.http.openai_api import OpenAIApi
from backends.http.served_model import ServedModel
from backends.http.sglang_api import SGLangApi
from core.kv_events import KVEvent
from core.kv_publisher import KVEventPublisher

log = logging.getLogger(__name__)

VERSION = "urc-emulated-0.1"


@dataclass(slots=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    model: str = "emulated"
    kv_group: str | None = None  # None: the model name
    max_model_len: int = 0  # 0: min(capacity, 131072)
    default_max_tokens: int = 256
    kv_events_port: int = 0
    kv_replay_port: int = 0
    max_body_bytes: int = 32 * 1024 * 1024  # larger bodies get 413
    engine: EngineConfig = field(default_factory=EngineConfig)


class EmulatedWorker:
    """The worker: `await start()`, then it serves until `await stop()`."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.incarnation = uuid.uuid4().hex
        engine_cfg = config.engine
        max_len = config.max_model_len or min(engine_cfg.capacity_tokens, 131_072)
        self.model = served_model(
            config.model,
            config.kv_group or config.model,
            engine_cfg.block_size,
            max_len,
            config.default_max_tokens,
        )
        self.engine = EmulatedEngine(engine_cfg)
        self.metrics = WorkerMetrics(self.engine, config.model)
        self.publisher: KVEventPublisher | None = None
        self.runner: EngineRunner | None = None
        self._web: web.AppRunner | None = None
        self.port = config.port
        self.url = ""

    async def start(self) -> None:
        cfg = self.config
        self.publisher = KVEventPublisher(
            f"tcp://{cfg.host}:{cfg.kv_events_port}",
            f"tcp://{cfg.host}:{cfg.kv_replay_port}",
            topic=KV_TOPIC,
        )
        self.runner = EngineRunner(self.engine, self._publish)
        created = int(time.time())
        app = web.Application(middlewares=[error_middleware], client_max_size=cfg.max_body_bytes)
        models = {self.model.name: self.model}
        OpenAIApi(self.runner, models, created).add_routes(app)
        SGLangApi(self.runner, models, self.server_args, self.model_info, VERSION).add_routes(app)
        app.router.add_get("/urc/info", self.info)
        app.router.add_post("/urc/invalidate", self.invalidate)
        app.router.add_get("/metrics", self.metrics_handler)
        self._web, self.port = await listen(app, cfg.host, cfg.port)
        self.url = f"http://{cfg.host}:{self.port}"
        self.runner.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self._web is not None:
            await self._web.cleanup()
        if self.publisher is not None:
            self.publisher.close()

    def _publish(self, events: list[KVEvent]) -> None:
        assert self.publisher is not None
        self.publisher.publish(events, ts=time.time())

    async def invalidate(self, request: web.Request) -> web.Response:
        """Drop a scope of the cache now (backends/http/invalidate.py)."""
        asked = parse_invalidate(await read_json(request))
        if asked.kv_group not in (None, self.model.kv_group):
            return json_response({"freed_blocks": 0, "locked_blocks": 0})
        done = invalidate(self.engine.cache, asked.scope)
        if events := self.engine.drain_events():  # pending stores first, then the removals
            self._publish(events)
        return json_response(done._asdict())

    # -- documents ---------------------------------------------------------------------------

    async def info(self, request: web.Request) -> web.Response:
        assert self.publisher is not None
        load = self.engine.load()
        return json_response(
            {
                "engine": ENGINE,
                "incarnation": self.incarnation,
                "block_size": self.config.engine.block_size,
                "models": [self.model.info()],
                "kv_events": events_document(self.publisher, request),
                "capacity_tokens": self.engine.cache.capacity_tokens,
                "load": load._asdict(),
            }
        )

    def model_info(self, model: ServedModel) -> dict[str, Any]:
        return {"model_type": "emulated", "architectures": ["EmulatedForCausalLM"]}

    def server_args(self) -> dict[str, Any]:
        """The worker's settings under SGLang's names (for /get_server_info)."""
        eng = self.config.engine
        return {
            "model_path": self.model.name,
            "served_model_name": self.model.name,
            "tokenizer_path": "byte",
            "host": self.config.host,
            "port": self.port,
            "page_size": eng.block_size,
            "max_total_num_tokens": self.engine.cache.capacity_tokens,
            "max_running_requests": eng.max_batch,
            "chunked_prefill_size": eng.chunk_tokens,
            "context_length": self.model.max_model_len,
            "max_req_input_len": self.model.max_model_len - 1,
            "tp_size": 1,
            "dp_size": 1,
            "disaggregation_mode": "null",
            "kv_group": self.model.kv_group,
            "incarnation": self.incarnation,
        }

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


# -- the command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    parser = argparse.ArgumentParser(
        prog="urc worker --engine emulated",
        description=(
            "An emulated GPU worker: a real radix KV cache with modelled time, served over "
            "OpenAI's and SGLang's HTTP APIs, publishing vLLM-format KV events. Defaults "
            "model an 8B bf16 model on one H100 SXM 80GB: prefill 15k tokens/s, decode step "
            "8 ms + 0.08 ms per running request, 400k tokens of KV, batch 256, chunks of 8192."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--engine", choices=[ENGINE], default=ENGINE, help="the engine")
    add_serving_arguments(parser)
    parser.add_argument("--model", default="emulated", help="the served model name")
    parser.add_argument(
        "--kv-group", default=None, help="KV-identity group (unset: the model name)"
    )
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block")
    parser.add_argument(
        "--capacity-tokens", type=int, default=d.capacity_tokens, help="KV pool size in tokens"
    )
    parser.add_argument(
        "--prefill-tps", type=float, default=d.prefill_tokens_per_s, help="prefill tokens/s"
    )
    parser.add_argument(
        "--decode-base-ms", type=float, default=d.decode_base_s * 1e3, help="decode step, ms"
    )
    parser.add_argument(
        "--decode-per-request-ms",
        type=float,
        default=d.decode_per_request_s * 1e3,
        help="added to a decode step per running request, ms",
    )
    parser.add_argument("--max-batch", type=int, default=d.max_batch, help="running requests")
    parser.add_argument(
        "--chunk-tokens", type=int, default=d.chunk_tokens, help="prefill tokens per step"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=0, help="context length (0: min(capacity, 131072))"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """ValueError on settings that cannot work."""
    engine = EngineConfig(
        block_size=args.block_size,
        capacity_tokens=args.capacity_tokens,
        prefill_tokens_per_s=args.prefill_tps,
        decode_base_s=args.decode_base_ms / 1e3,
        decode_per_request_s=args.decode_per_request_ms / 1e3,
        max_batch=args.max_batch,
        chunk_tokens=args.chunk_tokens,
    )
    if args.max_model_len < 0 or args.default_max_tokens < 1 or args.max_body_mb <= 0:
        raise ValueError(
            "need --max-model-len >= 0, --default-max-tokens >= 1 and --max-body-mb > 0"
        )
    return WorkerConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        kv_group=args.kv_group,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        engine=engine,
    )


async def serve(config: WorkerConfig) -> None:
    """Run a worker until SIGINT or SIGTERM."""
    await serve_until_signal(EmulatedWorker(config))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
