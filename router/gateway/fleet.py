"""The fleet as the gateway sees it: workers, what they serve, their health and load, and their
KV-event streams, one per kv_group (docs/dispatch.md, "The fleet"; docs/kv-events.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import aiohttp

from core.blocks import DEFAULT_BLOCK_SIZE
from core.tokenizer import Tokenizer, load_tokenizer
from router.adapters import Adapters, adapter_group
from router.gateway.config import GatewayConfig, ModelConfig, WorkerConfig
from router.gateway.event_streams import EventStream, discovered_streams, reachable
from router.gateway.host_ingest import host_ingest
from router.gateway.siblings import Siblings
from router.gateway.upstream import UpstreamPool
from router.index import UnifiedIndex, host_group
from router.policies import WorkerLoad

log = logging.getLogger(__name__)


def _host_copy_rate(info: dict[str, Any]) -> float:
    """/urc/info's `host_copy_tokens_per_s`, for a worker with a host tier (docs/tiers.md)."""
    rate = info.get("host_copy_tokens_per_s")
    if info.get("host_capacity_tokens", 1) == 0 or isinstance(rate, bool):
        return 0.0
    return float(rate) if isinstance(rate, int | float) and rate > 0 else 0.0


@dataclass(slots=True)
class Model:
    """A served model name and how to key its prompts; a LoRA adapter names its base
    (docs/adapters.md)."""

    name: str
    kv_group: str
    tokenizer: Tokenizer
    block_size: int
    adapter: str = ""  # its own name when it is a LoRA adapter ("": a base model)
    base_group: str = ""  # an adapter's: its base's kv_group, whose workers may load it
    lora_path: str | None = None  # where its weights load from (None: only where loaded)


@dataclass(slots=True, eq=False)
class Worker:
    name: str
    url: str
    config: WorkerConfig
    pool: UpstreamPool  # keep-alive connections for requests
    models: dict[str, str] = field(default_factory=dict)  # served name -> kv_group
    block_size: int = DEFAULT_BLOCK_SIZE
    up: bool = False
    failures: int = 0  # consecutive failed checks or requests
    down_until: float = 0.0  # circuit breaker: no re-admission before this (monotonic)
    answered_at: float = 0.0  # its last successful answer (monotonic): alive, no probe needed
    alive_at: float = 0.0  # its last answer of any kind, or passed health check (monotonic)
    incarnation: str | None = None
    load_endpoint: str | None = None  # where it pushes its load (ours: /urc/info's load_events)
    host_copy_tokens_per_s: float = 0.0  # its host tier's copy rate, from /urc/info (0: unsaid)
    load: WorkerLoad = field(init=False)  # as the gateway sees it (router/route.py)
    streams: list[EventStream] = field(default_factory=list)  # KV events, one per kv_group
    waiting: set[asyncio.Task[object]] = field(default_factory=set)  # sent, nothing back yet
    draining: bool = False  # removed gracefully: requests under way finish on it

    def __post_init__(self) -> None:
        self.load = WorkerLoad(self.name)

    def kv_group_of(self, model: Model) -> str:
        """The kv_group this worker serves `model` in (the model's own, if it did not say)."""
        return self.models.get(model.name, model.kv_group)

    @property
    def takes_priority(self) -> bool:
        """Whether it takes vLLM's `priority` field: ours always; vLLM and SGLang only when
        configured to schedule by it (`priority_scheduling`), as they refuse one otherwise."""
        return self.config.engine == "urc" or self.config.priority_scheduling

    def exact(self, kv_group: str) -> bool:
        """Whether this worker's residency in `kv_group` comes from its KV events."""
        for stream in self.streams:  # noqa: SIM110 - a loop, not any(): on every request
            if stream.kv_group == kv_group and stream.active:
                return True
        return False

    def exact_for(self, model: Model, kv_group: str) -> bool:
        """`exact` for `model` served in `kv_group`: an adapter's blocks come on its base's
        stream (docs/adapters.md)."""
        return self.exact(model.base_group if model.adapter else kv_group)

    @property
    def mode(self) -> str:
        groups = set(self.models.values())
        exact = sum(self.exact(g) for g in groups)
        if not exact:
            return "approximate"
        return "exact" if exact == len(groups) else "mixed"

    def blocks_held(self, index: UnifiedIndex, host: bool = False) -> int:
        """Blocks the index holds for the worker, in its GPU tier or (`host`) its host tier."""
        groups = set(self.models.values())
        return sum(index.blocks_held(self.name, host_group(g) if host else g) for g in groups)


class Fleet:
    """Workers by name and by kv_group; models by served name and alias."""

    def __init__(
        self, config: GatewayConfig, index: UnifiedIndex, siblings: Siblings | None = None
    ) -> None:
        self.config = config
        self.index = index
        self.workers: dict[str, Worker] = {}
        self.models: dict[str, Model] = {}
        self._by_group: dict[str, list[Worker]] = {}
        self._loads: dict[str, list[WorkerLoad]] = {}  # the same workers' loads
        self._tokenizers: dict[str, Tokenizer] = {}
        self._configured = {m.name: m for m in config.models}
        # --kv-groups: the only groups this gateway routes and follows the KV events of
        self.follow = frozenset(g for g in config.kv_groups.split(",") if g)
        # LoRA adapters' slots and loads on each worker (docs/adapters.md)
        self.adapters = Adapters(config.lora_load_mb_per_s, config.lora_load_s)
        for model in config.models:
            if model.base is None:
                group, block_size = model.kv_group or model.name, model.block_size
                self._declare(model.name, model, group, block_size or DEFAULT_BLOCK_SIZE)
        for model in config.models:
            if model.base is not None:  # over a declared base (config.py checks)
                self._declare_adapter(model.name, self.models[model.base], model.lora_path)
                self.adapters.declare(model.name, model.size_mb)
        self.session: aiohttp.ClientSession | None = None
        self.on_up: list[Callable[[Worker], None]] = []  # called when a worker comes (back) up
        self.on_down: list[Callable[[Worker], None]] = []  # called when a worker is taken out
        # --processes N: the host's one KV-event ingest (None: this process follows its own)
        self.ingest = host_ingest(index, config, siblings)

    def _declare(self, name: str, config: ModelConfig | None, group: str, block_size: int) -> Model:
        spec = config.tokenizer if config else "byte"
        if spec not in self._tokenizers:
            self._tokenizers[spec] = load_tokenizer(spec)
        model = Model(name, group, self._tokenizers[spec], block_size)
        self.models[name] = model
        for alias in config.aliases if config else ():
            self.models[alias] = model
        return model

    def _declare_adapter(self, name: str, base: Model, lora_path: str | None) -> Model:
        """Adapter `name` over `base`: its own kv_group, the base's tokenizer and blocks."""
        group = adapter_group(base.kv_group, name)
        model = Model(name, group, base.tokenizer, base.block_size, name, base.kv_group, lora_path)
        self.models[name] = model
        return model

    def candidates(self, kv_group: str) -> list[Worker]:
        return self._by_group.get(kv_group, [])

    def host_copy_tokens_per_s(self) -> float:
        """The slowest host-tier copy rate the up workers report (0.0: none reports one)."""
        rates = [w.host_copy_tokens_per_s for w in self.workers.values() if w.up]
        return min((r for r in rates if r > 0), default=0.0)

    def loads(self, kv_group: str) -> list[WorkerLoad]:
        """The loads of `candidates(kv_group)`, in order (kept: no list made per request)."""
        return self._loads.get(kv_group, [])

    def _regroup(self) -> None:
        groups: dict[str, list[Worker]] = {}
        for worker in self.workers.values():
            if worker.up:
                for group in set(worker.models.values()):
                    groups.setdefault(group, []).append(worker)
        self._by_group = groups
        self._loads = {group: [w.load for w in workers] for group, workers in groups.items()}

    async def start(self) -> None:
        if self.ingest is not None:  # leader or follower, before any stream starts
            self.ingest.start()
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        await asyncio.gather(*(self.add(w) for w in self.config.workers))

    async def close(self) -> None:
        for worker in list(self.workers.values()):
            for stream in worker.streams:
                await stream.stop()
        if self.ingest is not None:
            await self.ingest.close()
        if self.session is not None:
            await self.session.close()

    async def add(self, config: WorkerConfig) -> Worker:
        url = urlparse(config.url)
        tls = url.scheme == "https"
        port = url.port or (443 if tls else 80)
        name = config.name or f"{url.hostname}:{port}"
        if name in self.workers:
            raise ValueError(f"worker {name!r} is already in the fleet")
        timeout = self.config.connect_timeout_s
        pool = UpstreamPool(url.hostname or "127.0.0.1", port, tls, timeout)
        worker = Worker(name, config.url.rstrip("/"), config, pool)
        self.workers[name] = worker
        await self.check(worker)
        return worker

    async def remove(self, name: str, drain: bool = False) -> bool:
        """Out of the fleet, its residency out of the index. `drain`: requests under way finish
        on it (a pod that leaves); else those without an answer yet fail over now."""
        worker = self.workers.pop(name, None)
        if worker is None:
            return False
        worker.draining = drain
        await self._mark_down(worker, "removed")
        worker.pool.close(retire=True)
        return True

    def events_lost(self) -> bool:
        """The index is unhealthy: workers publish KV events, and no stream is connected."""
        up = [s for w in self.workers.values() if w.up for s in w.streams if s.active]
        return bool(up) and not any(s.connected for s in up)

    async def check(self, worker: Worker) -> None:
        """One health check; discovery when the worker comes (back) up."""
        assert self.session is not None
        if not worker.up and time.monotonic() < worker.down_until:
            return  # the breaker is open: let a failing worker cool down before probing it
        timeout = aiohttp.ClientTimeout(total=max(self.config.health_interval_s * 2, 1.0))
        try:
            if not worker.up:
                await self._discover(worker, timeout)
            async with self.session.get(worker.url + "/health", timeout=timeout) as resp:
                healthy = resp.status == 200
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            log.debug("health check of %s failed: %s", worker.name, exc)
            healthy = False
        if healthy:
            worker.failures = 0
            worker.alive_at = time.monotonic()
            if not worker.up:
                await self._mark_up(worker)
        else:
            self.failed(worker)

    def failed(self, worker: Worker) -> None:
        """A failed check or request: enough in a row take the worker out."""
        worker.failures += 1
        if worker.up and worker.failures >= self.config.unhealthy_after:
            worker.down_until = time.monotonic() + self.config.breaker_cooldown_s
            asyncio.get_running_loop().create_task(self._mark_down(worker, "unhealthy"))

    def alive(self, worker: Worker, now: float) -> None:
        """`worker` answered something (its head, an error): alive, whatever it said."""
        worker.alive_at = now

    def answered(self, worker: Worker, status: int, now: float) -> None:
        """A request's answer from `worker` went to the client: no failures in a row, and
        below 500 it answered for itself, as good as a health check."""
        worker.failures = 0
        if status < 500:
            worker.answered_at = now

    async def health_loop(self) -> None:
        """Probe every worker each interval but those up that answered a request within it."""
        interval = self.config.health_interval_s
        while True:
            await asyncio.sleep(interval)
            recent = time.monotonic() - interval
            workers = [w for w in self.workers.values() if not (w.up and w.answered_at > recent)]
            await asyncio.gather(*(self.check(w) for w in workers), return_exceptions=True)

    async def _discover(self, worker: Worker, timeout: aiohttp.ClientTimeout) -> None:
        """Ask our workers what they serve; engines that cannot be asked are configured."""
        config = worker.config
        info: dict = {}
        if config.models is None:
            assert self.session is not None
            async with self.session.get(worker.url + "/urc/info", timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"{worker.url}/urc/info answered {resp.status}")
                info = await resp.json(content_type=None)
        worker.incarnation = info.get("incarnation")
        worker.load_endpoint = reachable(
            (info.get("load_events") or {}).get("endpoint"), worker.pool.host
        )
        worker.block_size = int(config.block_size or info.get("block_size") or DEFAULT_BLOCK_SIZE)
        worker.host_copy_tokens_per_s = _host_copy_rate(info)
        served: dict[str, str] = {}
        for entry in info.get("models", []):
            if entry.get("base"):
                continue  # a LoRA adapter loaded there: _found_adapters
            name = entry["name"]
            configured = self._configured.get(name)
            group = (configured.kv_group if configured else None) or entry.get("kv_group") or name
            if self.follow and group not in self.follow:
                continue  # another replica set's shard (--kv-groups)
            served[name] = group
            if name not in self.models:
                self._declare(name, configured, group, worker.block_size)
            self._adopt_block_size(name, worker)
        for name in config.models or ():
            known = self.models.get(name)  # configured models are declared at start
            if self.follow and (known.kv_group if known else name) not in self.follow:
                continue
            model = known or self._declare(name, None, name, worker.block_size)
            self._adopt_block_size(name, worker)
            served[name] = model.kv_group
        worker.models = served
        if config.engine == "vllm":  # its adapters are in /v1/models, with their parent
            info = {"models": await self._vllm_models(worker, timeout)}
        self._found_adapters(worker, info.get("models", []), info.get("lora") or {})
        if config.kv_events:  # configured: one stream, meaningful only for a single kv_group
            groups = set(served.values())
            ends = (config.kv_events, config.kv_replay, config.kv_topic)
            worker.streams = [EventStream(groups.pop(), *ends)] if len(groups) == 1 else []
        else:  # discovered afresh each time: a restart may move them
            worker.streams = discovered_streams(info, served, worker.pool.host)

    async def _vllm_models(self, worker: Worker, timeout: aiohttp.ClientTimeout) -> list[dict]:
        """vLLM's /v1/models as /urc/info's entries: an adapter has a parent and a root."""
        assert self.session is not None
        async with self.session.get(worker.url + "/v1/models", timeout=timeout) as resp:
            body = await resp.json(content_type=None) if resp.status == 200 else {}
        data = body.get("data") if isinstance(body, dict) else None
        return [
            {"name": m.get("id"), "base": m.get("parent"), "lora_path": m.get("root")}
            for m in data or []
            if isinstance(m, dict)
        ]

    def _found_adapters(self, worker: Worker, entries: list[dict], lora: dict) -> None:
        """The LoRA adapters `worker` has loaded (entries with a base it serves), declared when
        new, and its slots (`lora`: /urc/info's max_loras and active; docs/adapters.md)."""
        loaded: list[str] = []
        for entry in entries:
            name, base = entry.get("name"), entry.get("base")
            if not base or not isinstance(name, str) or base not in worker.models:
                continue
            model = self.models.get(name)
            if model is None:
                path = entry.get("lora_path")
                model = self._declare_adapter(name, self.models[base], path)
                self.adapters.declare(name, None)
            if model.adapter:
                loaded.append(name)
        active = lora.get("active")
        slots = lora.get("max_loras")
        self.adapters.observe(worker.name, loaded, active, slots if isinstance(slots, int) else 0)

    def adapter_loads(self, model: Model) -> list[WorkerLoad]:
        """The loads of the workers that may serve adapter `model`: its base's, or (without a
        lora_path to load it from) those that have it loaded."""
        loads = self.loads(model.base_group)
        if model.lora_path:
            return loads
        held = self.adapters.workers
        return [w for w in loads if w.worker in held and model.adapter in held[w.worker].loaded]

    def _adopt_block_size(self, name: str, worker: Worker) -> None:
        """A model configured without a block size is keyed with its workers' (one per kv_group)."""
        configured = self._configured.get(name)
        model = self.models[name]
        if configured is not None and configured.block_size is None:
            model.block_size = worker.block_size
            for other in self.models.values():  # its adapters are keyed as it is
                if other.adapter and other.base_group == model.kv_group:
                    other.block_size = model.block_size
        elif model.block_size != worker.block_size:
            message = "worker %s has block size %d, model %s is keyed with %d"
            log.warning(message, worker.name, worker.block_size, name, model.block_size)

    async def _mark_up(self, worker: Worker) -> None:
        worker.up = True  # (its failures were reset by the check that found it healthy)
        for stream in worker.streams:
            stream.start(self.index, worker.name, worker.block_size, self.ingest)
        self._regroup()
        for hook in self.on_up:
            hook(worker)
        models = ", ".join(worker.models) or "no models"
        log.info("worker %s up (%s, %s)", worker.name, models, worker.mode)

    async def _mark_down(self, worker: Worker, why: str) -> None:
        if not worker.up:
            return
        worker.up = False
        self._regroup()
        for hook in self.on_down:
            hook(worker)
        for stream in worker.streams:
            await stream.stop()
        self.index.clear(worker.name)
        self.adapters.forget(worker.name)
        worker.pool.close()
        log.warning("worker %s down (%s): its residency left the index", worker.name, why)
