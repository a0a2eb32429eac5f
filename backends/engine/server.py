"""`urc worker --engine torch`: the torch worker's HTTP server.

One or more models on one device (`--model [NAME=]SPEC`, repeatable; SPEC a preset such as
`tiny` or a Hugging Face directory), all drawing KV pages from one pool per KV layout, served
over OpenAI's API and SGLang's native API (backends/http/), with `/metrics` and the discovery
document the gateway reads, `GET /urc/info`:

    {"engine": "torch", "incarnation": <uuid hex per process>, "block_size": 16,
     "device": "cpu",
     "models": [{"name", "kv_group", "fingerprint", "tokenizer", "max_model_len",
                 "kv_events": {"endpoint", "replay_endpoint", "topic"}}],
     "kv_events": {...},                 only when all models share one kv_group
     "pools": [{"kv_groups", "pages", "page_size", "layers", "kv_heads", "head_dim", "dtype"}],
     "capacity_tokens": N, "load": {"running", "waiting", "queued_prefill_tokens"}}

Each kv_group has its own KV-event stream (a PUB socket and a replay socket): the events carry
no model, so one stream must mean one kv_group. Block hashes are our own block keys. The
process prints `ready: http://HOST:PORT` once it serves, and exits cleanly on SIGINT/SIGTERM.
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
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from backends.engine.engine import EngineConfig, TorchEngine, default_device
from backends.engine.loader import LoadedModel, load_model
from backends.engine.metrics import CONTENT_TYPE, WorkerMetrics
from backends.engine.runner import EngineThread
from backends.engine.scheduler import SchedulerConfig
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

ENGINE = "torch"
VERSION = "urc-torch-0.1"


@dataclass(slots=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    models: list[tuple[str, str]] = field(default_factory=lambda: [("tiny", "tiny")])
    device: str = "auto"  # "auto": cuda when available
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int = 0  # 0: the model's
    default_max_tokens: int = 256
    kv_events_port: int = 0  # kv_group i publishes on this + i (0: any free port)
    kv_replay_port: int = 0
    max_body_bytes: int = 32 * 1024 * 1024
    engine: EngineConfig = field(default_factory=EngineConfig)


def load_models(config: WorkerConfig, device: torch.device) -> dict[str, LoadedModel]:
    """Served name -> weights; a spec named twice is loaded once."""
    by_spec: dict[str, LoadedModel] = {}
    served: dict[str, LoadedModel] = {}
    for name, spec in config.models:
        if name in served:
            raise ValueError(f"model name {name!r} given twice")
        if spec not in by_spec:
            by_spec[spec] = load_model(
                spec,
                device=device,
                dtype=config.dtype,
                page_size=config.engine.page_size,
                load_format=config.load_format,
                seed=config.seed,
                max_model_len=config.max_model_len,
            )
        served[name] = by_spec[spec]
    return served


class TorchWorker:
    """The worker: `await start()`, then it serves until `await stop()`."""

    def __init__(self, config: WorkerConfig, served: dict[str, LoadedModel]) -> None:
        self.config = config
        self.incarnation = uuid.uuid4().hex
        self.engine = TorchEngine(served, config.engine)
        self.models = {
            name: ServedModel(
                name=name,
                kv_group=loaded.kv_group,
                fingerprint=loaded.fingerprint,
                tokenizer=loaded.tokenizer,
                tokenizer_spec=loaded.tokenizer_spec,
                max_model_len=loaded.max_model_len,
                default_max_tokens=config.default_max_tokens,
                vocab_size=loaded.config.vocab_size,
            )
            for name, loaded in served.items()
        }
        self.groups = list(dict.fromkeys(m.kv_group for m in self.models.values()))
        self.publishers: dict[str, KVEventPublisher] = {}
        self.runner = EngineThread(self.engine, self._publish)
        self.metrics = WorkerMetrics(self.engine, lambda: self.runner.engine_load)
        self._web: web.AppRunner | None = None
        self.port = config.port
        self.url = ""

    async def start(self) -> None:
        cfg = self.config
        for i, group in enumerate(self.groups):
            pub_port = cfg.kv_events_port + i if cfg.kv_events_port else 0
            replay_port = cfg.kv_replay_port + i if cfg.kv_replay_port else 0
            self.publishers[group] = KVEventPublisher(
                f"tcp://{cfg.host}:{pub_port}", f"tcp://{cfg.host}:{replay_port}", topic=KV_TOPIC
            )
        self.runner.start(asyncio.get_running_loop())
        app = web.Application(middlewares=[error_middleware], client_max_size=cfg.max_body_bytes)
        OpenAIApi(self.runner, self.models, int(time.time())).add_routes(app)
        SGLangApi(self.runner, self.models, self.server_args, self.model_info, VERSION).add_routes(
            app
        )
        app.router.add_get("/urc/info", self.info)
        app.router.add_post("/urc/invalidate", self.invalidate)
        app.router.add_get("/metrics", self.metrics_handler)
        self._web, self.port = await listen(app, cfg.host, cfg.port)
        self.url = f"http://{cfg.host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.stop()
        if self._web is not None:
            await self._web.cleanup()
        for publisher in self.publishers.values():
            publisher.close()

    def _publish(self, group: str, events: list[KVEvent]) -> None:
        self.publishers[group].publish(events, ts=time.time())

    async def invalidate(self, request: web.Request) -> web.Response:
        """Drop a scope of the cache now (backends/http/invalidate.py), on the engine thread."""
        asked = parse_invalidate(await read_json(request))

        def run() -> dict[str, int]:
            done, events = self.engine.invalidate(asked.scope, asked.kv_group)
            for group, batch in events.items():  # pending stores first, then the removals
                self._publish(group, batch)
            return done._asdict()

        return json_response(await self.runner.call(run))

    # -- documents -------------------------------------------------------------------------------

    async def info(self, request: web.Request) -> web.Response:
        engine = self.engine
        models = [
            {**m.info(), "kv_events": events_document(self.publishers[m.kv_group], request)}
            for m in self.models.values()
        ]
        pools = []
        for layout, state in engine.pools.items():
            groups = [g for g, ms in engine.models.items() if ms.pool is state]
            pools.append(
                {
                    "kv_groups": groups,
                    "pages": state.memory.capacity,
                    "page_size": layout.page_size,
                    "layers": layout.layers,
                    "kv_heads": layout.kv_heads,
                    "head_dim": layout.head_dim,
                    "dtype": str(layout.dtype).removeprefix("torch."),
                }
            )
        doc: dict[str, Any] = {
            "engine": ENGINE,
            "incarnation": self.incarnation,
            "block_size": engine.config.page_size,
            "device": str(next(iter(engine.models.values())).loaded.device),
            "models": models,
            "pools": pools,
            "capacity_tokens": self.runner.load().capacity_tokens,
            "load": self.runner.engine_load._asdict(),
        }
        if len(self.groups) == 1:
            doc["kv_events"] = events_document(self.publishers[self.groups[0]], request)
        return json_response(doc)

    def model_info(self, model: ServedModel) -> dict[str, Any]:
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}

    def server_args(self) -> dict[str, Any]:
        """The worker's settings under SGLang's names (for /get_server_info)."""
        cfg = self.config
        first = next(iter(self.models.values()))
        sched = cfg.engine.scheduler
        return {
            "model_path": first.name,
            "served_model_name": first.name,
            "tokenizer_path": first.tokenizer_spec,
            "host": cfg.host,
            "port": self.port,
            "page_size": cfg.engine.page_size,
            "max_total_num_tokens": self.runner.load().capacity_tokens,
            "max_running_requests": sched.max_running,
            "chunked_prefill_size": sched.chunk_size,
            "context_length": first.max_model_len,
            "max_req_input_len": first.max_model_len - 1,
            "tp_size": 1,
            "dp_size": 1,
            "disaggregation_mode": "null",
            "disable_radix_cache": not sched.prefix_cache,
            "kv_group": first.kv_group,
            "incarnation": self.incarnation,
        }

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


# -- the command line --------------------------------------------------------------------------


def _model_arg(value: str) -> tuple[str, str]:
    """`NAME=SPEC` or `SPEC` (named after the preset or the directory)."""
    name, sep, spec = value.partition("=")
    if not sep:
        spec = value
        name = Path(value).name if Path(value).is_dir() else value
    if not name or not spec:
        raise argparse.ArgumentTypeError(f"expected [NAME=]SPEC, got {value!r}")
    return name, spec


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    s = SchedulerConfig()
    parser = argparse.ArgumentParser(
        prog="urc worker --engine torch",
        description=(
            "A PyTorch worker: Llama-architecture models with SGLang-style radix attention over "
            "one KV page pool shared by all models, served over OpenAI's and SGLang's HTTP APIs, "
            "publishing vLLM-format KV events (one stream per kv_group)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--engine", choices=[ENGINE], default=ENGINE, help="the engine")
    add_serving_arguments(parser, "; kv_group i: this + i")
    parser.add_argument(
        "--model",
        type=_model_arg,
        action="append",
        default=None,
        metavar="[NAME=]SPEC",
        help="a served model (repeatable): a preset (tiny, llama-3.2-1b: random weights) or a "
        "Hugging Face directory; NAME=SPEC serves SPEC as NAME (default: tiny)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda if any)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument(
        "--load-format",
        choices=["auto", "safetensors", "dummy"],
        default="auto",
        help="dummy: random weights of the model's shape",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of random (dummy) weights")
    parser.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    parser.add_argument(
        "--kv-cache-mb", type=float, default=d.kv_cache_mb, help="KV memory, all pools together"
    )
    parser.add_argument(
        "--num-pages", type=int, default=0, help="pages per pool (overrides --kv-cache-mb)"
    )
    parser.add_argument(
        "--chunk-size", type=int, default=s.chunk_size, help="prefill tokens per forward pass"
    )
    parser.add_argument(
        "--max-running", type=int, default=s.max_running, help="requests in a model's batch"
    )
    parser.add_argument(
        "--disable-prefix-cache", action="store_true", help="compute every prompt token"
    )
    parser.add_argument(
        "--attention", choices=["auto", "torch", "flashinfer"], default="auto", help="kernels"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    parser.add_argument(
        "--max-model-len", type=int, default=0, help="context length (0: the model's)"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """ValueError on settings that cannot work."""
    if args.page_size < 1 or args.kv_cache_mb <= 0 or args.num_pages < 0:
        raise ValueError("need --page-size >= 1, --kv-cache-mb > 0 and --num-pages >= 0")
    if args.max_model_len < 0 or args.default_max_tokens < 1 or args.max_body_mb <= 0:
        raise ValueError(
            "need --max-model-len >= 0, --default-max-tokens >= 1 and --max-body-mb > 0"
        )
    scheduler = SchedulerConfig(
        chunk_size=args.chunk_size,
        max_running=args.max_running,
        prefix_cache=not args.disable_prefix_cache,
    )
    engine = EngineConfig(
        page_size=args.page_size,
        kv_cache_mb=args.kv_cache_mb,
        num_pages=args.num_pages,
        attention=args.attention,
        scheduler=scheduler,
    )
    return WorkerConfig(
        host=args.host,
        port=args.port,
        models=args.model or [("tiny", "tiny")],
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        seed=args.seed,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        engine=engine,
    )


async def serve(config: WorkerConfig, served: dict[str, LoadedModel]) -> None:
    """Run a worker until SIGINT or SIGTERM."""
    await serve_until_signal(TorchWorker(config, served))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        config = config_from_args(args)
        device = default_device() if config.device == "auto" else torch.device(config.device)
        served = load_models(config, device)
    except ValueError as exc:
        parser.error(str(exc))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config, served))
    return 0


if __name__ == "__main__":
    sys.exit(main())
