"""LoRA adapters on a worker, as both engines hold them (docs/workers.md, "LoRA adapters"): the
adapters loaded (vLLM's `/v1/load_lora_adapter`, `--lora-modules`), and the `max_loras` slots of
those active at once, least recently used first out. An adapter with running requests is never
evicted; a request for an adapter that cannot get a slot waits. Pure bookkeeping: the engines
decide what an activation costs (a modelled time, or the copy of its weights)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

DEFAULT_MAX_LORAS: Final = 4  # vLLM's --max-loras default


@dataclass(slots=True, eq=False)
class Adapter:
    """One loaded adapter. `weights`: the engine's own (None where it models them)."""

    name: str
    path: str
    lora_id: int  # vLLM's int id of the adapter, in its KV events (from 1)
    size_bytes: int
    running: int = 0  # admitted requests not yet finished (the emulated engine counts them)
    weights: Any = None


class Activation(NamedTuple):
    """What `activate` did: `active` False means no slot was free (the request waits)."""

    active: bool
    loaded: bool = False  # it was not resident: its weights come in now
    evicted: Adapter | None = None  # the adapter whose slot it took


class LoraSlots:
    """Loaded adapters by name and the active ones in LRU order. `busy(adapter)`: whether it
    has running requests (then it keeps its slot)."""

    def __init__(self, max_loras: int, busy: Callable[[Adapter], bool]) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        self.max_loras = max_loras
        self.busy = busy
        self.loaded: dict[str, Adapter] = {}
        self.active: OrderedDict[str, Adapter] = OrderedDict()  # least recently used first
        self.loads = 0  # activations
        self.evictions = 0
        self._next_id = 1

    def add(self, name: str, path: str, size_bytes: int, weights: Any = None) -> Adapter:
        """Register an adapter (not active yet). ValueError when the name is taken or empty."""
        if not name:
            raise ValueError("an adapter needs a name")
        if name in self.loaded:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        adapter = Adapter(name, path, self._next_id, size_bytes, weights=weights)
        self._next_id += 1
        self.loaded[name] = adapter
        return adapter

    def remove(self, name: str) -> Adapter:
        """Forget an adapter: KeyError when unknown, ValueError while it has running requests."""
        adapter = self.loaded[name]
        if self.busy(adapter):
            raise ValueError(f"The lora adapter '{name}' has requests running.")
        del self.loaded[name]
        self.active.pop(name, None)
        return adapter

    def can_activate(self, adapter: Adapter) -> bool:
        """Whether `activate` would succeed now (no change)."""
        if adapter.name in self.active or len(self.active) < self.max_loras:
            return True
        return any(not self.busy(a) for a in self.active.values())

    def activate(self, adapter: Adapter) -> Activation:
        """Make `adapter` active and the most recently used: resident already, in a free slot,
        or in the slot of the least recently used active adapter without running requests."""
        if adapter.name in self.active:
            self.active.move_to_end(adapter.name)
            return Activation(True)
        evicted = None
        if len(self.active) >= self.max_loras:
            evicted = next((a for a in self.active.values() if not self.busy(a)), None)
            if evicted is None:
                return Activation(False)
            del self.active[evicted.name]
            self.evictions += 1
        self.active[adapter.name] = adapter
        self.loads += 1
        return Activation(True, True, evicted)

    def active_names(self) -> list[str]:
        """The adapters resident in slots, most recently used last."""
        return list(self.active)
