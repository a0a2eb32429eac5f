"""Which policy routes, and which only watch: the live policy, or plain least load while
*degraded* (by the operator, or by the gateway while every KV-event stream is lost); shadow
policies choose on every request without being acted on (router/shadow.py counts them).
"""

from __future__ import annotations

from router.gateway.routing import Plan
from router.policies import Policy, make_policy
from router.shadow import ShadowPolicies


class RoutingModes:
    def __init__(
        self, live: Policy, shadows: list[str], prefill_tokens_per_s: float, degraded: bool
    ) -> None:
        self.live = live
        self.fallback = make_policy("least_load")
        self.manual = degraded  # the operator's switch
        self.auto = False  # the index is unhealthy
        # the same counting as `urc replay --shadow` (router/shadow.py)
        self.shadow = ShadowPolicies(shadows, prefill_tokens_per_s)
        self.shadows = self.shadow.policies
        self.stats = self.shadow.stats

    @property
    def degraded(self) -> bool:
        return self.manual or self.auto

    def active(self) -> Policy:
        return self.fallback if self.degraded else self.live

    def watch(self, plan: Plan) -> None:
        """Run every shadow policy on this request's candidates; count what it would do."""
        self.shadow.watch(plan.request, plan.decision.candidates, plan.decision.worker)

    def describe(self) -> dict[str, object]:
        return {
            "mode": "degraded" if self.degraded else "live",
            "live_policy": self.live.name,
            "active_policy": self.active().name,
            "degraded_by_operator": self.manual,
            "degraded_by_index_health": self.auto,
            "shadows": self.shadow.describe(),
        }
