"""The torch engine's LoRA adapters (docs/workers.md, "LoRA adapters"): each adapter of the
default model is a model state of its own, its kv_group `<base kv_group>+lora:<name>` a tree in
the base's page pool, its runner the base's weights and attention plus the adapter's deltas. It
runs only while it holds one of the `max_loras` slots (backends/lora_slots.py); taking one copies
its weights to the device, losing one drops them there."""

from __future__ import annotations

from dataclasses import replace

from backends.lora_slots import Adapter, LoraSlots
from backends.torch_worker.lora import LoraWeights, read_adapter
from backends.torch_worker.model import ModelRunner
from backends.torch_worker.scheduler import ModelState


class TorchAdapters:
    def __init__(self, base: ModelState, max_loras: int) -> None:
        self.base = base
        self.slots = LoraSlots(max_loras, self._busy)
        self.states: dict[str, ModelState] = {}  # adapter name -> its state
        self.by_group: dict[str, Adapter] = {}  # its kv_group -> the adapter

    def _busy(self, adapter: Adapter) -> bool:
        return bool(self.states[adapter.name].running)

    def add(self, name: str, path: str) -> ModelState:
        """Read the adapter into host memory and make its state (not active yet). ValueError when
        the name is taken or the files are not an adapter of the base."""
        base = self.base.loaded
        if name in self.slots.loaded:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        weights = read_adapter(path, base.model, base.dtype)
        adapter = self.slots.add(name, path, weights.nbytes(), weights)
        runner = self.base.runner
        state = ModelState(
            replace(base, kv_group=f"{base.kv_group}+lora:{name}"),
            ModelRunner(runner.model, runner.attention, runner.device),
            self.base.pool,
        )
        self.states[name] = state
        self.by_group[state.loaded.kv_group] = adapter
        self.base.pool.cache.root(state.loaded.kv_group)  # its tree exists from now
        return state

    def forget(self, name: str) -> ModelState:
        """Drop the adapter's state once `slots.remove` let it go and its blocks are dropped."""
        state = self.states.pop(name)
        del self.by_group[state.loaded.kv_group]
        state.runner.lora = None
        del self.base.pool.cache.trees[state.loaded.kv_group]
        return state

    def ready(self, state: ModelState) -> bool:
        """Whether `state` may run a forward pass now: a base model, or an adapter that holds a
        slot or takes one (its weights copied in; the evicted one's dropped)."""
        adapter = self.by_group.get(state.loaded.kv_group)
        if adapter is None:
            return True
        done = self.slots.activate(adapter)
        if done.evicted is not None:
            self.states[done.evicted.name].runner.lora = None
        if done.loaded:
            weights: LoraWeights = adapter.weights
            state.runner.lora = weights.to(state.runner.device)
        return done.active

    def check(self) -> None:
        """The active adapters have their weights on the device, the others not; an adapter
        with running requests is active."""
        assert len(self.slots.active) <= self.slots.max_loras, "adapters over max_loras"
        for name, state in self.states.items():
            active = name in self.slots.active
            assert (state.runner.lora is not None) == active, f"adapter {name}'s weights"
            assert active or not state.running, f"adapter {name} runs without a slot"
