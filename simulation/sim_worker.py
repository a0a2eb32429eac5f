"""One simulated worker of the replay: an emulated engine on the virtual clock, the gateway's
view of its load, and its cache's changes for the gateway's own mirror of it (docs/dispatch.md,
"The replay does the same")."""

from __future__ import annotations

from bisect import insort
from typing import cast

from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request
from core.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockHash
from router.adapters import Adapters, Use
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror
from router.policies import WorkerLoad


class Change:
    """Blocks stored (under our key `parent`, None: root blocks) or removed in one tier, as
    one KV event of the worker would say it."""

    __slots__ = ("keys", "parent", "medium", "salt", "stored", "lora")

    def __init__(
        self,
        keys: list[int],
        parent: int | None,
        medium: str,
        salt: str | None,
        stored: bool,
        lora: str | None = None,
    ) -> None:
        self.keys = keys
        self.parent = parent
        self.medium = medium
        self.salt = salt
        self.stored = stored
        self.lora = lora  # the LoRA adapter whose blocks they are (None: the base model's)


class Tier:
    """One tier's cache callbacks, with its medium: they record the worker's changes."""

    __slots__ = ("worker", "medium")

    def __init__(self, worker: SimWorker, medium: str) -> None:
        self.worker = worker
        self.medium = medium

    def stored(
        self,
        kv_group: str,
        parent: int | None,
        keys: list[int],
        tokens: list[int] | None,
        salt: str | None,
    ) -> None:
        worker = self.worker
        lora = None
        if worker.adapter_salts:  # an adapter's blocks: its namespace's, or its parent's
            lora = worker.adapter_salts.get(salt) if salt else worker.lora_of.get(parent or 0)
            if lora is not None:
                for key in keys:
                    worker.lora_of[key] = lora
        worker.changes.append(Change(keys, parent, self.medium, salt, True, lora))

    def removed(self, kv_group: str, keys: list[int]) -> None:
        worker = self.worker
        if worker.lora_of:
            for key in keys:
                worker.lora_of.pop(key, None)
        worker.changes.append(Change(keys, None, self.medium, None, False))


class SimWorker:
    """One simulated worker: an emulated engine on the virtual clock, the gateway's view of its
    load, and (with KV events) its cache's changes, applied by the gateway's own mirror of it
    (router/kv_mirror.py) as its BlockStored / BlockRemoved events would be."""

    __slots__ = (
        "name",
        "kv_group",
        "engine",
        "max_model_len",
        "load",
        "wake",
        "wake_seq",
        "changes",
        "mirror",
        "adapter_salts",
        "lora_of",
        "pending",
    )

    def __init__(
        self,
        name: str,
        kv_group: str,
        config: EngineConfig,
        max_model_len: int,
        index: UnifiedIndex,
        kv_events: bool = True,
        adapter_salts: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.kv_group = kv_group
        self.engine = EmulatedEngine(config)
        self.changes: list[Change] = []  # since the last delivery
        # LoRA adapters: the namespace (salt) of each adapter's requests -> the adapter, and
        # the adapter of each block it caches (its changes name it, as vLLM's events do)
        self.adapter_salts = adapter_salts or {}
        self.lora_of: dict[int, str] = {}
        # requests waiting for their adapter to load here: (usable at, request id, request)
        self.pending: list[tuple[float, int, Request]] = []
        self.mirror = WorkerMirror(index, name, kv_group, config.block_size, own_keys=True)
        if kv_events:  # one recorder per tier, the tier's medium its parameter
            gpu, cache = Tier(self, MEDIUM_GPU), self.engine.cache
            cache.on_stored, cache.on_removed = gpu.stored, gpu.removed
            host = self.engine.host
            if host is not None:
                cpu = Tier(self, MEDIUM_CPU)
                host.on_stored, host.on_removed = cpu.stored, cpu.removed
        self.max_model_len = max_model_len  # longer prompt + max_tokens: 400, as the worker says
        self.load = WorkerLoad(name)
        self.wake: float | None = None  # when the engine wants its next step call
        self.wake_seq = -1  # the one valid heap entry of this worker

    def take_adapter(self, adapters: Adapters, adapter: str, req: Request, now: float) -> Use:
        """`req` for `adapter` comes: the adapter is loaded here first when it is not active,
        and `req` reaches the engine when it is usable (its load counts in its TTFT)."""
        use = adapters.use(self.name, adapter, now)
        if use.ready_at > now:
            insort(self.pending, (use.ready_at, req.rid, req))
        return use

    def submit_ready(self, now: float) -> None:
        """Submit the requests whose adapter is usable by `now`."""
        pending = self.pending
        while pending and pending[0][0] <= now:
            req = pending.pop(0)[2]
            req.arrival = now
            self.engine.submit(req)

    def next_time(self, per_step: bool) -> float | None:
        """When this worker next needs a step call: its engine's, or a load's end."""
        engine = self.engine
        t = engine.next_step_time() if per_step else engine.next_time()
        if self.pending and (t is None or self.pending[0][0] < t):
            return self.pending[0][0]
        return t

    def apply(self, changes: list[Change], now: float) -> None:
        """`changes` reach the gateway's mirror at `now` (one batch of events)."""
        mirror = self.mirror
        for c in changes:
            if c.stored:
                mirror.stored(c.keys, c.parent, c.medium, c.salt, now, c.lora)
            else:
                mirror.removed(cast(list[BlockHash], c.keys), c.medium)
