"""LoRA adapters on the fleet (docs/adapters.md), pure and written once: per worker, the adapters
it has loaded (registered) and those active in its slots, and what making one usable there costs.
The lifecycle (router/route.py) prices candidates with it; the gateway's loader, `urc epp` and
the replay move it as adapters load, activate and leave."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, NamedTuple

LORA_SEP: Final = "+lora:"  # an adapter's kv_group: <base's kv_group>+lora:<name> (kv_mirror.py)
DEFAULT_MAX_LORAS: Final = 4  # slots of a worker that does not say (vLLM's --max-loras)
DEFAULT_SIZE_MB: Final = 64.0  # an adapter of unknown size
DEFAULT_LOAD_MB_PER_S: Final = 1000.0  # host -> GPU, reading its weights into a slot
DEFAULT_LOAD_S: Final = 0.05  # a load's fixed part: the HTTP call, opening its files
POPULARITY_DECAY: Final = 0.999  # per adapter request: popularity over the last ~1000 requests


def adapter_group(base_group: str, adapter: str) -> str:
    """The kv_group of `adapter` over a base model of `base_group` (never shared)."""
    return f"{base_group}{LORA_SEP}{adapter}"


def base_group(kv_group: str) -> str:
    """The base model's kv_group of an adapter's kv_group (itself for a base model's)."""
    return kv_group.partition(LORA_SEP)[0]


@dataclass(slots=True)
class WorkerAdapters:
    """One worker's adapters: loaded (registered, by last use, LRU first) and active in its
    `max_loras` slots (by last use), when each becomes usable, and requests in flight."""

    max_loras: int = DEFAULT_MAX_LORAS
    loaded: dict[str, float] = field(default_factory=dict)  # adapter -> last use
    active: dict[str, float] = field(default_factory=dict)  # adapter -> last use (<= slots)
    ready_at: dict[str, float] = field(default_factory=dict)  # adapter -> usable from (a load)
    in_flight: dict[str, int] = field(default_factory=dict)
    busy_until: float = 0.0  # its loads run one after another
    loads: int = 0  # loads (and activations) begun here
    unloads: int = 0  # adapters unloaded here to make room (its slot limit)

    def lru(self, among: dict[str, float], keep: str = "", idle: bool = False) -> str | None:
        """The least recently used of `among` with no request in flight (else, unless `idle`,
        the least recently used), never `keep`."""
        fallback = None
        for name in sorted(among, key=among.__getitem__):
            if name == keep:
                continue
            if not self.in_flight.get(name):
                return name
            if fallback is None:
                fallback = name
        return None if idle else fallback


class AdapterPrice(NamedTuple):
    """What making an adapter usable on one worker costs, in seconds of the request's TTFT."""

    load_s: float  # until it can run there: 0 active, activation, or load + activation
    evict_s: float  # the expected reloads of the adapter it pushes out of a full slot set


class Use(NamedTuple):
    """One request's adapter on its worker: when it is usable, what it loaded and pushed out."""

    ready_at: float  # the caller's clock
    started: bool  # it was not active there: its load (or activation) began for this request
    unloaded: str | None  # the adapter unloaded to make room (its slot limit)


class Adapters:
    """The fleet's adapters: sizes, each worker's slots, and recent popularity."""

    def __init__(
        self,
        load_mb_per_s: float = DEFAULT_LOAD_MB_PER_S,
        load_s: float = DEFAULT_LOAD_S,
        max_loras: int = DEFAULT_MAX_LORAS,
        sizes: dict[str, float] | None = None,
    ) -> None:
        if load_mb_per_s <= 0 or load_s < 0 or max_loras < 1:
            raise ValueError("load_mb_per_s > 0, load_s >= 0 and max_loras >= 1 are needed")
        self.s_per_mb = 1.0 / load_mb_per_s
        self.load_s = load_s
        self.max_loras = max_loras
        self.sizes: dict[str, float] = {}  # adapter -> size in MB
        for name, size in (sizes or {}).items():
            self.declare(name, size)
        self.workers: dict[str, WorkerAdapters] = {}
        self._popularity: dict[str, tuple[float, int]] = {}  # adapter -> (count, at request n)
        self._requests = 0

    def declare(self, adapter: str, size_mb: float | None) -> None:
        self.sizes[adapter] = size_mb if size_mb and size_mb > 0 else DEFAULT_SIZE_MB

    def worker(self, name: str) -> WorkerAdapters:
        state = self.workers.get(name)
        if state is None:
            state = self.workers[name] = WorkerAdapters(self.max_loras)
        return state

    def activate_s(self, adapter: str) -> float:
        """Seconds to read `adapter`'s weights into a slot: its size over the load rate."""
        return self.sizes.get(adapter, DEFAULT_SIZE_MB) * self.s_per_mb

    def share(self, adapter: str) -> float:
        """`adapter`'s share of the recent adapter requests (decayed, POPULARITY_DECAY)."""
        count, at = self._popularity.get(adapter, (0.0, 0))
        return count * POPULARITY_DECAY ** (self._requests - at) * (1.0 - POPULARITY_DECAY)

    def price(self, worker: str, adapter: str, now: float) -> AdapterPrice:
        """What `adapter` costs on `worker` now (docs/policies.md, "Adapters")."""
        state = self.worker(worker)
        if adapter in state.active:
            return AdapterPrice(max(0.0, state.ready_at.get(adapter, 0.0) - now), 0.0)
        load = self.activate_s(adapter)
        if adapter not in state.loaded:
            load += self.load_s
        load += max(0.0, state.busy_until - now)  # behind the loads under way there
        evict = 0.0
        if len(state.active) >= state.max_loras:
            victim = state.lru(state.active)
            if victim is not None:
                reload = self.activate_s(victim) + self.load_s
                evict = reload * min(1.0, self.share(victim) * state.max_loras)
        return AdapterPrice(load, evict)

    def use(self, worker: str, adapter: str, now: float) -> Use:
        """A request for `adapter` goes to `worker`: loaded and activated there if it is not
        (after the loads under way there), the least recently used pushed out of a full slot
        set (and, beyond the slot limit, the least recently used with no request in flight
        unloaded); its popularity counted, its request in flight until `finish`."""
        self._count(adapter)
        state = self.worker(worker)
        state.in_flight[adapter] = state.in_flight.get(adapter, 0) + 1
        loaded, unloaded = adapter not in state.loaded, None
        started = adapter not in state.active
        if started:
            start = max(now, state.busy_until)
            cost = self.activate_s(adapter) + (self.load_s if loaded else 0.0)
            state.busy_until = state.ready_at[adapter] = start + cost
            state.loads += 1
            if len(state.active) >= state.max_loras:
                victim = state.lru(state.active, adapter)
                if victim is not None:
                    del state.active[victim]
            if loaded and len(state.loaded) >= state.max_loras:
                unloaded = state.lru(state.loaded, adapter, idle=True)
                if unloaded is not None:
                    state.unloads += 1
                    self.unloaded(worker, unloaded)
        state.loaded[adapter] = state.active[adapter] = now
        return Use(state.ready_at.get(adapter, now), started, unloaded)

    def finish(self, worker: str, adapter: str) -> None:
        """A request for `adapter` on `worker` ended."""
        in_flight = self.worker(worker).in_flight
        left = in_flight.get(adapter, 0) - 1
        if left > 0:
            in_flight[adapter] = left
        else:
            in_flight.pop(adapter, None)

    def registered(self, worker: str, adapter: str, now: float) -> None:
        """`adapter` was loaded on `worker` (the gateway's load call succeeded): not yet active."""
        self.worker(worker).loaded[adapter] = now

    def unloaded(self, worker: str, adapter: str) -> None:
        state = self.worker(worker)
        for table in (state.loaded, state.active, state.ready_at):
            table.pop(adapter, None)

    def observe(
        self, worker: str, loaded: Iterable[str], active: Iterable[str] | None, max_loras: int
    ) -> None:
        """What `worker` says it has (its /urc/info, vLLM's /v1/models and metrics): loaded
        adapters, those active (None: unsaid, all loaded are), its slots (0: unsaid)."""
        state = self.worker(worker)
        if max_loras > 0:
            state.max_loras = max_loras
        said = set(loaded)
        for name in [n for n in state.loaded if n not in said]:
            self.unloaded(worker, name)
        for name in said:
            state.loaded.setdefault(name, 0.0)
        running = said if active is None else set(active)
        for name in [n for n in state.active if n not in running]:
            del state.active[name]
        for name in running:
            if name in state.loaded:
                state.active.setdefault(name, 0.0)

    def totals(self) -> tuple[int, int]:
        """Loads and unloads over every worker."""
        states = self.workers.values()
        return sum(s.loads for s in states), sum(s.unloads for s in states)

    def observe_active(self, worker: str, active: list[str], max_loras: int) -> None:
        """What `worker`'s load report says: the adapters active (running or waiting there,
        so loaded) and its slots (0: unsaid)."""
        state = self.worker(worker)
        if max_loras > 0:
            state.max_loras = max_loras
        in_flight = state.in_flight  # sent there since: it says them in its next report
        for name in [n for n in state.active if n not in active and not in_flight.get(n)]:
            del state.active[name]
        for name in active:
            state.loaded.setdefault(name, 0.0)
            state.active.setdefault(name, 0.0)

    def forget(self, worker: str) -> None:
        """`worker` left the fleet (or restarted): it holds nothing now."""
        self.workers.pop(worker, None)

    def _count(self, adapter: str) -> None:
        self._requests += 1
        count, at = self._popularity.get(adapter, (0.0, self._requests))
        self._popularity[adapter] = (
            count * POPULARITY_DECAY ** (self._requests - at) + 1.0,
            self._requests,
        )
