"""Shadow policies (docs/policies.md): choose on every request without acting, and count what
each choice predicts. The gateway (router/gateway/routing.py) and `urc replay --shadow`
(simulation/shadow.py) both call `ShadowPolicies.watch`, so their numbers cannot drift."""

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

    def count(self, request: RouteRequest, matched_tokens: int, ttft_s: float, same: bool) -> None:
        """One request: tokens and TTFT predicted at the choice; `same`: it was the live one."""
        self.requests += 1
        self.prompt_tokens += request.prompt_tokens
        self.predicted_hit_tokens += matched_tokens
        self.predicted_ttft_s += ttft_s
        self.disagreements += not same

    def summary(self) -> dict[str, Any]:
        """Rates and means (None before the first request), as /admin/mode reports them."""
        n, prompt = self.requests, self.prompt_tokens
        return {
            "requests": n,
            "predicted_hit_rate": self.predicted_hit_tokens / prompt if prompt else None,
            "predicted_ttft_mean_s": self.predicted_ttft_s / n if n else None,
            "disagreement_rate": self.disagreements / n if n else None,
        }


class ShadowPolicies:
    """Policies by name (their defaults, told the fleet's prefill speed, as the gateway builds
    them), each watching every request; `stats[name]` is what it would have done."""

    def __init__(self, names: Sequence[str], prefill_tokens_per_s: float) -> None:
        self.estimator = CacheAwarePolicy(prefill_tokens_per_s=prefill_tokens_per_s)
        told = {"prefill_tokens_per_s": prefill_tokens_per_s}
        self.policies: dict[str, Policy] = {name: make_policy(name, told) for name in names}
        self.stats = {name: ShadowStats() for name in names}

    def watch(self, request: RouteRequest, candidates: Sequence[Candidate], live: str) -> None:
        """Ask every shadow policy about `request`; `live` is the worker actually chosen."""
        by_name = {c.worker: c for c in candidates}
        for name, policy in self.policies.items():
            decision = policy.choose(request, candidates)
            ttft = self.estimator.ttft(request, by_name[decision.worker])
            self.stats[name].count(request, decision.matched_tokens, ttft, decision.worker == live)

    def describe(self) -> dict[str, dict[str, Any]]:
        return {name: s.summary() for name, s in self.stats.items()}
