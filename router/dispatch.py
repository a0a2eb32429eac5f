"""A request's dispatch (docs/dispatch.md), shared by the gateway and the replay: the candidates
a policy sees, the load it adds (`LoadShare`), the residency the gateway writes itself."""

from __future__ import annotations

import math
from collections.abc import Sequence

from router.index import UnifiedIndex
from router.policies import Candidate, RouteRequest, WorkerLoad


def candidates(
    index: UnifiedIndex, request: RouteRequest, loads: list[WorkerLoad], now: float
) -> list[Candidate]:
    """What the policy sees of each worker in `loads` (the kv_group's, in the fleet's order):
    its match (used now, for the index's LRU) and the host tier's run after it, a copy of its
    load, its cache's sizes."""
    group = request.kv_group
    keys = request.block_keys
    matched = index.match(keys, group, now)
    host = index.host_match(keys, group, matched)  # None without host tiers: nothing to read
    seen: list[Candidate] = []
    for w in loads:
        name = w.worker
        held, stored = index.sizes(name, group)
        found = matched.get(name, 0)
        queued, running = w.queued_prefill_tokens, w.running_decode
        c = Candidate(name, found, w.in_flight, queued, running, held, stored)
        if host is not None:
            c.host_blocks = host.get(name, 0)
        seen.append(c)
    return seen


def candidate(candidates: Sequence[Candidate], worker: str) -> Candidate:
    for c in candidates:  # a few candidates: a scan, not a dict per request
        if c.worker == worker:
            return c
    raise KeyError(worker)


class LoadShare:
    """One request's share of its worker's load (docs/dispatch.md: the load ledger)."""

    __slots__ = ("load", "uncached", "started", "done")

    def __init__(self, load: WorkerLoad, uncached: int) -> None:
        self.load = load
        self.uncached = uncached
        self.started = False
        self.done = False
        load.in_flight += 1
        load.queued_prefill_tokens += uncached

    def first_token(self) -> None:
        if not self.started and not self.done:
            self.started = True
            self.load.queued_prefill_tokens -= self.uncached
            self.load.running_decode += 1

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        load = self.load
        if self.started:
            load.running_decode -= 1
        else:
            load.queued_prefill_tokens -= self.uncached
        load.in_flight -= 1


def dispatch(
    index: UnifiedIndex, request: RouteRequest, chosen: Candidate, load: WorkerLoad
) -> LoadShare:
    """Send `request` to `chosen` (whose load is `load`): its uncached tokens join the queue.
    Host-tier blocks are copied, not computed: they do not, while the GPU match before them is
    confirmed."""
    blocks = request.matched_tokens(chosen.matched_blocks) // request.block_size
    held = index.confirmed_depth(request.block_keys, chosen.worker, request.kv_group, blocks)
    if chosen.host_blocks and held == blocks:
        held = request.matched_tokens(blocks + chosen.host_blocks) // request.block_size
    return LoadShare(load, request.prompt_tokens - held * request.block_size)


class RoutedResidency:
    """The residency the gateway writes into `index` itself (docs/dispatch.md)."""

    __slots__ = ("index", "invalidated_at")

    def __init__(self, index: UnifiedIndex) -> None:
        self.index = index
        # when the last admin invalidation began (the caller's clock): a response to a request
        # routed before it must not bring back approximate residency the invalidation dropped
        self.invalidated_at = -math.inf

    def dispatched(
        self, request: RouteRequest, worker: str, kv_group: str, exact: bool, now: float
    ) -> None:
        """Requests right behind this one find its prefix on an exact worker before its KV
        events say so. Failover elsewhere is rare: the TTL clears the mark then."""
        if exact and request.block_keys and self.index.pending_ttl_s > 0:
            self.index.insert(request.block_keys, worker, kv_group, now, pending=True)

    def served(
        self,
        request: RouteRequest,
        worker: str,
        kv_group: str,
        exact: bool,
        arrived: float,
        now: float,
    ) -> None:
        """A success on a worker without KV events: it holds the prompt now, approximately."""
        if not exact and request.block_keys and arrived > self.invalidated_at:
            self.index.insert(request.block_keys, worker, kv_group, now, approximate=True)
