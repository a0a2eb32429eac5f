"""What runs: for one model per step, its batch of decodes and prefill chunks; everything by
vLLM's `priority` first (lower earlier), then admission longest cached prefix first, preemption
of the pool's worst-ranked newest request (docs/workers.md)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import count

from backends.cache.host import HostTier
from backends.cache.radix import RadixCache
from backends.torch_worker.host_pool import HostPagePool
from backends.torch_worker.loader import LoadedModel
from backends.torch_worker.model import ModelRunner, WorkItem
from backends.torch_worker.paging import (
    PagePool,
    admit,
    grow,
    matched_blocks,
    pages_needed,
    release,
)
from backends.torch_worker.request import Request, Status
from core.settings import setting


@dataclass(slots=True, eq=False)
class PoolState:
    """A page pool, its cache and every request that holds pages in it."""

    memory: PagePool  # the K/V tensor
    cache: RadixCache  # which of its pages hold what
    running: list[Request] = field(default_factory=list)  # admission order
    host: HostTier | None = None  # the host tier under the cache (docs/tiers.md)
    host_memory: HostPagePool | None = None  # its K/V tensor


@dataclass(slots=True, eq=False)
class ModelState:
    """One set of weights (one kv_group) and its queues."""

    loaded: LoadedModel
    runner: ModelRunner
    pool: PoolState
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)  # admission order

    def drop(self, req: Request) -> None:
        """A running request leaves the batch: its private pages and its lock go back."""
        release(self.pool.cache, req)
        self.running.remove(req)
        self.pool.running.remove(req)


@dataclass(slots=True)
class SchedulerConfig:
    chunk_size: int = setting(512, "prefill tokens per forward pass")  # of a model
    max_running: int = setting(64, "requests in a model's batch")
    protect_tokens: int = setting(
        64, "prefill tokens a pass for worse-ranked requests while a better one is here (0: off)"
    )
    prefix_cache: bool = True
    lpf_limit: int = 128

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.max_running < 1 or self.protect_tokens < 0:
            raise ValueError("need chunk_size, max_running >= 1 and protect_tokens >= 0")


class Scheduler:
    def __init__(self, config: SchedulerConfig, models: dict[str, ModelState]) -> None:
        self.config = config
        self.models = models  # kv_group -> state
        self._order = count()

    def schedule(self, ms: ModelState, admitted: list[Request]) -> list[WorkItem]:
        """The model's batch for this step (empty: nothing to run). Newly admitted requests
        are appended to `admitted`. The chunk budget goes by priority band, best first: in a
        band, the running requests (admission order), then admissions from its waiting ones
        (`_admission_order`). A request that cannot be admitted stops all admissions. The
        bands after the best one share at most `protect_tokens` of prefill (the step budget:
        the best band's steps stay short); a request's protect hint counts as a band present,
        so a better rank active elsewhere in the pool is protected before it arrives here."""
        bs = ms.pool.cache.block_size
        items: list[WorkItem] = []
        budget = self.config.chunk_size
        present = [*ms.running, *ms.waiting]
        hinted = {r.protect for r in present if r.protect is not None and r.protect < r.priority}
        bands = sorted({r.priority for r in present} | hinted)
        protect = self.config.protect_tokens
        left = protect if protect and len(bands) > 1 else budget  # of the worse bands
        admitting = True
        for band in bands:
            capped = band != bands[0]
            for req in [r for r in ms.running if r.priority == band]:
                if req.status is not Status.RUNNING:
                    continue  # preempted while this batch was being built
                room = min(budget, left) if capped else budget
                n = 1 if req.pending == 1 else min(req.pending, room)
                if n == 0:
                    continue
                if not self._reserve(req, pages_needed(req, n, bs), items):
                    continue
                items.append(WorkItem(req, n))
                if req.pending > 1:
                    budget -= n
                    left -= n if capped else 0
            for req in self._admission_order(ms, band) if admitting else []:
                n = self._admit(ms, req, min(budget, left) if capped else budget, admitted)
                admitting = n > 0
                if not admitting:
                    break
                items.append(WorkItem(req, n))
                budget -= n
                left -= n if capped else 0
        return items

    def _admit(self, ms: ModelState, req: Request, budget: int, admitted: list[Request]) -> int:
        """Move a waiting request into the batch with its first chunk of at most `budget`
        tokens: the chunk's length, or 0 when there is no budget, place or room."""
        if budget <= 0 or len(ms.running) >= self.config.max_running:
            return 0
        cache = ms.pool.cache
        bs = cache.block_size
        host = ms.pool.host
        promoted = admit(cache, req, ms.loaded.kv_group, self.config.prefix_cache, host)
        n = min(req.pending, budget)
        need = pages_needed(req, n, bs)
        decoding = sum(1 for r in ms.pool.running if r.pending == 1)
        if not cache.can_allocate(need + decoding) or not grow(cache, req, need):
            release(cache, req)
            if not req.admitted:  # what it promoted stays on the GPU for its next try
                req.host_hit_tokens += promoted * bs
            return 0
        ms.waiting.remove(req)
        req.status = Status.RUNNING
        req.order = next(self._order)
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = req.computed
            req.host_hit_tokens = min(req.host_hit_tokens + promoted * bs, req.computed)
            admitted.append(req)
        ms.running.append(req)
        ms.pool.running.append(req)
        return n

    def _admission_order(self, ms: ModelState, band: int) -> list[Request]:
        """The waiting requests of priority `band`: longest cached prefix first (up to
        `lpf_limit` of them), else first come, first served."""
        waiting = [r for r in ms.waiting if r.priority == band]
        if not self.config.prefix_cache or len(waiting) > self.config.lpf_limit:
            return waiting
        cache, host = ms.pool.cache, ms.pool.host
        group = ms.loaded.kv_group
        # stable: FCFS among equals
        return sorted(waiting, key=lambda r: -matched_blocks(cache, r, group, host))

    def _reserve(self, req: Request, need: int, items: list[WorkItem]) -> bool:
        """Pages for the request's next chunk, preempting the pool's worst-ranked (as vLLM's
        priority policy), then newest, requests until they fit. False when the request itself
        was the victim (it was preempted)."""
        pool = self.models[req.kv_group].pool
        while not grow(pool.cache, req, need):
            victim = max(pool.running, key=lambda r: (r.priority, r.order))
            self.preempt(victim)
            items[:] = [item for item in items if item.req is not victim]
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Back to the front of its queue; its cached blocks stay cached."""
        ms = self.models[req.kv_group]
        ms.drop(req)
        req.status = Status.WAITING
        req.preemptions += 1
        ms.waiting.appendleft(req)
