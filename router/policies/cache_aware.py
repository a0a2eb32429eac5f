"""Our policy: send each request where it costs the fleet least time to first token, a queueing
model of each worker's engine in seconds; new content goes to the cache that took the least of
it lately (docs/policies.md states the cost and why each term is there)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Final

import xxhash

from core.hardware import DEFAULT_HOST_COPY_TOKENS_PER_S, DEFAULT_PREFILL_TOKENS_PER_S
from router.policies.base import Candidate, Decision, RouteRequest

_xxh3 = xxhash.xxh3_64_intdigest
_U64: Final = (1 << 64) - 1


class Inflow:
    """One worker's recent cache inflow (a plain class: compiled, its numbers stay native)."""

    __slots__ = ("seen_stored", "blocks")

    def __init__(self, seen_stored: int = 0) -> None:  # the default: for copy.deepcopy
        self.seen_stored = seen_stored  # its stored_blocks when last seen
        self.blocks = 0.0  # blocks stored lately, decayed over one turnover of the caches


@dataclass(slots=True)
class RoutingHistory:
    """One kv_group's recent routing outcomes, decayed over one turnover of the fleet's caches
    (decisions are its only clock)."""

    hit_tokens: float = 0.0  # matched tokens at the chosen workers
    miss_tokens: float = 0.0  # uncached tokens routed, on the same clock as hit_tokens
    inflow_tokens: float = 0.0  # uncached tokens routed: what the caches stored
    free_tokens: float = 0.0  # of those, tokens of requests every candidate held equally
    inflow: dict[str, Inflow] = field(default_factory=dict)  # worker -> its recent inflow

    def record(self, hit: int, miss: int, free: bool, cache_tokens: int) -> None:
        """One decision: `hit` tokens matched and `miss` tokens to store where it went; `free`
        when every candidate held the same prefix."""
        decay = math.exp(-(hit + miss) / (cache_tokens + hit + miss + 1))
        self.hit_tokens = self.hit_tokens * decay + hit
        self.miss_tokens = self.miss_tokens * decay + miss
        decay = math.exp(-miss / (cache_tokens + miss + 1))
        self.inflow_tokens = self.inflow_tokens * decay + miss
        self.free_tokens = self.free_tokens * decay + (miss if free else 0)

    def observe(self, candidates: Sequence[Candidate]) -> None:
        """Add the blocks each worker stored since last seen to its recent inflow."""
        workers = self.inflow
        seen: list[Inflow] = []
        added: list[int] = []
        total = held = 0
        for c in candidates:
            stored = c.stored_blocks
            w = workers.get(c.worker)
            if w is None:
                w = workers[c.worker] = Inflow(stored)
            if stored >= w.seen_stored:
                n = stored - w.seen_stored
            else:  # forgotten (down, restarted) and met again: as cold as a worker that joins
                n = 0
                w.blocks = 0.0
            w.seen_stored = stored
            seen.append(w)
            added.append(n)
            total += n
            held += c.cached_blocks
        decay = math.exp(-total / (held + total + 1))
        for i, w in enumerate(seen):
            w.blocks = w.blocks * decay + added[i]

    def reuse(self, block_size: int) -> float:
        """Recent hit tokens per miss token: how often what was stored got used again."""
        return self.hit_tokens / (self.miss_tokens + block_size)

    def bound_share(self, block_size: int) -> float:
        """The share of recent uncached work that was bound to a cache (not free to move)."""
        return 1.0 - self.free_tokens / (self.inflow_tokens + block_size)


class CacheAwarePolicy:
    """Minimise the fleet's time to first token; spread what is new over the caches. It remembers
    its decisions (a `RoutingHistory` per kv_group), as SGLang's router does."""

    name: ClassVar[str] = "cache_aware"

    def __init__(
        self,
        prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
        decode_token_s: float = 2e-4,
        chunk_tokens: int = 8192,
        externality: float = 1.0,
        cache_value: float = 1.0,
        rendezvous_slack_s: float = 0.0,
        rendezvous_factor: float = 0.1,
        host_copy_tokens_per_s: float = DEFAULT_HOST_COPY_TOKENS_PER_S,
        adapter_aware: bool = True,
    ) -> None:
        if min(prefill_tokens_per_s, chunk_tokens, host_copy_tokens_per_s) <= 0:
            raise ValueError(
                "prefill_tokens_per_s, chunk_tokens and host_copy_tokens_per_s must be positive"
            )
        if min(decode_token_s, externality, cache_value) < 0:
            raise ValueError("decode_token_s, externality and cache_value must be >= 0")
        if min(rendezvous_slack_s, rendezvous_factor) < 0:
            raise ValueError("rendezvous bounds must be >= 0")
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_token_s = decode_token_s
        self.chunk_tokens = chunk_tokens
        self.externality = externality
        self.cache_value = cache_value
        self.rendezvous_slack_s = rendezvous_slack_s
        self.rendezvous_factor = rendezvous_factor
        self.host_copy_tokens_per_s = host_copy_tokens_per_s
        # False: blind to LoRA adapters' loads and slots (the baseline of docs/adapters.md)
        self.adapter_aware = adapter_aware
        self._s_per_token = 1.0 / prefill_tokens_per_s
        self._s_per_copy = 1.0 / host_copy_tokens_per_s  # a host-tier block's promotion
        self._name_bytes: dict[str, bytes] = {}
        self._history: dict[str, RoutingHistory] = {}

    def price_host_copies(self, tokens_per_s: float) -> None:
        """Price host-tier hits at a measured copy rate (the gateway's: what its workers report,
        when none is configured)."""
        if tokens_per_s <= 0:
            raise ValueError("host_copy_tokens_per_s must be positive")
        self.host_copy_tokens_per_s = tokens_per_s
        self._s_per_copy = 1.0 / tokens_per_s

    def ttft(self, request: RouteRequest, candidate: Candidate) -> float:
        """Estimated seconds to this request's first token on `candidate` (its own queue, and
        the copy of its host-tier blocks back to the GPU)."""
        gpu = min(candidate.matched_blocks * request.block_size, request.prompt_tokens)
        blocks = candidate.matched_blocks + candidate.host_blocks
        matched = min(blocks * request.block_size, request.prompt_tokens)
        work = float(candidate.queued_prefill_tokens + request.prompt_tokens - matched)
        steps = -(-work // self.chunk_tokens)  # chunks; at least one step (no builtins: hot)
        if steps < 1.0:
            steps = 1.0
        wait = work * self._s_per_token + steps * candidate.running_decode * self.decode_token_s
        return wait + (matched - gpu) * self._s_per_copy

    def history(self, kv_group: str) -> RoutingHistory:
        """What the policy has learnt of `kv_group` from its own decisions (made on first use)."""
        history = self._history.get(kv_group)
        if history is None:
            history = self._history[kv_group] = RoutingHistory()
        return history

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        block_size, prompt = request.block_size, request.prompt_tokens
        costs = self._costs(request, candidates)
        best, best_cost, n_best = 0, math.inf, 0
        most_blocks, fewest_blocks, held = -1, 1 << 62, 0
        for i, c in enumerate(candidates):  # plain comparisons, no builtins: the hot path
            cost = costs[i]
            if cost < best_cost:
                best, best_cost, n_best = i, cost, 1
            elif cost == best_cost:
                n_best += 1
            blocks = c.matched_blocks + c.host_blocks  # a host hit is a hit
            if blocks > most_blocks:
                most_blocks = blocks
            if blocks < fewest_blocks:
                fewest_blocks = blocks
            held += c.cached_blocks

        keys = request.block_keys
        n_keys = len(keys)
        if n_keys == 0:  # no full block, nothing to hash: lowest cost, then fewest in flight
            best = min(
                range(len(candidates)),
                key=lambda i: (costs[i], candidates[i].in_flight, candidates[i].worker),
            )
            return Decision(candidates[best].worker, "cold_miss", request, candidates, costs)

        free = fewest_blocks == most_blocks
        if free and most_blocks < n_keys:
            # Everyone holds the same prefix and the rest is new: fill the emptiest cache
            # among the workers fast enough, by the first new block where that ties.
            best = self._place_new(request, candidates, keys[most_blocks])
        elif n_best > 1:  # exact tie: hash the first block the tied workers do not all hold
            tied: list[int] = []
            shared = n_keys - 1
            for i, cost in enumerate(costs):
                if cost == best_cost:
                    tied.append(i)
                    blocks = candidates[i].matched_blocks + candidates[i].host_blocks
                    if blocks < shared:
                        shared = blocks
            best = self._rendezvous_among(candidates, tied, keys[shared])

        chosen = candidates[best]
        blocks = chosen.matched_blocks + chosen.host_blocks
        if most_blocks <= 0:
            reason = "cold_miss"
        elif blocks < most_blocks:
            reason = "load"
        else:
            reason = "host_hit" if chosen.host_blocks else "cache_hit"
        hit = min(blocks * block_size, prompt)
        self.history(request.kv_group).record(hit, prompt - hit, free, held * block_size)
        return Decision(chosen.worker, reason, request, candidates, costs)

    def _costs(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """`cost` of every candidate, inlined: this loop is the hot path."""
        block_size, prompt = request.block_size, request.prompt_tokens
        chunk = self.chunk_tokens
        s_per_token, s_per_copy = self._s_per_token, self._s_per_copy
        decode_token_s = self.decode_token_s
        n = len(candidates)
        waiting = queued = 0
        for c in candidates:
            waiting += c.in_flight
            queued += c.queued_prefill_tokens
        history = self.history(request.kv_group)
        share = history.bound_share(block_size)
        base = queued / n * (1.0 - share)  # backlog = base + share * queued_prefill_tokens
        # requests each uncached token delays, pooled as the backlog is: s_delay per uncached
        # token = delay_base + delay_own * in_flight
        delay_base = self.externality * waiting / n * (1.0 - share) * s_per_token
        delay_own = self.externality * share * s_per_token
        s_evict = self.cache_value * history.reuse(block_size) * s_per_token  # on a full cache
        costs: list[float] = []
        for c in candidates:
            matched = c.matched_blocks * block_size
            if matched > prompt:
                matched = prompt
            uncached = prompt - matched
            copy_s = 0.0  # host-tier tokens, promoted on this request's critical path
            if c.host_blocks:
                copied = (c.matched_blocks + c.host_blocks) * block_size
                if copied > prompt:
                    copied = prompt
                copied -= matched
                uncached -= copied
                copy_s = copied * s_per_copy
            work = base + share * c.queued_prefill_tokens + uncached
            s_delay = delay_base + delay_own * c.in_flight
            cost = (
                work * s_per_token
                + copy_s
                + uncached * (s_delay + s_evict if c.stored_blocks > c.cached_blocks else s_delay)
            )
            if c.running_decode:
                steps = -(-work // chunk)
                if steps < 1.0:
                    steps = 1.0
                cost += steps * c.running_decode * decode_token_s
            costs.append(cost)
        if request.adapter and self.adapter_aware:  # its load and eviction, where not active
            for i, c in enumerate(candidates):
                costs[i] += c.adapter_s
        return costs

    def _place_new(self, request: RouteRequest, candidates: Sequence[Candidate], key: int) -> int:
        """The worker within the wait bound whose cache took the least new content lately
        (stored over the last turnover, plus routed and not yet prefilled); ties by rendezvous."""
        waits = [self.ttft(request, c) for c in candidates]  # the same new tokens for all
        if request.adapter and self.adapter_aware:
            waits = [w + c.adapter_s for w, c in zip(waits, candidates, strict=True)]
        fastest = min(waits)
        bound = fastest + max(self.rendezvous_slack_s, self.rendezvous_factor * fastest)
        history = self.history(request.kv_group)
        history.observe(candidates)
        recent = history.inflow
        block_size = request.block_size
        least = math.inf
        emptiest: list[int] = []
        for i, c in enumerate(candidates):
            if waits[i] > bound:
                continue
            inflow = recent[c.worker].blocks + c.queued_prefill_tokens / block_size
            if inflow < least:
                least = inflow
                emptiest = [i]
            elif inflow == least:
                emptiest.append(i)
        return self._rendezvous_among(candidates, emptiest, key)

    def _weight(self, worker: str, key: int) -> int:
        """Rendezvous weight: xxh3_64(worker name, seed=block key); same in every process."""
        raw = self._name_bytes.get(worker)
        if raw is None:
            raw = self._name_bytes[worker] = worker.encode()
        return _xxh3(raw, key & _U64)

    def _rendezvous_among(self, candidates: Sequence[Candidate], among: list[int], key: int) -> int:
        """The one of `among` with the highest rendezvous weight for `key` (first on a tie)."""
        best = among[0]
        if len(among) > 1:
            top = self._weight(candidates[best].worker, key)
            for i in among[1:]:
                weight = self._weight(candidates[i].worker, key)
                if weight > top:
                    best, top = i, weight
        return best
