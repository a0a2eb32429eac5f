"""The emulated engine's LoRA adapters (docs/workers.md, "LoRA adapters"): the slots of
backends/lora_slots.py, an activation's modelled time (the adapter's bytes over
`lora_load_gbps`, added to the step that carries the first chunk after it), and each adapter's
tree in the radix cache, named by the adapter, dropped when it is unloaded."""

from __future__ import annotations

from pathlib import Path

from backends.cache.host import HostTier
from backends.cache.radix import RadixCache
from backends.cache.scopes import Invalidated, invalidate_tiers
from backends.emulated.config import EngineConfig
from backends.emulated.events import EventLog
from backends.lora_slots import Activation, Adapter, LoraSlots

PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's file names


def _running(adapter: Adapter) -> bool:
    return adapter.running > 0


def adapter_bytes(path: str) -> int | None:
    """The size of the PEFT weights at `path` (a directory), None where there are none."""
    for name in PEFT_WEIGHTS:
        file = Path(path) / name
        if file.is_file():
            return file.stat().st_size
    return None


class EmulatedAdapters:
    """`load` / `unload` adapters (the replay calls them directly, the worker through its
    endpoints); the engine asks `can_start` before it admits a request for one, `start` when it
    did, and adds `take_load_s()` to the next step that computes a chunk."""

    def __init__(
        self, config: EngineConfig, cache: RadixCache, host: HostTier | None, log: EventLog
    ) -> None:
        self.slots = LoraSlots(config.max_loras, _running)
        self.cache = cache
        self.host = host
        self.log = log
        self.bytes_per_s = config.lora_load_gbps * 1e9
        self.default_bytes = int(config.lora_default_mb * 1e6)
        self.load_s = 0.0  # activations not yet waited for by a step

    def load(self, name: str, path: str = "", size_bytes: int | None = None) -> Adapter:
        """Register an adapter: its size `size_bytes`, else its PEFT file's at `path`, else
        `lora_default_mb`. ValueError when the name is taken."""
        if size_bytes is None:
            size_bytes = adapter_bytes(path) if path else None
        size = self.default_bytes if size_bytes is None else size_bytes
        adapter = self.slots.add(name, path, size)
        self.log.lora_ids[name] = adapter.lora_id
        return adapter

    def unload(self, name: str) -> Invalidated:
        """Forget an adapter and drop its cached blocks (their KV is of its weights): KeyError
        when unknown, ValueError while requests for it run. The engine's `drain_events` has
        the removals."""
        self.slots.remove(name)
        self.log.release()  # the step in flight's stores come before their removal
        done = invalidate_tiers(self.cache, self.host, None, name)
        del self.log.lora_ids[name]
        return done

    def resolve(self, name: str | None) -> Adapter | None:
        """The loaded adapter a request names (None: the base model); ValueError when it is not
        loaded."""
        if name is None:
            return None
        adapter = self.slots.loaded.get(name)
        if adapter is None:
            raise ValueError(f"the LoRA adapter {name!r} is not loaded")
        return adapter

    def can_start(self, adapter: Adapter | None) -> bool:
        """Whether a request for `adapter` (None: the base model) may be admitted now."""
        return adapter is None or self.slots.can_activate(adapter)

    def start(self, adapter: Adapter | None) -> Activation:
        """A request for `adapter` was admitted: it holds the adapter's slot until released
        (backends/emulated/paging.py `release`)."""
        if adapter is None:
            return Activation(True)
        done = self.slots.activate(adapter)
        assert done.active, "can_start was asked first"
        if done.loaded:
            self.load_s += adapter.size_bytes / self.bytes_per_s
        adapter.running += 1
        return done

    def take_load_s(self) -> float:
        """The activations' time, for the step being planned: it carries the chunks of the
        requests admitted with them (admission without a chunk only when others took the
        budget)."""
        load_s, self.load_s = self.load_s, 0.0
        return load_s

    def check(self, running: list[Adapter | None]) -> None:
        """Each adapter's running count is its running requests; each active one is loaded."""
        for adapter in self.slots.loaded.values():
            count = sum(1 for a in running if a is adapter)
            assert adapter.running == count, f"running requests of adapter {adapter.name}"
        assert all(n in self.slots.loaded for n in self.slots.active), "an unloaded adapter active"
        assert len(self.slots.active) <= self.slots.max_loras, "adapters over max_loras"
