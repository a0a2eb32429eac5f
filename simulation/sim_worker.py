"""One simulated worker of the replay: an emulated engine on the virtual clock, the gateway's
view of its load, and its cache's changes for the gateway's own mirror of it (docs/dispatch.md,
"The replay does the same")."""

from __future__ import annotations

from bisect import insort
from typing import TYPE_CHECKING, cast

from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from backends.emulated.request import Request
from core.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockHash
from router.adapters import Adapters
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror
from router.policies import WorkerLoad

if TYPE_CHECKING:
    from simulation.replay import FleetConfig


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
        # an adapter's blocks are in its tree (named by it), reported under its kv_group
        change = Change(keys, parent, self.medium, salt, True, kv_group or None)
        self.worker.changes.append(change)

    def removed(self, kv_group: str, keys: list[int]) -> None:
        self.worker.changes.append(Change(keys, None, self.medium, None, False))


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
        "pending",
        "registering",
    )

    def __init__(
        self,
        name: str,
        kv_group: str,
        config: EngineConfig,
        max_model_len: int,
        index: UnifiedIndex,
        kv_events: bool = True,
    ) -> None:
        self.name = name
        self.kv_group = kv_group
        self.engine = EmulatedEngine(config)
        self.changes: list[Change] = []  # since the last delivery
        # requests waiting for the gateway's load of their adapter here: (at, id, request)
        self.pending: list[tuple[float, int, Request]] = []
        self.registering: dict[str, float] = {}  # adapter -> when the gateway's load ends
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

    def take_adapter(self, adapters: Adapters, req: Request, now: float, load_s: float) -> float:
        """`req` for adapter `req.lora_name` comes (the gateway's view: `adapters.use`). When
        the engine has not registered the adapter, the gateway loads it (`load_s`, one load at
        a time per adapter), unloading what it unloads to make room; the engine models the
        activation into a slot (and the wait for one). When `req` reaches the engine."""
        name = cast(str, req.lora_name)
        use = adapters.use(self.name, name, now)
        engine = self.engine.adapters
        if use.unloaded is not None and use.unloaded in engine.slots.loaded:
            engine.unload(use.unloaded)  # idle: no request for it is queued or running here
        if name not in engine.slots.loaded:
            engine.load(name)
            self.registering[name] = now + load_s
        ready = self.registering.get(name, now)
        if ready > now:
            insort(self.pending, (ready, req.rid, req))
        return ready

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


def sim_adapters(names: set[str], fleet: FleetConfig) -> Adapters:
    """The gateway's view of adapters `names` on `fleet`, priced as its engines run them."""
    engine = fleet.engine
    sizes = dict.fromkeys(names, engine.lora_default_mb)
    rate = engine.lora_load_gbps * 1e3  # MB/s
    return Adapters(rate, fleet.adapter_load_s, engine.max_loras, sizes)


def adapter_counts(workers: list[SimWorker], adapters: Adapters) -> dict[str, int]:
    """Activations into slots and evictions from them (the engines'), and the gateway's
    unloads (its slot limit)."""
    slots = [w.engine.adapters.slots for w in workers]
    return {
        "loads": sum(s.loads for s in slots),
        "evictions": sum(s.evictions for s in slots),
        "unloads": sum(s.unloads for s in adapters.workers.values()),
    }
