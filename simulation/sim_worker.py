"""One simulated worker of the replay: an emulated engine on the virtual clock, the gateway's
view of its load, and its cache's changes for the gateway's own mirror of it (docs/dispatch.md,
"The replay does the same")."""

from __future__ import annotations

from typing import cast

from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from core.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockHash
from router.index import UnifiedIndex
from router.kv_mirror import WorkerMirror
from router.policies import WorkerLoad


class Change:
    """Blocks stored (under our key `parent`, None: root blocks) or removed in one tier, as
    one KV event of the worker would say it."""

    __slots__ = ("keys", "parent", "medium", "salt", "stored")

    def __init__(
        self, keys: list[int], parent: int | None, medium: str, salt: str | None, stored: bool
    ) -> None:
        self.keys = keys
        self.parent = parent
        self.medium = medium
        self.salt = salt
        self.stored = stored


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
        self.worker.changes.append(Change(keys, parent, self.medium, salt, True))

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

    def apply(self, changes: list[Change], now: float) -> None:
        """`changes` reach the gateway's mirror at `now` (one batch of events)."""
        mirror = self.mirror
        for c in changes:
            if c.stored:
                mirror.stored(c.keys, c.parent, c.medium, c.salt, now)
            else:
                mirror.removed(cast(list[BlockHash], c.keys), c.medium)
