"""Shadow policies: choose on every request without acting, and count what the choice predicts.

The gateway (router/gateway/routing.py) and `urc replay --shadow` (simulation/shadow.py) both call
`ShadowPolicies.watch` with the candidates the live policy saw, so their numbers cannot drift.
Per policy, over the requests watched:

    predicted_hit_tokens   tokens of the prompt the index says its choice holds
    predicted_ttft_s       the cache_aware estimator's TTFT at its choice (CacheAwarePolicy.ttft
                           with the operator's prefill rate and its other defaults)
    disagreements          requests where it chose another worker than the live decision

Pure and synchronous, like the policies themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.policies import CacheAwarePolicy, Candidate, Policy, RouteRequest, make_policy


@dataclass(slots=True)
class ShadowStats:
    requests: int = 0
    predicted_hit_tokens: int = 0
    prompt_tokens: int = 0
    predicted_ttft_s: float = 0.0
    disagreements: int = 0

    def summary(self) -> dict[str, Any]:
        """Rates and means (None before the first request), as /admin/mode reports them."""
        n = self.requests
        return {
            "requests": n,
            "predicted_hit_rate": self.predicted_hit_tokens / self.prompt_tokens
            if self.prompt_tokens
            else None,
            "predicted_ttft_mean_s": self.predicted_ttft_s / n if n else None,
            "disagreement_rate": self.disagreements / n if n else None,
        }


class ShadowPolicies:
    """Policies by name (built with their defaults, as the gateway builds them), each watching
    every request; `stats[name]` is what it would have done."""

    def __init__(self, names: Sequence[str], prefill_tokens_per_s: float) -> None:
        self.estimator = CacheAwarePolicy(prefill_tokens_per_s=prefill_tokens_per_s)
        self.policies: dict[str, Policy] = {name: make_policy(name) for name in names}
        self.stats = {name: ShadowStats() for name in names}

    def watch(self, request: RouteRequest, candidates: Sequence[Candidate], live: str) -> None:
        """Ask every shadow policy about `request`; `live` is the worker actually chosen."""
        by_name = {c.worker: c for c in candidates}
        for name, policy in self.policies.items():
            decision = policy.choose(request, candidates)
            stats = self.stats[name]
            stats.requests += 1
            stats.prompt_tokens += request.prompt_tokens
            stats.predicted_hit_tokens += decision.matched_tokens
            stats.predicted_ttft_s += self.estimator.ttft(request, by_name[decision.worker])
            stats.disagreements += decision.worker != live

    def describe(self) -> dict[str, dict[str, Any]]:
        return {name: s.summary() for name, s in self.stats.items()}
