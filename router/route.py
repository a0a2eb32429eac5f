"""A request's routing lifecycle (docs/dispatch.md), written once: the gateway, the endpoint
picker and the replay each keep only their I/O around it.

    route = routing.route(request, loads, policy, now)          # 1. match, choose
    share = route.attempt(worker, kv_group, exact, load, now)   # 2. each try: its load
    share.first_token()                                         # 3. the first byte
    share.finish(); route.done(worker, kv_group, exact, now)    # 4. the answer

Pure and synchronous, and the only request-path code that touches the index. Admission (flow
control) is a step before `route`: a request may wait there, and is routed against the loads of
the moment it leaves."""

from __future__ import annotations

import math
from collections.abc import Iterator

from router.adapters import Adapters
from router.index import UnifiedIndex
from router.policies import Candidate, Decision, Policy, RouteRequest, WorkerLoad


def candidates(
    index: UnifiedIndex,
    request: RouteRequest,
    loads: list[WorkerLoad],
    now: float,
    adapters: Adapters | None = None,
) -> list[Candidate]:
    """What the policy sees of each worker in `loads` (the kv_group's, in the fleet's order):
    its match (used now, for the index's LRU) and the host tier's run after it, a copy of its
    load, its cache's sizes; for an adapter's request, its adapter's price there."""
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
    if request.adapter and adapters is not None:
        adapter = request.adapter
        for c in seen:
            price = adapters.price(c.worker, adapter, now)
            c.adapter_s = price.load_s + price.evict_s
    return seen


class LoadShare:
    """One attempt's share of its worker's load (docs/dispatch.md: the load ledger)."""

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


class Routing:
    """The lifecycle's state over one index: routes requests, and owns the residency the
    gateway writes itself (pending and approximate: docs/index.md)."""

    __slots__ = ("index", "invalidated_at", "adapters")

    def __init__(self, index: UnifiedIndex, adapters: Adapters | None = None) -> None:
        self.index = index
        self.adapters = adapters  # LoRA adapters' placement (None: no adapters served)
        # when the last admin invalidation began (the caller's clock): a response to a request
        # routed before it must not bring back approximate residency the invalidation dropped
        self.invalidated_at = -math.inf

    def route(
        self,
        request: RouteRequest,
        loads: list[WorkerLoad],
        policy: Policy,
        now: float,
        salt: str | None = None,
        public_blocks: int = 0,
    ) -> Route:
        """Match `request` against the workers of `loads` and let `policy` choose. `salt`: the
        namespace its keys start after `public_blocks` shared blocks (scoped invalidation finds
        it there)."""
        keys = request.block_keys
        if salt and len(keys) > public_blocks:
            self.index.tag_namespace(keys[public_blocks], salt)
        seen = candidates(self.index, request, loads, now, self.adapters)
        return Route(self, policy.choose(request, seen), now)

    def uncached(self, request: RouteRequest, now: float) -> int:
        """The prompt tokens the best-placed worker of its kv_group would compute: what
        admission charges a request before it is routed (docs/flow-control.md)."""
        best = 0
        for blocks in self.index.match(request.block_keys, request.kv_group, now).values():
            if blocks > best:
                best = blocks
        return request.prompt_tokens - request.matched_tokens(best)

    def done(
        self,
        request: RouteRequest,
        worker: str,
        kv_group: str,
        exact: bool,
        arrived: float,
        now: float,
    ) -> None:
        """`request`, routed at `arrived`, succeeded on `worker`: one without KV events holds the
        prompt now, approximately (unless an invalidation began after it was routed)."""
        if not exact and request.block_keys and arrived > self.invalidated_at:
            self.index.insert(request.block_keys, worker, kv_group, now, approximate=True)

    def expire(self, now: float) -> None:
        """Approximate and pending residency past its TTL leaves the index: every health
        interval, on the gateway's clock or the replay's."""
        self.index.expire(now)


class Route:
    """One routed request: what the policy saw and chose, and its attempts' bookkeeping."""

    __slots__ = ("routing", "decision", "arrived", "marked", "chosen")

    def __init__(self, routing: Routing, decision: Decision, arrived: float) -> None:
        self.routing = routing
        self.decision = decision
        self.arrived = arrived  # the caller's clock when routing began
        self.marked = False  # its prefix is marked pending on the first worker tried
        self.chosen = self._scan(decision.worker)  # the candidate asked for most

    @property
    def request(self) -> RouteRequest:
        return self.decision.request

    @property
    def worker(self) -> str:
        """The worker the policy chose."""
        return self.decision.worker

    def candidate(self, worker: str) -> Candidate:
        chosen = self.chosen
        return chosen if chosen.worker == worker else self._scan(worker)

    def _scan(self, worker: str) -> Candidate:
        for c in self.decision.candidates:  # a few candidates: a scan, not a dict per request
            if c.worker == worker:
                return c
        raise KeyError(worker)

    def ranked(self) -> Iterator[str]:
        """The chosen worker, then (only if asked for: failover) the rest by the policy's
        cost."""
        yield self.decision.worker
        yield from self.decision.ranked()[1:]

    def matched(self, worker: str) -> int:
        """Tokens of the prompt `worker` can reuse, as the index says, in either tier: the
        prediction of the cached tokens it reports."""
        c = self.candidate(worker)
        return self.decision.request.matched_tokens(c.matched_blocks + c.host_blocks)

    def host_matched(self, worker: str) -> int:
        """Of `matched(worker)`, the tokens in its host tier (docs/tiers.md)."""
        c = self.candidate(worker)
        return self.decision.request.host_tokens(c.matched_blocks, c.host_blocks)

    def attempt(
        self, worker: str, kv_group: str, exact: bool, load: WorkerLoad, now: float
    ) -> LoadShare:
        """Send the request to `worker` (whose load is `load`): its uncached tokens join the
        queue. Host-tier blocks are copied, not computed: they do not, while the GPU match
        before them is confirmed. The first attempt marks its prefix pending on an exact
        worker, so requests right behind it find it before its KV events say so (failover
        elsewhere is rare: the TTL clears the mark then)."""
        request = self.decision.request
        index = self.routing.index
        if not self.marked:
            self.marked = True
            if exact and request.block_keys and index.pending_ttl_s > 0:
                index.insert(request.block_keys, worker, kv_group, now, pending=True)
        chosen = self.candidate(worker)
        blocks = request.matched_tokens(chosen.matched_blocks) // request.block_size
        held = index.confirmed_depth(request.block_keys, worker, kv_group, blocks)
        if chosen.host_blocks and held == blocks:
            held = request.matched_tokens(blocks + chosen.host_blocks) // request.block_size
        return LoadShare(load, request.prompt_tokens - held * request.block_size)

    def done(self, worker: str, kv_group: str, exact: bool, now: float) -> None:
        """A success on `worker` (`Routing.done`)."""
        self.routing.done(self.decision.request, worker, kv_group, exact, self.arrived, now)
