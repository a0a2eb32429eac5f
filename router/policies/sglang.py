"""SGLang router's `cache_aware` decision over our unified index; the original, its ties, its
tree size and how ours differs: docs/policies.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from router.policies.base import Candidate, Decision, RouteRequest


class SGLangCacheAwarePolicy:
    """SGLang's cache_aware. Score cost: load if imbalanced, uncached tokens if a cache hit,
    tree size (routed tokens, or cached blocks) otherwise."""

    name: ClassVar[str] = "sglang"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        tree_size: str = "routed",
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if balance_abs_threshold < 0 or balance_rel_threshold < 0:
            raise ValueError("balance thresholds must not be negative")
        if tree_size not in ("routed", "index"):
            raise ValueError("tree_size must be 'routed' or 'index'")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree_size = tree_size
        self._routed: dict[str, dict[str, int]] = {}  # kv_group -> worker -> tokens sent, new

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        block_size, prompt = request.block_size, request.prompt_tokens
        routed = self._routed.get(request.kv_group)
        if routed is None:
            routed = self._routed[request.kv_group] = {}
        sizes = (
            [routed.get(c.worker, 0) for c in candidates]
            if self.tree_size == "routed"
            else [c.cached_blocks for c in candidates]
        )
        least = most = best_match = smallest = 0
        for i, c in enumerate(candidates):  # strict comparisons keep the first extreme, as Rust
            if c.in_flight < candidates[least].in_flight:
                least = i
            if c.in_flight > candidates[most].in_flight:
                most = i
            if c.matched_blocks > candidates[best_match].matched_blocks:
                best_match = i
            if sizes[i] < sizes[smallest]:
                smallest = i
        max_load, min_load = candidates[most].in_flight, candidates[least].in_flight

        if (
            max_load - min_load > self.balance_abs_threshold
            and max_load > min_load * self.balance_rel_threshold
        ):
            chosen, reason = least, "imbalanced"
            costs = [float(c.in_flight) for c in candidates]
        else:
            matched = min(candidates[best_match].matched_blocks * block_size, prompt)
            match_rate = matched / prompt if prompt > 0 else 0.0
            if match_rate > self.cache_threshold:
                chosen, reason = best_match, "cache_hit"
                costs = [
                    float(prompt - min(c.matched_blocks * block_size, prompt)) for c in candidates
                ]
            else:
                chosen, reason = smallest, "smallest_tree"
                costs = [float(size) for size in sizes]

        worker = candidates[chosen]
        uncached = prompt - min(worker.matched_blocks * block_size, prompt)
        routed[worker.worker] = routed.get(worker.worker, 0) + uncached  # SGLang's tree.insert
        return Decision(worker.worker, reason, request, candidates, costs)
