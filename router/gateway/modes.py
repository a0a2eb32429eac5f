"""Which policy routes, and which only watch.

- The live policy routes; *degraded*, plain least-load routing does instead: by the operator
  (admin call, config reload) or by the gateway itself while its index is unhealthy (every KV
  event stream lost), back as soon as a stream resyncs.
- Shadow policies see every request's candidates and choose too, without being acted on: per
  policy, the tokens its choice would have found cached, the time to first token the cost model
  predicts there (the cache_aware estimator), and how often it disagrees with the live choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.gateway.routing import Plan
from router.policies import CacheAwarePolicy, Policy, make_policy


@dataclass(slots=True)
class ShadowStats:
    requests: int = 0
    predicted_hit_tokens: int = 0
    prompt_tokens: int = 0
    predicted_ttft_s: float = 0.0
    disagreements: int = 0


class RoutingModes:
    def __init__(
        self, live: Policy, shadows: list[str], prefill_tokens_per_s: float, degraded: bool
    ) -> None:
        self.live = live
        self.fallback = make_policy("least_load")
        self.manual = degraded  # the operator's switch
        self.auto = False  # the index is unhealthy
        self.estimator = CacheAwarePolicy(prefill_tokens_per_s=prefill_tokens_per_s)
        self.shadows = {name: make_policy(name) for name in shadows}
        self.stats = {name: ShadowStats() for name in shadows}

    @property
    def degraded(self) -> bool:
        return self.manual or self.auto

    def active(self) -> Policy:
        return self.fallback if self.degraded else self.live

    def watch(self, plan: Plan) -> None:
        """Run every shadow policy on this request's candidates; count what it would do."""
        by_name = {c.worker: c for c in plan.candidates}
        for name, policy in self.shadows.items():
            decision = policy.choose(plan.request, plan.candidates)
            stats = self.stats[name]
            stats.requests += 1
            stats.prompt_tokens += plan.prompt_tokens
            stats.predicted_hit_tokens += decision.matched_tokens
            stats.predicted_ttft_s += self.estimator.ttft(plan.request, by_name[decision.worker])
            stats.disagreements += decision.worker != plan.decision.worker

    def describe(self) -> dict[str, object]:
        return {
            "mode": "degraded" if self.degraded else "live",
            "live_policy": self.live.name,
            "active_policy": self.active().name,
            "degraded_by_operator": self.manual,
            "degraded_by_index_health": self.auto,
            "shadows": {
                name: {
                    "requests": s.requests,
                    "predicted_hit_rate": s.predicted_hit_tokens / s.prompt_tokens
                    if s.prompt_tokens
                    else None,
                    "predicted_ttft_mean_s": s.predicted_ttft_s / s.requests
                    if s.requests
                    else None,
                    "disagreement_rate": s.disagreements / s.requests if s.requests else None,
                }
                for name, s in self.stats.items()
            },
        }
