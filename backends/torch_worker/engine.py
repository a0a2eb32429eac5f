"""The torch engine: several models, one radix cache per page pool, continuous batching, LoRA
adapters of the default model (adapters.py); a synchronous state machine whose driver owns the
only thread that touches it (docs/workers.md)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from backends.cache.check import check, check_locks
from backends.cache.radix import RadixCache
from backends.cache.scopes import Invalidated, invalidate_tiers
from backends.lora_slots import DEFAULT_MAX_LORAS, Adapter
from backends.torch_worker.adapters import TorchAdapters
from backends.torch_worker.attention import make_attention
from backends.torch_worker.host_pool import make_host_tier
from backends.torch_worker.loader import LoadedModel
from backends.torch_worker.model import ModelRunner, WorkItem
from backends.torch_worker.paging import KVLayout, PagePool, cache_blocks
from backends.torch_worker.request import Request, SamplingParams, Status
from backends.torch_worker.scheduler import ModelState, PoolState, Scheduler, SchedulerConfig
from core.blocks import DEFAULT_BLOCK_SIZE
from core.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, KVEvent, block_stored
from core.settings import setting


@dataclass(slots=True)
class EngineConfig:
    """Each setting with a flag is one of `urc worker --engine torch` (core/settings.py)."""

    page_size: int = setting(DEFAULT_BLOCK_SIZE, "tokens per KV page")
    kv_cache_mb: float = setting(256.0, "KV memory, all pools together")
    num_pages: int = setting(0, "pages per pool (overrides --kv-cache-mb)")
    host_capacity_tokens: int = setting(0, "host-memory KV tier, tokens (0: none)")
    max_loras: int = setting(DEFAULT_MAX_LORAS, "LoRA adapters active at once (vLLM's)")
    attention: str = "auto"  # "torch", "flashinfer" or "auto"
    record_logits: bool = False  # keep every sampled row of logits on the request (tests)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.kv_cache_mb <= 0 or self.num_pages < 0:
            raise ValueError("need --page-size >= 1, --kv-cache-mb > 0 and --num-pages >= 0")
        if self.host_capacity_tokens < 0:
            raise ValueError("need --host-capacity-tokens >= 0")


class StepResult(NamedTuple):
    admitted: list[Request]  # first admitted this step: cached_tokens is known
    emitted: list[Request]  # got one more token
    finished: list[Request]
    events: dict[str, list[KVEvent]]  # kv_group -> the cache's changes, in order


class EngineLoad(NamedTuple):
    running: int
    waiting: int
    queued_prefill_tokens: int  # tokens admitted requests and the queue have yet to compute
    decoding: int  # running requests past their first token


@dataclass(slots=True)
class ModelCounters:  # per served name, for /metrics
    requests: int = 0  # finished
    prompt_tokens: int = 0  # prefix cache queries, in tokens (at first admission)
    cached_tokens: int = 0  # prefix cache hits, in tokens (both tiers)
    host_hit_tokens: int = 0  # of those, promoted from the host tier
    generated_tokens: int = 0


class TorchEngine:
    def __init__(self, served: dict[str, LoadedModel], config: EngineConfig | None = None) -> None:
        if not served:
            raise ValueError("an engine needs at least one model")
        self.config = cfg = config or EngineConfig()
        self.served = served
        self.counters = {name: ModelCounters() for name in served}
        self._events: dict[str, list[KVEvent]] = {}
        groups: dict[str, LoadedModel] = {}
        for loaded in served.values():
            if loaded.page_size != cfg.page_size:
                raise ValueError(f"{loaded.source}: page size {loaded.page_size} != engine's")
            groups.setdefault(loaded.kv_group, loaded)  # equal fingerprints: one set of weights
        layouts = list(dict.fromkeys(m.layout for m in groups.values()))
        self.pools: dict[KVLayout, PoolState] = {}
        for layout in layouts:
            device = next(m.device for m in groups.values() if m.layout == layout)
            pages = cfg.num_pages or int(cfg.kv_cache_mb * 2**20 / len(layouts)) // (
                layout.page_bytes()
            )
            pool = PagePool(layout, pages, device)
            cache = RadixCache(
                pool.capacity * cfg.page_size,
                cfg.page_size,
                page_ids=pool.page_ids(),
                keep_tokens=True,  # a match is confirmed on the tokens, not the hash alone
                on_stored=self._on_stored,
                on_removed=self._on_removed,
            )
            state = self.pools[layout] = PoolState(pool, cache)
            if cfg.host_capacity_tokens > 0:  # split by layout, as the GPU budget is
                host_tokens = cfg.host_capacity_tokens // len(layouts)
                state.host, state.host_memory = make_host_tier(
                    pool,
                    cache,
                    host_tokens,
                    partial(self._on_stored, medium=MEDIUM_CPU),
                    partial(self._on_removed, medium=MEDIUM_CPU),
                )
        self.models: dict[str, ModelState] = {}
        for group, loaded in groups.items():
            attention = make_attention(cfg.attention, loaded.config, loaded.dtype, loaded.device)
            runner = ModelRunner(loaded.model, attention, loaded.device)
            self.models[group] = ModelState(loaded, runner, self.pools[loaded.layout])
            self.pools[loaded.layout].cache.root(group)  # every group's tree exists from now
            self._events[group] = []
        self.scheduler = Scheduler(cfg.scheduler, self.models)
        self._rotation = itertools.cycle(list(self.models.values()))
        self._ids = itertools.count()
        default = self.models[next(iter(served.values())).kv_group]
        self.adapters = TorchAdapters(default, cfg.max_loras)  # LoRA adapters of the default

    # -- KV events -----------------------------------------------------------------------------

    def _on_stored(
        self,
        group: str,
        parent: int | None,
        keys: list[int],
        tokens: list[int] | None,
        salt: str | None,
        medium: str = MEDIUM_GPU,
    ) -> None:
        assert tokens is not None, "the GPU cache keeps the blocks' tokens"
        size = self.config.page_size
        stream, adapter = self._stream(group)
        name, lora_id = (None, None) if adapter is None else (adapter.name, adapter.lora_id)
        stored = block_stored(
            keys, parent, tokens, size, medium=medium, salt=salt, lora_name=name, lora_id=lora_id
        )
        self._events[stream].append(stored)

    def _on_removed(self, group: str, keys: list[int], medium: str = MEDIUM_GPU) -> None:
        self._events[self._stream(group)[0]].append(BlockRemoved(keys, medium))

    def _stream(self, group: str) -> tuple[str, Adapter | None]:
        """The kv_group whose stream carries `group`'s events (an adapter's: its base's)."""
        adapter = self.adapters.by_group.get(group)
        return (group, None) if adapter is None else (self.adapters.base.loaded.kv_group, adapter)

    # -- LoRA adapters (adapters.py) ----------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> LoadedModel:
        """Serve the adapter at `path` (PEFT's files) of the default model as `name`; ValueError
        when the name is taken or the files are not such an adapter."""
        if name in self.served and name not in self.adapters.states:
            raise ValueError(f"the name {name!r} is a model's")
        state = self.adapters.add(name, path)
        self.models[state.loaded.kv_group] = state
        self.served[name] = state.loaded
        self.counters[name] = ModelCounters()
        self._rotation = itertools.cycle(list(self.models.values()))
        return state.loaded

    def unload_adapter(self, name: str) -> dict[str, list[KVEvent]]:
        """Forget the adapter and drop its cached blocks: KeyError when unknown, ValueError while
        requests for it run (none may wait: the caller checks). The events not handed out yet."""
        if name not in self.adapters.states:
            raise KeyError(name)
        self.adapters.slots.remove(name)
        group = self.adapters.states[name].loaded.kv_group
        _, events = self.invalidate(None, group)
        state = self.adapters.forget(name)
        assert not state.waiting, "requests wait for an unloaded adapter"
        del self.models[group], self.served[name]
        self._rotation = itertools.cycle(list(self.models.values()))
        return events

    # -- the driver's API ----------------------------------------------------------------------

    def new_request(
        self, model: str, prompt: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> Request:
        """A request with a fresh id, not submitted."""
        return Request(next(self._ids), model, list(prompt), params, cache_salt)

    def validate(self, req: Request) -> LoadedModel:
        """ValueError when `req` can never run (unknown model, bad ids, too long). Reads only
        what never changes: safe from any thread."""
        loaded = self.served.get(req.model)
        if loaded is None:
            raise ValueError(f"unknown model {req.model!r}")
        if not req.prompt:
            raise ValueError("the prompt is empty")
        vocab = loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt):
            raise ValueError(f"a prompt token id is outside [0, {vocab})")
        total = len(req.prompt) + req.params.max_tokens
        if total > loaded.max_model_len:
            raise ValueError(
                f"prompt + max_tokens ({len(req.prompt)} + {req.params.max_tokens}) exceeds "
                f"the context length of {loaded.max_model_len} tokens"
            )
        capacity = self.models[loaded.kv_group].pool.memory.capacity * self.config.page_size
        if total > capacity:
            raise ValueError(f"prompt + max_tokens exceeds the KV pool ({capacity} tokens)")
        return loaded

    def submit(self, req: Request) -> None:
        """Queue `req`; ValueError as `validate`."""
        loaded = self.validate(req)
        req.kv_group = loaded.kv_group
        adapter = self.adapters.by_group.get(loaded.kv_group)
        req.lora_name = None if adapter is None else adapter.name  # keyed in its namespace
        req.stop_ids = loaded.tokenizer.stop_token_ids
        req.status = Status.WAITING
        if self.config.record_logits:
            req.logits = []
        self.models[loaded.kv_group].waiting.append(req)

    def abort(self, req: Request) -> bool:
        """Drop a request; what it cached stays cached. False when it had already ended."""
        ms = self.models.get(req.kv_group)
        if ms is None or req.done:
            return False
        if req.status is Status.WAITING:
            ms.waiting.remove(req)
        else:
            ms.drop(req)
        req.status = Status.ABORTED
        return True

    def has_work(self) -> bool:
        return any(ms.waiting or ms.running for ms in self.models.values())

    def load(self) -> EngineLoad:
        running = waiting = queued = decoding = 0
        for ms in self.models.values():
            running += len(ms.running)
            waiting += len(ms.waiting)
            queued += sum(r.pending for r in ms.running) + sum(r.pending for r in ms.waiting)
            decoding += sum(1 for r in ms.running if r.output)
        return EngineLoad(running, waiting, queued, decoding)

    def step(self) -> StepResult:
        """One forward pass per model that has work (in turn, so none always goes first)."""
        result = StepResult([], [], [], {})
        for _ in range(len(self.models)):
            ms = next(self._rotation)
            if not (ms.waiting or ms.running) or not self.adapters.ready(ms):
                continue  # nothing to do, or an adapter waiting for a slot
            items = self.scheduler.schedule(ms, result.admitted)
            if items:
                self._run(ms, items, result)
        for req in result.admitted:
            counters = self.counters[req.model]
            counters.prompt_tokens += len(req.prompt)
            counters.cached_tokens += req.cached_tokens
            counters.host_hit_tokens += req.host_hit_tokens
        for group, events in self._events.items():
            if events:
                result.events[group] = events
                self._events[group] = []
        return result

    def invalidate(
        self, scope: Callable[[str], bool] | None, kv_group: str | None = None
    ) -> tuple[Invalidated, dict[str, list[KVEvent]]]:
        """Drop a scope of every pool's cache and host tier: what went (both tiers), and the
        events no step handed out yet."""
        freed = locked = 0
        for pool in self.pools.values():
            done = invalidate_tiers(pool.cache, pool.host, scope, kv_group)
            freed += done.freed_blocks
            locked += done.locked_blocks
        events = {g: e for g, e in self._events.items() if e}
        self._events = {g: [] for g in self._events}
        return Invalidated(freed, locked), events

    def _run(self, ms: ModelState, items: list[WorkItem], result: StepResult) -> None:
        cache = ms.pool.cache
        if ms.pool.host_memory is not None:
            ms.pool.host_memory.wait()  # promotions copied before the prefill reads them
        forward = ms.runner.forward(ms.pool.memory, items)
        for item in items:
            item.req.computed += item.n
            if self.config.scheduler.prefix_cache:
                cache_blocks(cache, item.req)
        logits = forward.logits.cpu()
        for req, row in zip(forward.sampled, logits, strict=True):
            if req.logits is not None:
                req.logits.append(row.clone())
            token = sample(req, row)
            req.output.append(token)
            result.emitted.append(req)
            reason = self._finish_reason(req, token, ms.loaded.max_model_len)
            if reason is not None:
                self._finish(ms, req, reason)
                result.finished.append(req)

    @staticmethod
    def _finish_reason(req: Request, token: int, max_model_len: int) -> str | None:
        if token in req.stop_ids and not req.params.ignore_eos:
            return "stop"
        if len(req.output) >= req.params.max_tokens or req.num_tokens >= max_model_len:
            return "length"
        return None

    def _finish(self, ms: ModelState, req: Request, reason: str) -> None:
        ms.drop(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        counters = self.counters[req.model]
        counters.requests += 1
        counters.generated_tokens += len(req.output)

    # -- integrity -----------------------------------------------------------------------------

    def check(self) -> None:
        """The caches' invariants, plus: in-use pages are exactly the running requests' private
        pages, none held twice, and page tables and locks match the locked paths."""
        for pool_state in self.pools.values():
            cache = pool_state.cache
            in_tree = check(cache)
            private: list[int] = []
            for req in pool_state.running:
                assert req.status is Status.RUNNING and req.node is not None
                assert req.node.tree.kv_group == req.kv_group, "a page of another kv_group"
                private.extend(req.pages[req.node_blocks :])
                path = cache.path_pages(req.node)
                assert path == req.pages[: req.node_blocks], "page table != locked path"
            in_use = cache.allocated_tokens // cache.block_size
            assert len(private) == len(set(private)) == in_use, "in-use pages"
            assert not set(private) & (in_tree | set(cache.page_ids or [])), "a page held twice"
            check_locks(cache, [r.node for r in pool_state.running if r.node is not None])
            if pool_state.host is not None:
                pool_state.host.check()  # free + cached + pinned == capacity, pages
        for ms in self.models.values():
            for req in ms.waiting:
                assert req.status is Status.WAITING and req.node is None and not req.pages
            assert len(ms.running) <= self.config.scheduler.max_running
        self.adapters.check()


def sample(req: Request, logits: torch.Tensor) -> int:
    """The next token from `logits` ([vocab] float32): greedy at temperature 0, else temperature,
    top-k and top-p (nucleus) sampling from the request's own seeded generator."""
    params = req.params
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if req.generator is None:
        req.generator = torch.Generator(device=probs.device)
        if params.seed is not None:
            req.generator.manual_seed(params.seed)
        else:
            req.generator.seed()
    return int(torch.multinomial(probs, 1, generator=req.generator))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
