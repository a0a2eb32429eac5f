"""`urc worker --engine emulated`: EmulatedEngine in the worker HTTP shell, stepped in real time;
one model on the byte tokenizer (docs/workers.md)."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import Metric

from backends.emulated.config import EngineConfig
from backends.emulated.embedding import embed
from backends.emulated.engine import EmulatedEngine, StepResult
from backends.emulated.request import Request, output_bytes
from backends.http.generation import Generation, ServedModel, WorkerLoad
from backends.http.lora_api import lora_metrics
from backends.http.runner import Events, InvalidateRequest, counter, gauge
from backends.http.worker import add_flags, run_worker, worker_parser
from core.settings import add_setting_flags, from_flags
from core.tokenizer import ByteTokenizer, write_byte_tokenizer

ENGINE = "emulated"

_METRICS = (  # (family, metric, doc): the torch worker's names
    (counter, "urc_engine_requests", "Requests finished"),
    (counter, "urc_engine_prompt_tokens", "Prompt tokens admitted"),
    (counter, "urc_engine_cached_tokens", "Prompt tokens found in the KV cache"),
    (counter, "urc_engine_generated_tokens", "Output tokens generated"),
    (counter, "urc_engine_evicted_blocks", "KV blocks evicted"),
    (counter, "urc_engine_stored_blocks", "KV blocks cached"),
    (gauge, "urc_engine_running_requests", "Requests in the batch"),
    (gauge, "urc_engine_waiting_requests", "Requests in the queue"),
    (gauge, "urc_engine_queued_prefill_tokens", "Prompt tokens waiting to be prefilled"),
    (
        gauge,
        "urc_engine_cache_usage",
        "Fraction of the KV pool in use (cached or held by requests)",
    ),
    (gauge, "urc_engine_cached_blocks", "KV blocks in the cache"),
)
_HOST_METRICS = (  # the host tier (docs/tiers.md): the torch worker's names, in blocks
    (counter, "urc_engine_host_hit_tokens", "Prompt tokens promoted from the host tier"),
    (gauge, "urc_engine_host_cached_blocks", "KV blocks in the host tier"),
    (counter, "urc_engine_host_demoted_blocks", "Blocks demoted to the host tier"),
    (counter, "urc_engine_host_promoted_blocks", "Blocks copied back to the GPU"),
    (counter, "urc_engine_host_evicted_blocks", "Blocks the host tier dropped"),
)


class EmulatedSide:
    """The emulated engine as the worker shell takes it (backends/http/runner.py): cheap steps,
    inline on the loop, each due at the end of the modelled one, so tokens come out one step
    at a time as from a GPU."""

    name = ENGINE
    version = "urc-emulated-0.1"
    blocking = False
    model_info = {"model_type": "emulated", "architectures": ["EmulatedForCausalLM"]}

    def __init__(self, config: EngineConfig, model: ServedModel, enable_lora: bool = False) -> None:
        self.config = config
        self.model = model
        self.models = {model.name: model}  # and the LoRA adapters loaded
        self.block_size = config.block_size
        self.engine = EmulatedEngine(config)
        self.enable_lora = enable_lora
        self._clock = time.monotonic  # the clock asyncio's own loop keeps
        self._ids = itertools.count()

    def request(self, gen: Generation) -> Request:
        """Sampling is ignored: the output is the engine's filler."""
        req = Request(
            next(self._ids), gen.prompt, gen.sampling.max_tokens, gen.cache_salt, self._clock()
        )
        req.public_blocks = gen.public_tokens // self.config.block_size
        req.priority = gen.priority
        req.protect = gen.protect
        req.lora_name = gen.model.lora_name
        return req

    def submit(self, req: Request) -> None:
        self.engine.submit(req)

    def abort(self, req: Request) -> None:
        self.engine.abort(req, self._clock())

    def due_in(self) -> float | None:
        wake_at = self.engine.next_step_time()
        return None if wake_at is None else max(0.0, wake_at - self._clock())

    def step(self) -> StepResult:
        return self.engine.step(self._clock())

    def advance(self, result: StepResult, live: dict[Any, Generation]) -> Events:
        for req in result.admitted:
            if (gen := live.get(req.rid)) is not None:
                gen.cached_tokens = req.cached_tokens
                gen.admitted = True
                gen.changed.set()
        for rid in result.emitted:
            if (gen := live.get(rid)) is not None:
                _catch_up(gen, self.engine.generated(gen.handle))
        for req in result.finished:
            if (gen := live.pop(req.rid, None)) is not None:
                # a limit the client set is hit ("length"); without one the answer just ends
                # ("stop"), as a model's would
                gen.finish_reason = "stop" if gen.chat and not gen.sampling.limit_set else "length"
                _catch_up(gen, req.generated)
        return {self.model.kv_group: result.events} if result.events else {}

    def load(self) -> WorkerLoad:
        load, stats = self.engine.load(), self.engine.cache.stats()
        used, capacity = stats.capacity_tokens - stats.free_tokens, stats.capacity_tokens
        queued, decoding = load.queued_prefill_tokens, load.decoding
        out = WorkerLoad(load.running, load.waiting, used, capacity, queued, decoding)
        if not self.enable_lora:
            return out
        slots = self.engine.adapters.slots
        return out._replace(lora_active=tuple(slots.active), max_loras=slots.max_loras)

    def invalidate(self, asked: InvalidateRequest) -> tuple[dict[str, int], Events]:
        tree: str | None = None  # every tree
        if asked.kv_group is not None:
            model = next((m for m in self.models.values() if m.kv_group == asked.kv_group), None)
            if model is None:
                return {"freed_blocks": 0, "locked_blocks": 0}, {}
            tree = model.lora_name or ""  # the engine's tree of an adapter is named by it
        done = self.engine.invalidate(asked.scope, tree)
        return done._asdict(), self._drained()

    def load_adapter(self, name: str, path: str) -> ServedModel:
        """Modelled weights: any path does (its PEFT file gives the adapter's size)."""
        self.engine.adapters.load(name, path)
        model = self.models[name] = self.model.adapter(name, path)
        return model

    def unload_adapter(self, name: str) -> Events:
        self.engine.adapters.unload(name)
        del self.models[name]
        return self._drained()

    def _drained(self) -> Events:
        events = self.engine.drain_events()
        return {self.model.kv_group: events} if events else {}

    def embed(self, model: ServedModel, prompts: list[list[int]]) -> list[list[float]]:
        """No weights: vectors derived from the token ids (backends/emulated/embedding.py)."""
        return [embed(prompt) for prompt in prompts]

    def info(self) -> dict[str, Any]:
        return {
            "host_capacity_tokens": self.config.host_capacity_tokens,
            "host_copy_tokens_per_s": self.config.host_copy_tokens_per_s,
        }

    def settings(self) -> dict[str, Any]:
        return {
            "max_running_requests": self.config.max_batch,
            "chunked_prefill_size": self.config.chunk_tokens,
        }

    def collect(self) -> Iterator[Metric]:
        """One moment of the engine: the loop that steps it is the one scraping."""
        engine = self.engine
        stats, load, host = engine.cache.stats(), engine.load(), engine.host
        capacity = stats.capacity_tokens
        values = [  # in _METRICS' order
            engine.finished_requests,
            engine.prompt_tokens,
            engine.cached_tokens,
            engine.generated_tokens,
            stats.evicted_blocks,
            stats.stored_blocks,
            load.running,
            load.waiting,
            load.queued_prefill_tokens,
            capacity and (capacity - stats.free_tokens) / capacity,
            stats.cached_blocks,
        ]
        if host is not None:
            tier = host.stats()
            values += [engine.host_hit_tokens, len(host), tier.demoted_blocks]
            values += [tier.promoted_blocks, tier.evicted_blocks]
        table = _METRICS if host is None else _METRICS + _HOST_METRICS
        for (family, metric, doc), value in zip(table, values, strict=True):
            yield family(metric, doc, "model", [(self.model.name, value)])
        if self.enable_lora:
            yield from lora_metrics(engine.adapters.slots, self.model.name)


def _catch_up(gen: Generation, n: int) -> None:
    have = len(gen.output)
    if n > have:
        gen.output.extend(output_bytes(have, n))
    gen.changed.set()


def build_parser() -> argparse.ArgumentParser:
    parser = worker_parser(
        ENGINE,
        "An emulated GPU worker: a real radix KV cache with modelled time, served over "
        "OpenAI's and SGLang's HTTP APIs, publishing vLLM-format KV events. Defaults "
        "model an 8B bf16 model on one H100 SXM 80GB: prefill 15k tokens/s, decode step "
        "8 ms + 0.08 ms per running request, 400k tokens of KV, batch 256, chunks of 8192.",
        "context length (0: min(capacity, 131072))",
    )
    add_flags(
        parser,
        [
            ("--model", str, "emulated", "the served model name"),
            ("--kv-group", str, None, "KV-identity group (unset: the model name)"),
            (
                "--write-tokenizer",
                str,
                None,
                "write the byte tokenizer as a Hugging Face tokenizer into DIR, then exit",
            ),
        ],
    )
    add_setting_flags(parser.add_argument_group("emulated engine"), EngineConfig)
    return parser


def build_engine(args: argparse.Namespace) -> EmulatedSide:
    """ValueError on settings that cannot work."""
    config = from_flags(EngineConfig, args)
    kv_group, tokenizer = args.kv_group or args.model, ByteTokenizer()
    # workers that agree on it produce identical K/V for identical tokens (same emulated
    # weights, tokenizer and block size)
    ident = json.dumps([ENGINE, kv_group, config.block_size, tokenizer.fingerprint])
    model = ServedModel(
        name=args.model,
        kv_group=kv_group,
        fingerprint=hashlib.blake2b(ident.encode(), digest_size=16).hexdigest(),
        tokenizer=tokenizer,
        tokenizer_spec="byte",
        max_model_len=args.max_model_len or min(config.capacity_tokens, 131_072),
        default_max_tokens=args.default_max_tokens,
        vocab_size=tokenizer.vocab_size,
    )
    return EmulatedSide(config, model, args.enable_lora)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    directory = parser.parse_args(argv).write_tokenizer
    if directory is not None:
        print(write_byte_tokenizer(directory))
        return 0
    return run_worker(parser, build_engine, argv)


if __name__ == "__main__":
    sys.exit(main())
