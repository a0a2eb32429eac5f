"""One simulated worker: an emulated engine on the virtual clock, the gateway's view of its load,
and (with KV events) its cache's changes as BlockStored / BlockRemoved would carry them.
"""

from __future__ import annotations

from backends.emulated.config import EngineConfig
from backends.emulated.engine import EmulatedEngine
from router.policies import WorkerLoad


class Change:
    """Blocks stored (under `parent`, None: root blocks) or removed: one KV event's content."""

    __slots__ = ("keys", "parent", "stored")

    def __init__(self, keys: list[int], parent: int | None, stored: bool) -> None:
        self.keys = keys
        self.parent = parent
        self.stored = stored


class SimWorker:
    __slots__ = (
        "name",
        "kv_group",
        "engine",
        "max_model_len",
        "load",
        "wake",
        "wake_seq",
        "changes",
    )

    def __init__(
        self,
        name: str,
        kv_group: str,
        config: EngineConfig,
        max_model_len: int,
        kv_events: bool = True,
    ) -> None:
        self.name = name
        self.kv_group = kv_group
        self.engine = EmulatedEngine(config)
        self.changes: list[Change] = []
        if kv_events:
            self.engine.cache.on_stored = self._stored
            self.engine.cache.on_removed = self._removed
        self.max_model_len = max_model_len  # longer prompt + max_tokens: 400, as the worker says
        self.load = WorkerLoad(name)
        self.wake: float | None = None  # when the engine wants its next step call
        self.wake_seq = -1  # the one valid heap entry of this worker

    def _stored(
        self,
        kv_group: str,
        parent: int | None,
        keys: list[int],
        tokens: list[int] | None,
        salt: str | None,
    ) -> None:
        self.changes.append(Change(keys, parent, True))

    def _removed(self, kv_group: str, keys: list[int]) -> None:
        self.changes.append(Change(keys, None, False))
