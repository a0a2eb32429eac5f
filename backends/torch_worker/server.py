"""`urc worker --engine torch`: TorchEngine in the worker HTTP shell, its forward passes on a
thread of their own; several models share one KV page pool per layout (docs/workers.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from prometheus_client.core import GaugeMetricFamily, Metric

from backends.http.generation import Generation, ServedModel, WorkerLoad
from backends.http.lora_api import lora_metrics
from backends.http.runner import Events, InvalidateRequest, counter, gauge
from backends.http.worker import add_flags, run_worker, worker_parser
from backends.torch_worker.embedding import embed
from backends.torch_worker.engine import EngineConfig, StepResult, TorchEngine, default_device
from backends.torch_worker.loader import LoadedModel, load_model
from backends.torch_worker.request import Request, Status
from backends.torch_worker.scheduler import SchedulerConfig
from core.settings import add_setting_flags, from_flags

ENGINE = "torch"

_PER_MODEL = (  # (metric, doc, ModelCounters field); the emulated engine's names and docs
    ("urc_engine_requests", "Requests finished", "requests"),
    ("urc_engine_generated_tokens", "Output tokens generated", "generated_tokens"),
    ("urc_engine_prompt_tokens", "Prompt tokens admitted", "prompt_tokens"),
    ("urc_engine_cached_tokens", "Prompt tokens found in the KV cache", "cached_tokens"),
    ("urc_engine_host_hit_tokens", "Of those, promoted from the host tier", "host_hit_tokens"),
)
_PER_POOL = (  # (metric, doc, the cache's token counts it sums, reported in pages)
    ("urc_engine_pool_pages", "KV pages in the pool (page 0 excluded)", ("capacity_tokens",)),
    ("urc_engine_pool_free_pages", "KV pages free", ("free_tokens",)),
    (
        "urc_engine_pool_cached_pages",
        "KV pages in the radix cache",
        ("evictable_tokens", "protected_tokens"),
    ),
    ("urc_engine_pool_in_use_pages", "KV pages held privately by requests", ("allocated_tokens",)),
)
_PER_HOST_TIER = (  # (metric, doc, HostStats field, counter): per pool that has a host tier
    ("urc_engine_host_pages", "Host-tier KV pages", "capacity_tokens", False),
    ("urc_engine_host_free_pages", "Host-tier KV pages free", "free_tokens", False),
    ("urc_engine_host_cached_pages", "Host-tier KV pages holding blocks", "cached_tokens", False),
    ("urc_engine_host_demoted_pages", "Pages demoted to the host tier", "demoted_blocks", True),
    ("urc_engine_host_promoted_pages", "Pages copied back to the GPU", "promoted_blocks", True),
    ("urc_engine_host_evicted_pages", "Pages the host tier dropped", "evicted_blocks", True),
)


class TorchSide:
    """The torch engine in the worker shell (backends/http/runner.py): a step is a forward pass
    per model, so it runs on a thread of its own, due as soon as there is work."""

    name = ENGINE
    version = "urc-torch-0.1"
    blocking = True
    model_info = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}

    def __init__(
        self,
        served: dict[str, LoadedModel],
        config: EngineConfig,
        default_max_tokens: int,
        enable_lora: bool = False,
    ) -> None:
        self.config = config
        self.enable_lora = enable_lora
        self.engine = TorchEngine(served, config)
        self.models = {
            name: ServedModel(
                name=name,
                kv_group=loaded.kv_group,
                fingerprint=loaded.fingerprint,
                tokenizer=loaded.tokenizer,
                tokenizer_spec=loaded.tokenizer_spec,
                max_model_len=loaded.max_model_len,
                default_max_tokens=default_max_tokens,
                vocab_size=loaded.config.vocab_size,
            )
            for name, loaded in served.items()
        }
        self.block_size = config.page_size

    def request(self, gen: Generation) -> Request:
        """Checked on the loop: `validate` reads only what never changes."""
        req = self.engine.new_request(gen.model.name, gen.prompt, gen.sampling, gen.cache_salt)
        if gen.cache_salt:  # shared isolation: the public part, whole blocks of the prompt
            page = self.config.page_size
            req.public_blocks = min(gen.public_tokens // page, len(gen.prompt) // page)
        req.priority = gen.priority
        req.protect = gen.protect
        self.engine.validate(req)
        return req

    def submit(self, req: Request) -> None:
        self.engine.submit(req)

    def abort(self, req: Request) -> None:
        self.engine.abort(req)

    def due_in(self) -> float | None:
        return 0.0 if self.engine.has_work() else None

    def step(self) -> StepResult:
        return self.engine.step()

    def advance(self, result: StepResult, live: dict[Any, Generation]) -> Events:
        touched = {r.rid: r for r in result.admitted + result.emitted + result.finished}
        for rid, req in touched.items():
            if (gen := live.get(rid)) is None:
                continue
            if req.status is Status.FINISHED:
                del live[rid]
            gen.output.extend(req.output[len(gen.output) :])
            if req.admitted and not gen.admitted:
                gen.cached_tokens = req.cached_tokens
                gen.admitted = True
            gen.finish_reason = req.finish_reason
            gen.changed.set()
        return result.events

    def load(self) -> WorkerLoad:
        pools = self.engine.pools.values()
        capacity = sum(p.memory.capacity for p in pools) * self.config.page_size
        used = sum(p.cache.capacity_tokens - p.cache.free_tokens for p in pools)
        load = self.engine.load()
        queued, decoding = load.queued_prefill_tokens, load.decoding
        out = WorkerLoad(load.running, load.waiting, used, capacity, queued, decoding)
        if not self.enable_lora:
            return out
        slots = self.engine.adapters.slots
        return out._replace(lora_active=tuple(slots.active), max_loras=slots.max_loras)

    def load_adapter(self, name: str, path: str) -> ServedModel:
        """Reads the adapter's files (small: on the loop's thread, between steps)."""
        self.engine.load_adapter(name, path)
        model = self.models[name] = next(iter(self.models.values())).adapter(name, path)
        return model

    def unload_adapter(self, name: str) -> Events:
        events = self.engine.unload_adapter(name)
        del self.models[name]
        return events

    def invalidate(self, asked: InvalidateRequest) -> tuple[dict[str, int], Events]:
        done, events = self.engine.invalidate(asked.scope, asked.kv_group)
        return done._asdict(), events

    def embed(self, model: ServedModel, prompts: list[list[int]]) -> list[list[float]]:
        """Mean-pooled last hidden states (backends/torch_worker/embedding.py), on the step
        thread between steps."""
        loaded = self.engine.served[model.name]
        return [embed(loaded, prompt) for prompt in prompts]

    def info(self) -> dict[str, Any]:
        engine = self.engine
        pools = []
        for layout, state in engine.pools.items():
            groups = [g for g, ms in engine.models.items() if ms.pool is state]
            host = state.host
            pools.append(
                {
                    "kv_groups": groups,
                    "pages": state.memory.capacity,
                    "host_pages": 0 if host is None else host.capacity_blocks,
                    "page_size": layout.page_size,
                    "layers": layout.layers,
                    "kv_heads": layout.kv_heads,
                    "head_dim": layout.head_dim,
                    "dtype": str(layout.dtype).removeprefix("torch."),
                }
            )
        device = str(next(iter(engine.models.values())).loaded.device)
        tiers = [p.host for p in engine.pools.values() if p.host is not None]
        host_tokens = sum(tier.capacity_tokens for tier in tiers)
        return {"device": device, "host_capacity_tokens": host_tokens, "pools": pools}

    def settings(self) -> dict[str, Any]:
        sched = self.config.scheduler
        return {
            "max_running_requests": sched.max_running,
            "chunked_prefill_size": sched.chunk_size,
            "disable_radix_cache": not sched.prefix_cache,
        }

    def collect(self) -> Iterator[Metric]:
        """Per served model, per page pool and per kv_group; plain ints the engine thread writes,
        so one scrape may straddle a step."""
        engine = self.engine
        for metric, doc, attr in _PER_MODEL:
            counters = engine.counters.items()
            yield counter(metric, doc, "model", [(m, getattr(c, attr)) for m, c in counters])
        load = self.engine.load()
        yield GaugeMetricFamily(
            "urc_engine_running_requests", "Requests in the batch", load.running
        )
        yield GaugeMetricFamily(
            "urc_engine_waiting_requests", "Requests in the queue", load.waiting
        )
        pools = list(engine.pools.values())
        stats = [(state.cache.stats(), state.cache.block_size) for state in pools]
        for metric, doc, fields in _PER_POOL:
            samples = [
                (str(i), sum(getattr(s, f) for f in fields) // size)
                for i, (s, size) in enumerate(stats)
            ]
            yield gauge(metric, doc, "pool", samples)
        shares = [(g, tree.blocks) for state in pools for g, tree in state.cache.trees.items()]
        yield gauge(
            "urc_engine_kv_group_cached_pages", "Pages in a kv_group's tree", "kv_group", shares
        )
        evicted = [(str(i), state.cache.evicted_blocks) for i, state in enumerate(pools)]
        yield counter("urc_engine_evicted_pages", "Pages evicted", "pool", evicted)
        hosts = [(str(i), s.host) for i, s in enumerate(pools) if s.host is not None]
        for metric, doc, attr, is_counter in _PER_HOST_TIER if hosts else ():
            unit = 1 if is_counter else hosts[0][1].block_size  # blocks, or tokens -> pages
            samples = [(i, getattr(host.stats(), attr) // unit) for i, host in hosts]
            yield (counter if is_counter else gauge)(metric, doc, "pool", samples)
        if self.enable_lora:
            yield from lora_metrics(engine.adapters.slots, next(iter(self.models)))


def load_models(args: argparse.Namespace, page_size: int) -> dict[str, LoadedModel]:
    """Served name -> weights; a spec named twice is loaded once."""
    device = default_device() if args.device == "auto" else torch.device(args.device)
    by_spec: dict[str, LoadedModel] = {}
    served: dict[str, LoadedModel] = {}
    for name, spec in args.model or [("tiny", "tiny")]:
        if name in served:
            raise ValueError(f"model name {name!r} given twice")
        if spec not in by_spec:
            by_spec[spec] = load_model(
                spec,
                device=device,
                dtype=args.dtype,
                page_size=page_size,
                load_format=args.load_format,
                seed=args.seed,
                max_model_len=args.max_model_len,
            )
        served[name] = by_spec[spec]
    return served


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
    parser = worker_parser(
        ENGINE,
        "A PyTorch worker: Llama-architecture models with SGLang-style radix attention over "
        "one KV page pool shared by all models, served over OpenAI's and SGLang's HTTP APIs, "
        "publishing vLLM-format KV events (one stream per kv_group).",
        "context length (0: the model's)",
        "; kv_group i: this + i",
    )
    parser.add_argument(
        "--model",
        type=_model_arg,
        action="append",
        default=None,
        metavar="[NAME=]SPEC",
        help="a served model (repeatable): a preset (tiny, llama-3.2-1b: random weights) or a "
        "Hugging Face directory; NAME=SPEC serves SPEC as NAME (default: tiny)",
    )
    dummy = "dummy: random weights of the model's shape"
    add_flags(
        parser,
        [
            ("--device", str, "auto", "cpu, cuda, cuda:N (auto: cuda if any)"),
            ("--dtype", str, "auto", "auto, float32, bfloat16, float16"),
            ("--load-format", str, "auto", dummy, ["auto", "safetensors", "dummy"]),
            ("--seed", int, 0, "seed of random (dummy) weights"),
        ],
    )
    add_setting_flags(parser, EngineConfig)
    add_setting_flags(parser, SchedulerConfig)
    parser.add_argument(
        "--disable-prefix-cache", action="store_true", help="compute every prompt token"
    )
    add_flags(
        parser,
        [
            ("--attention", str, "auto", "kernels", ["auto", "torch", "flashinfer"]),
            ("--threads", int, 0, "torch CPU threads (0: torch's)"),
        ],
    )
    return parser


def build_engine(args: argparse.Namespace) -> TorchSide:
    """ValueError on settings that cannot work."""
    scheduler = from_flags(SchedulerConfig, args, prefix_cache=not args.disable_prefix_cache)
    config = from_flags(EngineConfig, args, attention=args.attention, scheduler=scheduler)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    served = load_models(args, config.page_size)
    return TorchSide(served, config, args.default_max_tokens, args.enable_lora)


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker(build_parser(), build_engine, argv)


if __name__ == "__main__":
    sys.exit(main())
